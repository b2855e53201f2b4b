"""What the HTTP layer costs: one synthetic trace through the server and through its engine in-process.

    python -m eval.serving.http_overhead build FOLDER --shape llama3-8b --device cuda --dtype bfloat16
    python -m eval.serving.http_overhead serve-flags FOLDER --dtype bfloat16      # ours' engine options
    python -m sparseserve_hf.serve FOLDER SERVE_OPTIONS &                          # then http_load against it
    python -m eval.serving.http_overhead in-process FOLDER SERVE_OPTIONS --synthetic 32 --rate 0.5 --out J
    python -m eval.serving.http_overhead compare HTTP.json IN_PROCESS.json --out DIR

`build` saves a random-weight model of one of `eval.bench.decode_step_setup.SHAPES` with a word
tokenizer that decodes every id of its vocabulary, so `serve` loads it offline. `serve-flags`
prints the serve command-line options that make the engine `eval.serving`'s "ours" system under
its HBM cap (the same `ours_config`). `in-process` takes the serve command's own options, loads the
model and the `Generator` as `serve` does and runs the same trace, warm-up and rate as
`http_load` through `eval.serving.ours.run_generator`; its JSON has http_load's layout. `compare`
writes http_overhead.json and http_overhead.md: each summary metric of both runs, and HTTP minus
in-process.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from eval.results_io import read_json
from eval.serving.http_load import add_trace_arguments, load_trace, warmup_trace
from eval.serving.metrics import summarize
from sparseserve_hf import SparseServeConfig
from sparseserve_hf.serve import cli

GIB = 1 << 30
# (summary key, label, scale to the shown unit; None: a count): what `compare` puts side by side.
COMPARED = (
    ("p50_ttft_s", "TTFT p50 (ms)", 1e3),
    ("p99_ttft_s", "TTFT p99 (ms)", 1e3),
    ("mean_ttft_s", "TTFT mean (ms)", 1e3),
    ("p50_tbt_s", "TBT p50 (ms)", 1e3),
    ("p99_tbt_s", "TBT p99 (ms)", 1e3),
    ("mean_tbt_s", "TBT mean (ms)", 1e3),
    ("throughput_tokens_per_s", "throughput (tokens/s)", 1.0),
    ("span_s", "span (s)", 1.0),
    ("completed", "completed", None),
    ("failed", "failed (errors)", None),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m eval.serving.http_overhead", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="save a random-weight model and its word tokenizer")
    build.add_argument("folder", type=Path)
    build.add_argument("--shape", default="llama3-8b", help="a shape of eval.bench.decode_step_setup.SHAPES")
    build.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    build.add_argument("--dtype", default="bfloat16")
    build.add_argument("--max-positions", type=int, default=40960, help="the model's max_position_embeddings")
    flags = sub.add_parser("serve-flags", help="print the engine options of eval.serving's 'ours' system")
    flags.add_argument("folder", type=Path)
    flags.add_argument("--dtype", default="bfloat16", help="the dtype the server loads the weights in")
    flags.add_argument("--hbm-cap-gib", type=float, default=40.0, help="weights + KV + work (as eval.serving)")
    flags.add_argument("--headroom-gib", type=float, default=8.0, help="of the cap, kept for activations")
    flags.add_argument("--dram-gib", type=float, default=48.0, help="the pinned host pool")
    flags.add_argument("--max-batch", type=int, default=16)
    inproc = sub.add_parser("in-process", help="the trace through the serve command's engine, without HTTP")
    cli.add_serve_arguments(inproc)
    add_trace_arguments(inproc)
    inproc.add_argument("--out", type=Path, required=True, help="JSON in http_load's layout")
    compare = sub.add_parser("compare", help="HTTP minus in-process, per summary metric")
    compare.add_argument("http", type=Path, help="http_load's JSON")
    compare.add_argument("in_process", type=Path, help="in-process's JSON")
    compare.add_argument("--out", type=Path, required=True, help="folder for http_overhead.json and .md")
    return parser.parse_args(argv)


def build_folder(folder: Path, shape: str, device: str, dtype: torch.dtype, max_positions: int) -> Path:
    """Save the seeded random `shape` model (built on `device`) and a word tokenizer of its vocabulary.

    The tokenizer is written last: a folder holding tokenizer.json is complete.
    """
    from eval.bench.decode_step_setup import build_model
    from eval.toy_tokenizer import word_tokenizer

    model = build_model(shape, "sdpa", torch.device(device), dtype, max_positions)
    model.save_pretrained(folder)
    word_tokenizer(vocab_size=model.config.vocab_size).save_pretrained(folder)
    return folder


def ours_engine_config(
    folder: Path, dtype: torch.dtype, cap_bytes: int, headroom_bytes: int, dram_bytes: int, max_batch: int
) -> SparseServeConfig:
    """`eval.serving.setup.ours_config("ours", ...)` for the folder's model in `dtype` under the cap.

    The weights' bytes come from a model on the meta device: nothing is loaded.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from eval.serving.common import Budget
    from eval.serving.setup import HbmCap, kv_bytes_per_token, ours_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    budget = Budget(HbmCap(cap_bytes, headroom_bytes).kv_bytes(model), kv_bytes_per_token(model), max_batch)
    return ours_config("ours", model, budget, dram_bytes)


