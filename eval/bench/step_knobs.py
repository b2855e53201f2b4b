"""The captured decode step's time per layer under kernel launch knobs, one process per setting.

    python -m eval.bench.step_knobs --out knobs.jsonl                         # the defaults
    python -m eval.bench.step_knobs --knob triton_decode.PROGRAMS_PER_SM=2 --out knobs.jsonl
    python -m eval.bench.step_knobs --knob triton_resolve.MAX_WARPS=8 --set fused_activation=False
    python -m eval.bench.step_knobs --dry-run                                 # tiny shapes on CPU

The decode_step benchmark's setup (Llama-3-8B shape, random bf16 weights, B=16 x 32K, the default
config with an HBM cache of 25% of the dense KV, loads following the recorded selection trace) cut
to a few layers (8 by default: the LM head's read then weighs 1/8 of a layer), timed as
`graph.StaticDecoder` replays after a warm-up long enough for the HBM cache's hit rate to
settle. A knob is a module constant of `sparseserve_hf.ops` (`MODULE.NAME=VALUE`, the value a
Python literal) set before any kernel runs, so its launches use it; run each setting in its own
process (the constants are read at launch, but a Triton kernel compiles once per process). Each
run appends one JSON line: the knobs, the config overrides, ms per step of three timed windows,
us per layer of the fastest, the hit rate and the run record.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eval.bench.common import (
    add_config_overrides,
    add_knob_option,
    apply_knobs,
    bench_setup,
    config_overrides,
    run_record,
    sync,
)
from eval.bench.decode_step_setup import build_model, replayed_cut
from eval.bench.selection_trace import RECORDED_TRACE
from sparseserve_hf.graph import StaticDecoder


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=32576)
    parser.add_argument("--warmup", type=int, default=40, help="steps before timing (the hit rate settles)")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed window (three windows)")
    add_knob_option(parser, "triton_decode.PROGRAMS_PER_SM=2")
    add_config_overrides(parser, "fused_activation=False")
    parser.add_argument("--trace", default=str(RECORDED_TRACE))
    parser.add_argument("--out", default=None, help="JSON lines file to append to")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (tests the script)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, shape, dtype = bench_setup(args.dry_run)  # prepares Triton before the knobs import a kernel module
    knobs = apply_knobs(args.knob)
    if args.dry_run:
        args.layers, args.batch, args.context, args.warmup, args.steps = 2, 2, 200, 2, 2
    model = build_model(shape, "sparseserve", device, dtype, args.context + 1024, num_layers=args.layers)
    overrides = config_overrides(args.overrides)
    cache = replayed_cut(model, args.batch, args.context, args.trace, args.dry_run, **overrides)
    text = model.config
    tokens = torch.randint(1, text.vocab_size, (args.batch, 1), device=device)
    decoder = StaticDecoder(model, cache, capture=device.type == "cuda")
    windows = []
    with torch.no_grad():
        decoder.start(tokens)
        for _ in range(args.warmup):
            decoder.step()
        sync(device)
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(args.steps):
                decoder.step()
            sync(device)
            windows.append((time.perf_counter() - start) / args.steps * 1e3)
    result = {
        **run_record(device),
        "knobs": knobs,
        "overrides": args.overrides,
        "layers": args.layers,
        "batch": args.batch,
        "context": args.context,
        "ms_per_step": windows,
        "us_per_layer": min(windows) * 1e3 / args.layers,
        "hit_rate": cache.stats()["hit_rate"],
        "config": asdict(cache.config),
    }
    print(json.dumps({k: result[k] for k in ("knobs", "overrides", "us_per_layer", "hit_rate")}))
    if args.out:
        with Path(args.out).open("a") as out:
            out.write(json.dumps(result, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
