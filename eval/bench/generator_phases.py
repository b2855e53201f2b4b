"""Where a `Generator` decode iteration's wall time goes, phase by phase, with every request decoding.

    python -m eval.bench.generator_phases --out eval/results/generator_phases.json    # GPU, ~3 min
    python -m eval.bench.generator_phases --set load_budget=4096 --out ...            # a config variant
    python -m eval.bench.generator_phases --dry-run                                   # tiny shapes on CPU

The closed loop's workload (`generator_vs_generate`: 16 requests x 16K tokens, the Llama-3-8B shape
with random bf16 weights, an HBM cache of 25% of the dense KV, real locality). Once every request
has its first token, `--steps` iterations are timed twice:
- plain: wall milliseconds per `Generator.step()`, as a user's loop runs it;
- instrumented: the device is synchronized before and after each phase, so a phase's time is its
  host work plus the device work it queued, and `replay_gpu_ms` is the CUDA-event time of the
  decode step itself (from its launch to its end, inside `step`). Phases: `candidates` and
  `schedule` (admission), `arrange` (the batch's slots), `step` (`Generator._decoder_step`: the
  decoder's host work and the CUDA-graph replay), `working_sets` (`WorkingSetTracker.observe`),
  `sample` (`sample_next`), `readback` (the rest of `_launch_decode` and the read-back: the one
  host sync and the host lists), `emit` (tokens into requests and events), `hbm_peak` and `other` (the rest).
The syncs serialize what would overlap, so the phases add up to more than a plain iteration;
`plain_ms_per_step` minus `replay_gpu_ms` is what the host adds to each step.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

import sparseserve_hf.generation.generator as generator_module
from eval.bench.common import (
    add_config_overrides,
    bench_setup,
    config_overrides,
    profiled_region,
    run_record,
    sync,
    write_json,
    write_profile,
)
from eval.bench.decode_step_setup import build_model
from eval.bench.generator_vs_generate import POINTS, ours_config, random_prompts
from eval.bench.selection_trace import RECORDED_TRACE, SelectionTrace, TraceReplay
from sparseserve_hf import Generator, SamplingParams
from sparseserve_hf.generation.in_flight import InFlightStep

DRY_SIZES = (3, 160)
MODULE_FUNCTIONS = {"schedule": "schedule", "sample": "sample_next"}  # phase -> function of generator_module
METHODS = {
    "candidates": "_candidates",
    "arrange": "_arrange_batch",
    "launch": "_launch_decode",
    "step": "_decoder_step",
    "emit": "_emit_tokens",
    "hbm_peak": "_track_hbm_peak",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="iterations timed in each pass")
    parser.add_argument("--hbm-cache-fraction", type=float, default=0.25, help="HBM cache / the requests' dense KV")
    parser.add_argument("--trace", default=str(RECORDED_TRACE), help="selection trace (real locality); '' = random KV")
    add_config_overrides(parser, "load_budget=4096")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument(
        "--profile", default=None, help="markdown path: a torch profile of 5 more plain iterations (host and device)"
    )
    parser.add_argument("--chrome-trace", default=None, help="with --profile: that profile's Chrome trace (JSON)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (tests the script)")
    return parser.parse_args(argv)


class PhaseTimer:
    """Milliseconds per phase, each call fenced by device syncs (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ms: dict[str, list[float]] = defaultdict(list)

    def wrap(self, name: str, fn: Callable[..., Any], gpu_events: bool = False) -> Callable[..., Any]:
        def timed(*args, **kwargs):
            sync(self.device)
            start = time.perf_counter()
            events = _events(self.device) if gpu_events else None
            if events is not None:
                events[0].record()
            out = fn(*args, **kwargs)
            if events is not None:
                events[1].record()
            sync(self.device)
            self.ms[name].append((time.perf_counter() - start) * 1e3)
            if events is not None:
                self.ms["replay_gpu"].append(events[0].elapsed_time(events[1]))
            return out

        return timed

    def means(self) -> dict[str, float]:
        return {name: sum(values) / len(values) for name, values in self.ms.items() if values}


def _events(device: torch.device) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
    if device.type != "cuda":
        return None
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def instrument(gen: Generator, timer: PhaseTimer) -> Callable[[], None]:
    """Wrap the Generator's phases in `timer` (instance attributes and module functions); returns the undo."""
    for phase, method in METHODS.items():
        setattr(gen, method, timer.wrap(phase, getattr(gen, method), gpu_events=phase == "step"))
    observe = gen.tracker.observe
    gen.tracker.observe = timer.wrap("working_sets", observe)
    saved = {name: getattr(generator_module, name) for name in MODULE_FUNCTIONS.values()}
    for phase, name in MODULE_FUNCTIONS.items():
        setattr(generator_module, name, timer.wrap(phase, saved[name]))
    read = InFlightStep.read
    InFlightStep.read = timer.wrap("read", read)

    def undo() -> None:
        for method in METHODS.values():
            delattr(gen, method)  # the class's method again
        gen.tracker.observe = observe
        for name, fn in saved.items():
            setattr(generator_module, name, fn)
        InFlightStep.read = read

    return undo


def timed_steps(gen: Generator, steps: int, device: torch.device) -> float:
    """Wall milliseconds per `step()` over `steps` iterations (every request still decoding)."""
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        gen.step()
    sync(device)
    return (time.perf_counter() - start) * 1e3 / steps


def phase_table(means: dict[str, float], iteration_ms: float) -> dict[str, float]:
    """The phases as the module docstring names them, `readback` and `other` as what is left (the
    HBM peak is tracked inside the launch: counted once, as `hbm_peak`)."""
    inside = sum(means.get(name, 0.0) for name in ("step", "working_sets", "sample", "hbm_peak"))
    phases = {name: means.get(name, 0.0) for name in ("candidates", "schedule", "arrange", "step")}
    phases |= {"working_sets": means.get("working_sets", 0.0), "sample": means.get("sample", 0.0)}
    phases["readback"] = means.get("launch", 0.0) - inside + means.get("read", 0.0)
    phases |= {"emit": means.get("emit", 0.0), "hbm_peak": means.get("hbm_peak", 0.0)}
    phases["other"] = iteration_ms - sum(phases.values())  # the rest of step()
    return phases


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, shape, dtype = bench_setup(args.dry_run)
    requests, context = DRY_SIZES if args.dry_run else POINTS["closed_loop"][:2]
    model = build_model(shape, "sparseserve", device, dtype, context + 4 * args.steps + 2048)
    text = model.config
    config = dataclasses.replace(ours_config(model, requests, context, args), **config_overrides(args.overrides))
    gen = Generator(model, None, config)
    if args.trace:
        replay = TraceReplay(SelectionTrace.load(args.trace), text.num_hidden_layers, text.num_key_value_heads, device)
        gen.store.selection_override = replay
    params = SamplingParams(max_new_tokens=4 * args.steps + 16, ignore_eos=True)
    ids = [gen.submit(row, params) for row in random_prompts(shape, requests, context, device).tolist()]
    while any(gen.request_times(rid)["first_token_s"] is None for rid in ids):
        gen.step()  # prefill (and the first decodes) until every request has its first token
    timed_steps(gen, 3, device)  # graphs of this batch captured, kernels warm
    plain_ms = timed_steps(gen, args.steps, device)
    totals_before = gen.metrics()["totals"]
    timer = PhaseTimer(device)
    undo = instrument(gen, timer)
    iteration = timer.wrap("iteration", gen.step)
    for _ in range(args.steps):
        iteration()
    undo()
    if args.profile:
        with profiled_region(True) as profiler:
            for _ in range(5):
                with torch.profiler.record_function("generator_iteration"):
                    gen.step()
            sync(device)
        write_profile(profiler, args.profile, f"5 plain Generator iterations, {requests} requests decoding")
        if args.chrome_trace:
            profiler.export_chrome_trace(args.chrome_trace)
    means = timer.means()
    totals = gen.metrics()["totals"]
    result = {
        **run_record(device),
        "shape": shape,
        "workload": {"requests": requests, "prompt_tokens": context},
        "config": dataclasses.asdict(config),
        "steps": args.steps,
        "plain_ms_per_step": plain_ms,
        "instrumented_ms_per_step": means["iteration"],
        "replay_gpu_ms": means.get("replay_gpu"),
        "phases_ms": phase_table(means, means["iteration"]),
        "decode_rows_per_step": (totals["decode_rows"] - totals_before["decode_rows"])
        / max(totals["iterations"] - totals_before["iterations"], 1),  # the instrumented pass
        "hit_rate": totals["hit_rate"],
    }
    if result["replay_gpu_ms"] is not None:
        result["host_ms_per_step"] = plain_ms - result["replay_gpu_ms"]
    print(
        f"plain {plain_ms:.2f} ms/step; replay {result['replay_gpu_ms']} ms; rows {result['decode_rows_per_step']:.1f}"
    )
    for name, ms in result["phases_ms"].items():
        print(f"  {name:>12}: {ms:8.3f} ms")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
