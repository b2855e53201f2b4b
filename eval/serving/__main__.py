"""CLI of the serving benchmark: `trace`, `calibrate`, `run`, `report`, `compact`, `join`, `plot-saturated`.

See eval/serving/__init__.py."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from eval.bench.common import add_config_overrides, config_overrides, current_commit
from eval.bench.selection_trace import RECORDED_TRACE
from eval.serving import report as report_mod
from eval.serving.compact import join_saturated, merge_saturated, write_compact
from eval.serving.kernels_seen import KernelsFirstSeen
from eval.serving.metrics import summarize
from eval.serving.probe import stock_step_probe
from eval.serving.saturated_plot import plot_saturated, saturated_points
from eval.serving.setup import ALLOCATOR, LADDER, SYSTEMS, HbmCap, build, dense_iteration_s
from eval.serving.stock import CACHES
from eval.serving.trace import PRESETS, Trace, build_trace, essay_token_ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval.serving", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    trace = sub.add_parser("trace", help="build the seeded trace from real text (CPU)")
    trace.add_argument("--requests", type=int, default=40)
    trace.add_argument("--preset", choices=sorted(PRESETS), default=None, help="a named workload (trace.PRESETS)")
    trace.add_argument("--prompt-range", type=int, nargs=2, default=None, help="default 8192 65536")
    trace.add_argument(
        "--output-range",
        type=int,
        nargs=2,
        default=None,
        help="output tokens; default 32 128 (a point fits one GPU call)",
    )
    trace.add_argument("--seed", type=int, default=0)
    trace.add_argument("--out", type=Path, required=True)
    for name, helptext in (
        ("calibrate", "time one dense decode iteration (the SLO unit)"),
        ("run", "one system at one rate"),
        ("probe-stock", "stock's decode step under the cap: first call, warm, uncapped, allocator counters"),
    ):
        cmd = sub.add_parser(name, help=helptext)
        cmd.add_argument("--trace", type=Path, required=True)
        cmd.add_argument("--shape", default="llama3-8b", help="random-weight model shape (tiny: CPU smoke runs)")
        cmd.add_argument("--hbm-cap-gib", type=float, default=40.0, help="weights + KV + work, every system alike")
        cmd.add_argument("--headroom-gib", type=float, default=8.0, help="of the cap, kept for activations")
        cmd.add_argument("--dram-gib", type=float, default=48.0, help="ours with offload: the pinned host pool")
        cmd.add_argument("--max-batch", type=int, default=16)
        cmd.add_argument("--requests", type=int, default=None, help="only the first N requests of the trace")
        cmd.add_argument(
            "--skip", type=int, default=0, help="leave out the first N requests (a saturated run split into parts)"
        )
        cmd.add_argument("--out", type=Path, required=True, help="folder for the run's JSON")
    run = sub.choices["run"]
    run.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    run.add_argument(
        "--rate", type=float, nargs="+", required=True, help="requests per second (several: in turn; inf: saturated)"
    )
    run.add_argument(
        "--locality",
        choices=("real", "random"),
        default="real",
        help="ours: loads follow the recorded selection trace (real) or the random model's own picks",
    )
    run.add_argument("--deadline-s", type=float, default=300.0, help="a run stops here; unfinished requests fail")
    run.add_argument(
        "--stop-queueing-s",
        type=float,
        default=None,
        help="stock's static batches: stop once 3 batches in a row waited past this, each longer (goodput's stock side)",
    )
    add_config_overrides(run, "target_tbt_ms=150 (ours' rungs only: a variant of the rung)")
    probe = sub.choices["probe-stock"]
    probe.add_argument("--rows", type=int, default=3, help="the batch: the trace's first N prompts")
    probe.add_argument("--cache", choices=CACHES, default="dynamic", help="generate's cache")
    rep = sub.add_parser("report", help="merge run JSONs: serving.json, plots, markdown")
    rep.add_argument("runs", type=Path, nargs="+", help="folders holding run_*.json and calibration.json")
    rep.add_argument("--out", type=Path, default=Path("eval/results"))
    rep.add_argument("--name", default=None, help="the trace's block in serving.json (e.g. paper, decode_heavy)")
    small = sub.add_parser("compact", help="run JSONs without their per-token times, in one file to commit")
    small.add_argument("runs", nargs="+", metavar="NAME=RUN_JSON", help="each run under a name of its own")
    small.add_argument("--note", required=True, help="where and how the runs ran (device, calls, commits)")
    small.add_argument("--out", type=Path, required=True, help="the file (.json, or .json.xz compressed)")
    join = sub.add_parser(
        "join", help="compact saturated runs in parts, joined; ours against stock on the same requests"
    )
    join.add_argument("--stock", nargs="+", required=True, metavar="FILE:RUN", help="a stock system's parts, in order")
    join.add_argument("--ours", nargs="+", required=True, metavar="FILE:RUN", help="ours' parts, in order")
    join.add_argument("--out", type=Path, required=True, help="the joined figures and ratios (.json)")
    join.add_argument(
        "--serving-block", default=None, help="also write them as this trace's saturated point in serving.json"
    )
    join.add_argument("--serving-json", type=Path, default=Path("eval/results/serving.json"))
    bars = sub.add_parser("plot-saturated", help="the saturated points that `join` wrote, as one figure")
    bars.add_argument(
        "points", nargs="+", metavar="LABEL=JOINED_JSON", help="a trace's join (LABEL starts with its name)"
    )
    bars.add_argument("--out", type=Path, required=True, help="the figure (.png)")
    args = parser.parse_args(argv)
    args.command_line = " ".join(["python -m eval.serving", *(sys.argv[1:] if argv is None else argv)])
    commands = {
        "trace": make_trace, "calibrate": calibrate, "run": run_point, "probe-stock": probe_stock,
        "report": make_report, "compact": make_compact, "join": make_join, "plot-saturated": make_saturated_plot,
    }  # fmt: skip
    commands[args.command](args)


def named_paths(items: list[str], form: str) -> dict[str, Path]:
    """`NAME=PATH` arguments as {name: path}; SystemExit naming `form` for one without both parts."""
    named = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"each argument is {form}, got {item!r}")
        named[name] = Path(path)
    return named


def make_compact(args) -> None:
    result = write_compact(named_paths(args.runs, "NAME=RUN_JSON"), args.note, args.out)
    print(f"wrote {args.out}: {', '.join(result['runs'])}")


def make_join(args) -> None:
    result = join_saturated(args.stock, args.ours) | {"command": args.command_line}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.serving_block is not None:
        merge_saturated(args.serving_json, args.serving_block, result, args.out)
    print(json.dumps({k: result[k] for k in ("throughput_ratio", "mean_ttft_ratio")}))


def make_saturated_plot(args) -> None:
    plot_saturated(saturated_points(named_paths(args.points, "LABEL=JOINED_JSON")), args.out)
    print(f"wrote {args.out}")


def make_trace(args) -> None:
    ids, source = essay_token_ids()
    shape = trace_shape(args.preset, args.prompt_range, args.output_range)
    trace = build_trace(ids, num_requests=args.requests, seed=args.seed, source=source, name=args.preset or "", **shape)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    trace.save(args.out)
    print(json.dumps(trace.summary(), indent=2))


def trace_shape(preset: str | None, prompt_range: list[int] | None, output_range: list[int] | None) -> dict:
    """`build_trace`'s length arguments: a preset's, or the ranges given (a preset takes none)."""
    if preset is not None:
        if prompt_range is not None or output_range is not None:
            raise SystemExit(f"--preset {preset} sets the lengths itself: leave out --prompt-range / --output-range")
        return dict(PRESETS[preset])
    return {"prompt_range": tuple(prompt_range or (8192, 65536)), "output_range": tuple(output_range or (32, 128))}


def _loaded(args) -> Trace:
    trace = Trace.load(args.trace)
    end = None if args.requests is None else args.skip + args.requests
    return replace(trace, requests=trace.requests[args.skip : end])


def calibrate(args) -> None:
    trace, cap = _loaded(args), HbmCap.from_args(args)
    seconds = dense_iteration_s(args.shape, trace, cap)
    _write(args.out / "calibration.json", {"dense_iteration_s": seconds, **_record(args, trace, cap)})
    print(f"dense decode iteration: {seconds * 1e3:.2f} ms")


def probe_stock(args) -> None:
    trace, cap = _loaded(args), HbmCap.from_args(args)
    result = stock_step_probe(args.shape, trace, cap, args.rows, cache=args.cache)
    _write(args.out / f"probe_stock_{args.cache}_{args.rows}rows.json", result | _record(args, trace, cap))


def run_point(args) -> None:
    """One system, built and warmed up once, at each rate in turn; one JSON per rate."""
    trace, cap = _loaded(args), HbmCap.from_args(args)
    allocator = ALLOCATOR.get(args.system)
    if allocator is not None:  # read when CUDA starts, which `build` does
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", allocator)
    selections = RECORDED_TRACE if args.locality == "real" and args.system in LADDER else None
    overrides = config_overrides(args.overrides)
    dram_bytes = int(args.dram_gib * 2**30)
    saturated_only = all(math.isinf(rate) for rate in args.rate)
    start = time.perf_counter()
    runner = build(
        args.system, args.shape, trace, cap, args.max_batch, dram_bytes, selections, overrides, saturated_only,
        args.stop_queueing_s,
    )  # fmt: skip
    setup_s = time.perf_counter() - start  # the model built and warmed up: what a GPU call spends before a run
    print(f"{args.system}: built and warmed up in {setup_s:.1f} s", flush=True)
    for rate in args.rate:
        with KernelsFirstSeen() as kernels:
            run = runner(rate, deadline_s=args.deadline_s)
        summary = summarize(run.records)
        result = {"system": args.system, "rate": rate, "summary": summary, **_record(args, trace, cap),
                  "locality": "real" if selections is not None else "random", "requests_from": args.skip,
                  "deadline_s": args.deadline_s, "stop_queueing_s": args.stop_queueing_s, "setup_s": setup_s,
                  "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                  "overrides": overrides, "kernels_first_seen": kernels.events,
                  "engine": run.engine, "records": [r.as_dict() for r in run.records]}  # fmt: skip
        _write(args.out / run_file_name(args.system, rate, result["locality"], args.skip, overrides), result)
        print(json.dumps({"system": args.system, "rate": rate} | summary, indent=2))
        if "aborted" in run.engine:  # the engine broke (out of memory): no later rate would be meaningful
            break


def run_file_name(system: str, rate: float, locality: str, requests_from: int, overrides: dict | None = None) -> str:
    """run_SYSTEM[_set-FIELD-VALUE...]_RATE[_random][_fromN].json: one file per point, variant, locality and part."""
    variant = "".join(f"_set-{field}-{value}" for field, value in sorted((overrides or {}).items()))
    stem = f"run_{system}{variant}_{rate:g}" + ("_random" if locality == "random" and system in LADDER else "")
    return stem + (f"_from{requests_from}" if requests_from else "") + ".json"


def make_report(args) -> None:
    report_mod.write_report(args.runs, args.out, args.command_line, name=args.name)


def _record(args, trace: Trace, cap: HbmCap) -> dict:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "command": args.command_line, "shape": args.shape, "git_commit": current_commit(),
            "hbm_cap": cap.as_dict(), "trace": trace.summary(), "torch": torch.__version__}  # fmt: skip


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