def serve_flags(config: SparseServeConfig) -> list[str]:
    """The serve options whose `cli.engine_config` is `config` (each field off its default, sizes in GiB).

    Raises ValueError when a field differs from its default and the serve command has no option for it.
    """
    default, flags = SparseServeConfig(), []
    for flag, name, _ in cli.CONFIG_FLAGS:
        if getattr(config, name) != getattr(default, name):
            flags += [flag, str(getattr(config, name))]
    for flag, name in (("--hbm-cache-gib", "hbm_cache_bytes"), ("--dram-gib", "dram_bytes")):
        if getattr(config, name) is not None:  # bytes / 2**30 is exact, and so is the CLI's product back
            flags += [flag, repr(getattr(config, name) / GIB)]
    flags += ["--cuda-graphs"] if config.cuda_graphs else []
    flags += [] if config.admission else ["--no-admission"]
    flags += [] if config.reserve_decode else ["--no-reserve-decode"]
    parsed = cli.engine_config(cli.parse_args(["serve", *flags]))
    if parsed != config:
        differ = [name for name, value in config.to_dict().items() if parsed.to_dict()[name] != value]
        raise ValueError(f"the serve command has no option for {', '.join(differ)}")
    return flags


def run_in_process(args: argparse.Namespace) -> dict[str, Any]:
    """The trace (after its warm-up) through a `Generator` loaded as `serve` loads it; http_load's layout."""
    from eval.bench.common import run_record
    from eval.serving.ours import run_generator
    from sparseserve_hf import Generator

    trace, config = load_trace(args), cli.engine_config(args)
    model, tokenizer, _ = cli.load(args)
    gen = Generator(model, tokenizer, config)
    warmup = summarize(run_generator(gen, warmup_trace(trace, args.warmup), 1.0).records) if args.warmup > 0 else None
    run = run_generator(gen, trace, args.rate)
    summary = summarize(run.records)
    result = {"model": str(args.model), "run": run_record(model.device), "rate": args.rate,
              "trace": trace.summary(), "summary": summary, "warmup": warmup, "engine": run.engine,
              "records": [r.as_dict() for r in run.records]}  # fmt: skip
    print(json.dumps(summary, indent=2))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def compare(http: dict[str, Any], in_process: dict[str, Any]) -> dict[str, Any]:
    """Each compared metric of both runs' summaries and HTTP minus in-process (None where either is)."""
    rows = {}
    for key, _, _ in COMPARED:
        a, b = http["summary"].get(key), in_process["summary"].get(key)
        rows[key] = {"http": a, "in_process": b, "http_minus_in_process": None if a is None or b is None else a - b}
    return {"rate": http["rate"], "trace": http["trace"], "run": in_process["run"], "metrics": rows}


def markdown(comparison: dict[str, Any]) -> str:
    """The comparison as a table, HTTP minus in-process in the last column."""
    trace, run = comparison["trace"], comparison["run"]
    lines = [
        "# HTTP overhead: the server (http_load) against the same engine in-process",
        "",
        (
            f"{trace['requests']} requests x {trace['prompt_tokens']['mean']:g} prompt tokens x "
            f"{trace['output_tokens']['mean']:g} output tokens at {comparison['rate']:g} requests/s "
            f"({trace['source']}); {run['device']}, commit {run['git_commit'] or '?'}."
        ),
        "",
        "| metric | HTTP | in-process | HTTP - in-process |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, label, scale in COMPARED:
        row = comparison["metrics"][key]
        cells = [_cell(row[name], scale) for name in ("http", "in_process", "http_minus_in_process")]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None, scale: float | None) -> str:
    if value is None:
        return "-"
    return str(value) if scale is None else f"{value * scale:.2f}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "build":
        build_folder(args.folder, args.shape, args.device, getattr(torch, args.dtype), args.max_positions)
        print(f"saved {args.shape} to {args.folder}")
    elif args.command == "serve-flags":
        config = ours_engine_config(
            args.folder, getattr(torch, args.dtype), int(args.hbm_cap_gib * GIB), int(args.headroom_gib * GIB),
            int(args.dram_gib * GIB), args.max_batch,
        )  # fmt: skip
        print(" ".join(serve_flags(config)))
    elif args.command == "in-process":
        run_in_process(args)
    else:
        comparison = compare(read_json(args.http), read_json(args.in_process))  # either may be stored as .gz
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "http_overhead.json").write_text(json.dumps(comparison, indent=2) + "\n")
        (args.out / "http_overhead.md").write_text(markdown(comparison))
        sys.stdout.write(markdown(comparison))


if __name__ == "__main__":
    main()
