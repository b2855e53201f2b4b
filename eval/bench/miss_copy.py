"""The lookup's miss copy (`ops.triton_transfer.gather_blocks` over counted lists) at decode sizes.

    python -m eval.bench.miss_copy --out eval/results/miss_copy.json   # ~30 s on the H200

A decode step's misses are few: at real locality a layer of B=16 x 32K loads 1-3 MiB, in one
load list per KV head. This times that copy: `--misses` random 16 KiB head-blocks (Llama-3-8B:
2 x 32 tokens x 128 dims, bf16) spread evenly over 8 lists, read from a pinned DRAM pool into
random HBM slots, as a CUDA-graph replay of the one launch. `over_bulk` compares it with one
contiguous pinned host-to-device copy of the same bytes measured in the same run (PCIe's bulk
rate): at or above 1, the copy is at the floor the decode step's bound charges for its misses.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from eval.bench.common import graph_ms, pick_device, prepare_triton, print_table, run_record, time_ms, write_json

BLOCK_SHAPE = (2, 32, 128)  # (K/V, tokens, head dim)
LISTS = 8  # KV heads of one layer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--misses", type=int, nargs="+", default=[16, 64, 128, 256, 1024])
    parser.add_argument("--pool-gib", type=float, default=4.0, help="pinned DRAM pool the blocks come from")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (tests the script)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = pick_device(args.dry_run)
    prepare_triton(device)
    from sparseserve_hf.ops import triton_transfer  # after prepare_triton: the interpreter on CPU

    shape, dtype = (BLOCK_SHAPE, torch.bfloat16) if not args.dry_run else ((2, 8, 16), torch.float32)
    if args.dry_run:
        args.misses, args.pool_gib = [16, 32], 1 / 1024
    block_bytes = torch.Size(shape).numel() * dtype.itemsize
    num_pool = int(args.pool_gib * (1 << 30)) // block_bytes
    most = max(args.misses)
    pool = torch.zeros((num_pool, *shape), dtype=dtype)
    pool = pool.pin_memory() if device.type == "cuda" else pool
    slots = torch.empty((2 * most, *shape), dtype=dtype, device=device)
    staging = torch.empty((most, *shape), dtype=dtype, device=device)
    rows = []
    for misses in args.misses:
        per_list = -(-misses // LISTS)
        count = per_list * LISTS
        src = torch.randperm(num_pool)[:count].view(LISTS, per_list).to(device)
        dst = torch.randperm(slots.shape[0])[:count].view(LISTS, per_list).to(device)
        counts = torch.full((LISTS,), per_list, dtype=torch.long, device=device)
        bulk = time_ms(lambda n=count: staging[:n].copy_(pool[:n], non_blocking=True), device)

        def copy(s=src, d=dst, c=counts) -> None:
            triton_transfer.gather_blocks(pool, s, slots, d, c)

        copy()
        ms = graph_ms(copy, device) or time_ms(copy, device)
        nbytes = count * block_bytes
        rows.append(
            {
                "misses": count,
                "us": ms * 1e3,
                "gb_per_s": nbytes / (ms * 1e6),
                "bulk_us": bulk * 1e3,
                "over_bulk": bulk / ms,
            }
        )
    print_table(rows, ["misses", "us", "gb_per_s", "bulk_us", "over_bulk"])
    result = {**run_record(device), "block_bytes": block_bytes, "lists": LISTS, "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
