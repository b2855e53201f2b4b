"""The sparse decode attention kernel alone, at one decode step's shape, under its launch knobs.

    python -m eval.bench.attention_knobs --out attention_knobs.json     # on a GPU (~3 min)
    python -m eval.bench.attention_knobs --dry-run                      # tiny shapes, Triton's interpreter

One layer of the Llama-3-8B shape at B=16 x 32K as the captured step runs it: 8 KV heads of 4 query
heads, head_dim 128, 32-token blocks in a 512 MiB HBM pool, a 256-entry slot table per (row, KV
head) (G x 64, the group union's width) whose first `used` entries hold distinct random slots
(`used` uniform in mean +- 25%, the recorded trace's load is ~85 blocks), a full tail block, no head
mask (the group union attends the whole union). Timed as CUDA-graph replays (the GPU's time alone):
`begin_decode` over the entries resident before the lookup (all but `--late-fraction`) followed by
`finish_decode` over the rest, the form the step uses. Each setting (TILE_TOKENS, SPLIT_WARPS,
SPLIT_STAGES, PROGRAMS_PER_SM_BESIDE_LOOKUP) is compared with the bytes the kernel must read (the
attended K/V) over a device-to-device copy's bandwidth measured in the same process. A first sweep
covers tile x warps x stages at the default programs per SM; a second sweeps programs per SM for the
two fastest. `best` names the fastest setting as `--knob` arguments.
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import Any

import torch

TILES, WARPS, STAGES = (32, 64, 128), (2, 4, 8), (1, 3, 4)
PER_SM = (1, 2, 3, 4, 6, 8)


def attention_inputs(
    batch: int, kv_heads: int, group: int, dim: int, size: int, width: int, mean_blocks: int, pool_slots: int,
    late_fraction: float, device: torch.device, dtype: torch.dtype,
) -> dict[str, Any]:  # fmt: skip
    """Random inputs of `begin_decode` / `finish_decode`: slots (B, Hkv, width) with each row's used
    entries first (also their DRAM ids, through an identity block -> slot table), the resident
    subset, query, pool and tails; and the K/V bytes attended."""
    generator = torch.Generator().manual_seed(0)
    low, high = max(1, mean_blocks * 3 // 4), max(2, mean_blocks * 5 // 4)
    used = torch.randint(low, high + 1, (batch, kv_heads), generator=generator).clamp(max=width)
    slots = torch.full((batch, kv_heads, width), -1, dtype=torch.int64)
    for row, head in itertools.product(range(batch), range(kv_heads)):
        count = int(used[row, head])
        slots[row, head, :count] = torch.randperm(pool_slots, generator=generator)[:count]
    late = (torch.rand(slots.shape, generator=generator) < late_fraction) & (slots >= 0)
    resident = slots.masked_fill(late, -1)
    tail = torch.randn(batch, kv_heads, 2, size, dim, generator=generator).to(dtype)
    block_bytes = 2 * size * dim * torch.tensor([], dtype=dtype).element_size()
    return {
        "query": torch.randn(batch, kv_heads * group, dim, generator=generator).to(device, dtype),
        "pool": torch.randn(pool_slots, 2, size, dim, generator=generator).to(device, dtype),
        "slots": slots.to(device),
        "resident": resident.to(device),
        "block_slot": torch.arange(pool_slots, device=device),  # the entries' ids are their slots
        "tail_keys": tail.to(device)[:, :, 0],
        "tail_values": tail.to(device)[:, :, 1],
        "tail_len": torch.full((batch,), size, dtype=torch.int64, device=device),
        "kv_bytes": int(used.sum() + batch * kv_heads) * block_bytes,
        "mean_used": float(used.float().mean()),
    }


def split_decode(triton_decode, inputs: dict[str, Any], scaling: float) -> torch.Tensor:
    """The step's form: attend the resident entries and tails, then the late ones, then merge."""
    pending = triton_decode.begin_decode(
        inputs["query"], inputs["pool"], inputs["resident"], None,
        inputs["tail_keys"], inputs["tail_values"], inputs["tail_len"], scaling,
    )  # fmt: skip
    return triton_decode.finish_decode(pending, inputs["slots"], inputs["block_slot"])


def copy_gb_per_s(device: torch.device, replay_ms) -> float | None:
    """Device-to-device copy bandwidth (read + write bytes per second) of a 1 GiB buffer;
    `replay_ms` is `eval.bench.common.graph_ms` (imported once the interpreter switch is set)."""
    source = torch.empty(1 << 29, dtype=torch.int16, device=device)
    target = torch.empty_like(source)
    ms = replay_ms(lambda: target.copy_(source), device)
    return None if ms is None else 2 * source.numel() * 2 / ms / 1e6


