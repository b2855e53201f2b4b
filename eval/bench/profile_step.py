"""Where one sparse decode step's GPU time goes, kernel by kernel (torch.profiler over decode steps).

    python -m eval.bench.profile_step --out eval/results/profile_step.md     # H200: ~2 min
    python -m eval.bench.profile_step --graph [--no-fused-norms] --out profile_graph.md  # H200: ~20 s
    python -m eval.bench.profile_step --graph --set kv_dtype=float8_e4m3fn   # any SparseServeConfig field
    python -m eval.bench.profile_step --dry-run                             # tiny shapes on CPU

`--graph` profiles the step users run fastest: `graph.StaticDecoder`'s CUDA-graph replays (on
CPU its static step, eagerly), fused ops included; without it, eager steps of `model(...)`.

The decode_step benchmark's setup (Llama-3-8B shape, random bf16 weights, B=16 x 32K, the
default config with an HBM cache of 25% of the dense KV), cut to a few layers: every layer runs
the same kernels, so per-layer times need no 32-layer fill. Loads follow the recorded selection
trace (real locality). The first table lists each kernel's device time per layer and its calls per
layer, largest first. Where streams overlap, those times add up to more than the step takes: on
CUDA a second table (`eval.bench.exposure`) gives each kernel's exposed time (it ran alone, so the
step waits for it) and its share of overlaps, with the GPU's idle time, and a third shows one layer
in time order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.autograd.profiler_util import FunctionEvent

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
from eval.bench.exposure import exposure_table
from eval.bench.selection_trace import RECORDED_TRACE
from sparseserve_hf.compat import cache_kwarg
from sparseserve_hf.graph import StaticDecoder


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=32576)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--trace", default=str(RECORDED_TRACE))
    parser.add_argument("--out", default=None)
    parser.add_argument("--graph", action="store_true", help="profile StaticDecoder replays")
    parser.add_argument(
        "--no-fused-norms", dest="fused_norms", action="store_false", help="SparseServeConfig(fused_norms=False)"
    )
    add_config_overrides(parser, "kv_dtype=float8_e4m3fn")
    add_knob_option(parser, "triton_channels.MMA=True")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    fields = {"fused_norms": args.fused_norms} | config_overrides(args.overrides)
    device, shape, dtype = bench_setup(args.dry_run)
    knobs = apply_knobs(args.knob)  # after bench_setup: the interpreter switch comes before the kernel modules
    if args.dry_run:
        args.batch, args.context, args.steps = 2, 200, 2
    model = build_model(shape, "sparseserve", device, dtype, args.context + 1024, num_layers=args.layers)
    text = model.config
    cache = replayed_cut(model, args.batch, args.context, args.trace, args.dry_run, **fields)
    tokens = torch.randint(1, text.vocab_size, (args.batch, 1), device=device)
    kwargs = {cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}

    decoder = StaticDecoder(model, cache, capture=device.type == "cuda") if args.graph else None
    if decoder is not None:
        decoder.start(tokens)

    def step(tokens):  # a decoder feeds its own greedy picks back
        if decoder is not None:
            return decoder.step()
        return model(input_ids=tokens, **kwargs).logits[:, -1:].argmax(-1)

    with torch.no_grad():
        for _ in range(12):  # warm the LRU and the kernels
            tokens = step(tokens)
        sync(device)
        cache.store.reset_stats()  # count the profiled steps only
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                tokens = step(tokens)
            sync(device)
    report = kernel_table(prof, args.steps * args.layers, device)
    header = f"# One sparse decode layer, kernel by kernel\n\n{run_record(device)}\n\n"
    mode = "CUDA-graph replays" if args.graph else "eager steps"
    text_out = header + f"B={args.batch}, context {args.context}, {args.layers} layers, {args.steps} {mode}"
    text_out += ", " + ", ".join(f"{name}={value}" for name, value in (fields | knobs).items()) + "\n\n"
    text_out += miss_line(cache.store.read_stats(), args.steps * args.layers) + report
    if device.type == "cuda":
        events = device_events(prof)
        text_out += "\n" + exposure_table(kernel_intervals(events), args.steps * args.layers)
        text_out += "\n" + layer_timeline(events)
    print(text_out)
    if args.out:
        Path(args.out).write_text(text_out)
    return text_out


def miss_line(stats, per: int) -> str:
    """The profiled steps' HBM block-cache misses per layer: what the miss copy kernel moved."""
    looked_up = stats.hits + stats.misses
    hit_rate = stats.hits / looked_up if looked_up else 0.0
    return f"misses per layer: {stats.h2d_bytes / per / 2**20:.2f} MiB (hit rate {hit_rate:.4f})\n\n"


def kernel_table(prof, per: int, device: torch.device, top: int = 30) -> str:
    """Markdown: device us per layer and calls per layer of the top kernels."""
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device.type != "cuda":
            device_us = event.self_cpu_time_total
        if device_us <= 0 or (device.type == "cuda" and event.device_type != torch.autograd.DeviceType.CUDA):
            continue
        rows.append((device_us / per, event.count / per, event.key[:90]))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines = [
        f"device time per layer (all kernels): {total:.1f} us\n",
        "| us/layer | calls/layer | kernel |",
        "|---|---|---|",
    ]
    lines += [f"| {us:.1f} | {calls:.1f} | `{name}` |" for us, calls, name in rows[:top]]
    return "\n".join(lines) + "\n"


def device_events(prof) -> list[FunctionEvent]:
    """The profile's device (CUDA) events in start order."""
    events = (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sorted(events, key=lambda e: e.time_range.start)


def kernel_intervals(events: list[FunctionEvent]) -> list[tuple[float, float, str]]:
    """Device events as (start us, end us, name)."""
    return [(e.time_range.start, e.time_range.end, e.name[:90]) for e in events]


LAYER_MARKERS = ("_rope_kernel", "_block_lse", "_score_kernel")  # kernels each sparse layer launches once


def layer_timeline(kernels: list[FunctionEvent]) -> str:
    """Markdown: one layer of the last profiled step in time order (from one layer's marker kernel,
    the first of `LAYER_MARKERS` the profile has, to the next: the layer's wall time, overlap
    included), each kernel's start, length and stream, so that what runs beside what, and what
    waits, can be read off. `kernels`: device events in start order (`device_events`)."""
    marker = next((m for m in LAYER_MARKERS if any(m in e.name for e in kernels)), None)
    marks = [i for i, e in enumerate(kernels) if marker is not None and marker in e.name]
    if len(marks) < 3:
        return ""
    first, last = marks[-3], marks[-2]  # a layer inside the last step, not its first
    origin = kernels[first].time_range.start
    wall = kernels[last].time_range.start - origin
    lines = [
        f"one layer's timeline (from `{marker}` to the next): {wall:.1f} us of wall time\n",
        "| start us | us | stream | kernel |",
        "|---|---|---|---|",
    ]
    for event in kernels[first:last]:
        start, length = event.time_range.start - origin, event.time_range.elapsed_us()
        lines.append(f"| {start:.1f} | {length:.1f} | {event.device_resource_id} | `{event.name[:70]}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
