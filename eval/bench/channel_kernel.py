"""The channel-score kernel alone, at one decode step's shape, under its launch knobs.

    python -m eval.bench.channel_kernel --out channel_kernel.json     # on a GPU
    python -m eval.bench.channel_kernel --dry-run                     # tiny shapes, Triton's interpreter

One layer of the Llama-3-8B shape at B=16 x 32K (8 KV heads of 4 query heads, head_dim 128, 1,024
32-token blocks per row and head) with random channel metadata at `channel_share` 3/8: the time of
`triton_channels.block_logsumexp` (what a step launches per layer) and of the whole score
(`triton_channels.feedback_mass` over it, as the channel scorer composes them) for each setting of its
launch knobs, beside the time to copy the metadata's bytes once (the read's floor), measured in the same
process. Every time is a CUDA-graph replay's (the GPU's time alone, as a captured step pays it).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

SETTINGS = [  # the knobs of `triton_channels` each timed setting sets (the rest keep their defaults)
    {"BLOCK_N": n, "NUM_WARPS": w, "UNROLL": u, "WORDS": words, "PREFETCH": ahead, "HOIST_Q": hoist, "STAGES": stages,
     "Q_AHEAD": q_ahead, "MMA": False}
    for n, w, u, words, ahead, hoist, stages, q_ahead in [
        (16, 1, 1, True, True, True, 0, False), (8, 1, 1, True, False, False, 0, False), (8, 1, 2, True, False, False, 0, False),
        (4, 1, 1, True, False, False, 0, False), (16, 2, 1, True, False, False, 0, False), (32, 4, 1, True, False, False, 0, False),
        (8, 1, 1, False, False, False, 0, False), (16, 1, 1, True, False, False, 0, False), (8, 1, 1, True, True, False, 0, False),
        (16, 2, 1, True, True, False, 0, False), (16, 1, 1, True, False, False, 2, False), (8, 1, 1, True, False, False, 2, False),
        (8, 1, 1, True, False, False, 3, False), (16, 2, 1, True, False, False, 2, False), (16, 1, 1, True, True, False, 0, False),
        (8, 1, 1, True, True, True, 0, False), (16, 1, 1, True, False, True, 0, False), (16, 2, 1, True, True, True, 0, False),
        (16, 1, 1, True, True, True, 0, True), (8, 1, 1, True, True, True, 0, True), (16, 2, 1, True, True, True, 0, True),
    ]
] + [{"MMA": True}]  # fmt: skip


def replay_us(fn) -> float:
    """Median microseconds of one CUDA-graph replay of `fn()`: the GPU's time, as a captured step pays
    it (events around eager calls would add the host's launches of the wrapper's small ops)."""
    from eval.bench.common import graph_ms  # imports triton: after a dry run's TRITON_INTERPRET

    return graph_ms(fn, torch.device("cuda")) * 1000


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes under Triton's CPU interpreter")
    parser.add_argument("--setting", type=int, action="append", help="time only SETTINGS[K] (repeatable)")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    from sparseserve_hf.ops import channels, triton_channels

    device = torch.device("cpu" if args.dry_run else "cuda")
    batch, kv_heads, group, dim, blocks, size = (2, 2, 4, 16, 8, 32) if args.dry_run else (16, 8, 4, 128, 1024, 32)
    share = 0.375
    stored = channels.stored_channels(share, dim)
    pool = batch * kv_heads * blocks
    torch.manual_seed(0)
    keys = torch.randn(pool, size, dim, device=device)
    metadata = channels.channel_metadata(keys, share, torch.float8_e4m3fn, torch.rand(pool, dim, device=device))
    del keys
    table = torch.randperm(pool, device=device).view(batch, kv_heads, blocks)
    query = torch.randn(
        batch, kv_heads * group, dim, device=device, dtype=torch.float32 if args.dry_run else torch.bfloat16
    )
    scaling = dim**-0.5
    rows = []
    expected = channels.block_logsumexp(query, metadata, table, size, stored, scaling)
    defaults = {name: getattr(triton_channels, name) for name in SETTINGS[0]}
    for setting in [SETTINGS[k] for k in args.setting] if args.setting else SETTINGS:
        knobs = {**defaults, **setting}
        for name, value in knobs.items():
            setattr(triton_channels, name, value)
        got = triton_channels.block_logsumexp(query, metadata, table, size, stored, scaling)
        knobs["max_abs_diff"] = float((got - expected).abs().max())  # no id is -1 here: no inf
        if args.dry_run:
            rows.append(knobs)
            continue
        kernel = replay_us(lambda: triton_channels.block_logsumexp(query, metadata, table, size, stored, scaling))
        whole = replay_us(  # as the channel scorer composes them (without feedback)
            lambda: triton_channels.feedback_mass(
                triton_channels.block_logsumexp(query, metadata, table, size, stored, scaling), None
            )
        )
        rows.append({**knobs, "kernel_us": round(kernel, 1), "score_channels_us": round(whole, 1)})
        print(rows[-1], flush=True)
    result = dict(
        command="python -m eval.bench.channel_kernel " + " ".join(argv or []),
        device="cpu (interpreter)" if args.dry_run else torch.cuda.get_device_name(),
        git_commit=os.environ.get("SPARSESERVE_COMMIT"),
        shape=dict(batch=batch, kv_heads=kv_heads, group=group, head_dim=dim, blocks=blocks, block_size=size),
        channel_share=share,
        metadata_bytes=metadata.numel(),
        rows=rows,
    )
    if not args.dry_run:
        fastest = min(rows, key=lambda row: row["kernel_us"])
        result["fastest_knobs"] = [  # as `eval.bench.decode_step --knob` takes them
            f"triton_channels.{name}={fastest[name]!r}" for name in defaults
        ]
        copy = torch.empty_like(metadata.view(torch.uint8))
        result["metadata_copy_us"] = round(replay_us(lambda: copy.copy_(metadata.view(torch.uint8))), 1)
        print("metadata copy", result["metadata_copy_us"], "us", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