def timed(triton_decode, inputs, scaling, device, setting: dict[str, int], replay_ms) -> float | None:
    """Graph-replay milliseconds of `split_decode` with the module's knobs set to `setting` (on CPU
    one eager launch and None)."""
    for name, value in setting.items():
        setattr(triton_decode, name, value)
    if device.type != "cuda":
        split_decode(triton_decode, inputs, scaling)
        return None
    return replay_ms(lambda: split_decode(triton_decode, inputs, scaling), device)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mean-blocks", type=int, default=85, help="used blocks per (row, KV head), on average")
    parser.add_argument("--late-fraction", type=float, default=0.01, help="entries loaded after the first launch")
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes under Triton's CPU interpreter")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    from eval.bench.common import graph_ms, print_table, run_record, write_json  # after the interpreter switch
    from sparseserve_hf.ops import reference, triton_decode

    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    shape = (2, 2, 4, 16, 32, 16, 3, 64) if args.dry_run else (16, 8, 4, 128, 32, 256, args.mean_blocks, 32768)
    dim = shape[3]
    inputs = attention_inputs(*shape, args.late_fraction, device, dtype)
    scaling = dim**-0.5
    expected = reference.sparse_decode(
        inputs["query"], inputs["pool"], inputs["slots"], None,
        inputs["tail_keys"], inputs["tail_values"], inputs["tail_len"], scaling,
    )  # fmt: skip
    got = split_decode(triton_decode, inputs, scaling)
    max_abs_diff = float((got.float() - expected.float()).abs().max())
    defaults = {
        name: getattr(triton_decode, name)
        for name in ("TILE_TOKENS", "SPLIT_WARPS", "SPLIT_STAGES", "PROGRAMS_PER_SM_BESIDE_LOOKUP")
    }
    tiles, warps, stages = ((64,), (4,), (1, 3)) if args.dry_run else (TILES, WARPS, STAGES)
    first = [
        {**defaults, "TILE_TOKENS": tile, "SPLIT_WARPS": warp, "SPLIT_STAGES": stage}
        for tile, warp, stage in itertools.product(tiles, warps, stages)
    ]
    rows = [{**setting, "ms": timed(triton_decode, inputs, scaling, device, setting, graph_ms)} for setting in first]
    fastest = sorted(rows, key=lambda row: row["ms"] or 0.0)[:2]
    per_sm = (1, 2) if args.dry_run else PER_SM
    candidates = [
        {**{name: row[name] for name in defaults}, "PROGRAMS_PER_SM_BESIDE_LOOKUP": count}
        for row in [defaults, *fastest]
        for count in per_sm
    ]
    second = [setting for index, setting in enumerate(candidates) if setting not in first + candidates[:index]]
    rows += [{**setting, "ms": timed(triton_decode, inputs, scaling, device, setting, graph_ms)} for setting in second]
    copy = copy_gb_per_s(device, graph_ms)
    for row in rows:
        row["gb_per_s"] = None if row["ms"] is None else inputs["kv_bytes"] / row["ms"] / 1e6
        row["floor_ratio"] = None if row["gb_per_s"] is None or copy is None else copy / row["gb_per_s"]
    print_table(rows, [*defaults, "ms", "gb_per_s", "floor_ratio"])
    default_ms = next(row["ms"] for row in rows if all(row[name] == value for name, value in defaults.items()))
    timed_rows = [row for row in rows if row["ms"] is not None]
    best = min(timed_rows, key=lambda row: row["ms"]) if timed_rows else {**defaults, "ms": None}
    result = {
        **run_record(device),
        "shape": dict(
            zip(["batch", "kv_heads", "group", "dim", "block_size", "width", "mean_blocks", "pool_slots"], shape)
        ),
        "mean_used_blocks": inputs["mean_used"],
        "kv_bytes": inputs["kv_bytes"],
        "late_fraction": args.late_fraction,
        "max_abs_diff_vs_reference": max_abs_diff,
        "copy_gb_per_s": copy,
        "default": defaults,
        "default_ms": default_ms,
        "best_ms": best["ms"],
        "best": [f"triton_decode.{name}={best[name]}" for name in defaults if best[name] != defaults[name]],
        "rows": rows,
    }
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
