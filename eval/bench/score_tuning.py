"""Launch sweep of the block-scoring kernel (`ops.triton_score.score_parts`) on the decode attention benchmark's shape.

    python -m eval.bench.score_tuning --out eval/results/score_tuning.json   # ~30 s on the H200

Llama-3-8B shape (Hq=32, Hkv=8, D=128, bf16, 32-token blocks) at 128K context, B=32: every
block's metadata (in the default config's dtype unless `--metadata-dtype` says otherwise) read once
through the row's table. Each (blocks per program, warps) point is
timed as a CUDA-graph replay of the scoring kernel alone; `gb_per_s` counts the metadata, table
and score bytes moved, and `copy_fraction` compares it with a device-to-device copy measured in
the same run. For "hybrid" the rank interleave (`triton_rank.combine_top_ranks`, at the default
config's depth) is swept over its warps too (`part` "combine"), and the default selection after it
(`attention.pick_blocks`) is timed too (`part` "select").
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from eval.bench.common import graph_ms, pick_device, prepare_triton, print_table, run_record, time_ms, write_json
from eval.bench.decode_attention import copy_bandwidth
from sparseserve_hf import SparseServeConfig
from sparseserve_hf.ops import reference

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32
DTYPE = torch.bfloat16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--kinds", nargs="+", default=["quest", "hybrid"])
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--metadata-dtype",
        default="auto",
        help="the metadata pool's dtype, as SparseServeConfig.metadata_dtype ('auto': the default config's)",
    )
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (tests the script)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = pick_device(args.dry_run)
    prepare_triton(device)
    from sparseserve_hf.ops import triton_score  # after prepare_triton: the interpreter on CPU

    heads, dim = (Q_HEADS, HEAD_DIM) if not args.dry_run else (4, 16)
    kv_heads = KV_HEADS if not args.dry_run else 2
    if args.dry_run:
        args.context, args.batch, args.block_n, args.warps = 512, 1, [16], [4]
    num_blocks = args.context // BLOCK - 1
    copy_gb_per_s = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 20))
    query = torch.randn(args.batch, heads, dim, device=device, dtype=DTYPE if device.type == "cuda" else torch.float32)
    metadata_dtype = reference.metadata_dtype(args.metadata_dtype, DTYPE, device)
    rows = []
    for kind in args.kinds:
        vectors = SparseServeConfig(metadata=kind).metadata_vectors  # the kind's default layout
        metadata = torch.randn(args.batch * kv_heads * num_blocks, vectors, dim, device=device, dtype=query.dtype)
        metadata = reference.to_metadata_dtype(metadata, metadata_dtype)
        table = torch.randperm(metadata.shape[0], device=device).view(args.batch, kv_heads, num_blocks)
        outputs = 2 if kind == "hybrid" else 1
        moved = (
            metadata.numel() * metadata.element_size()
            + table.numel() * 8
            + outputs * query.shape[:2].numel() * num_blocks * 4
        )
        for block_n in args.block_n:
            for warps in args.warps:

                def score(block_n=block_n, warps=warps, metadata=metadata, table=table, kind=kind) -> tuple:
                    return triton_score.score_parts(query, metadata, table, kind, block_n=block_n, num_warps=warps)

                ms = graph_ms(score, device) or time_ms(score, device)
                rows.append({"kind": kind, "part": "score", "block_n": block_n, "warps": warps, "ms": ms,
                             "gb_per_s": moved / ms / 1e6, "copy_fraction": moved / ms / 1e6 / copy_gb_per_s})  # fmt: skip
        if kind == "hybrid":
            rows += combine_sweep(triton_score.score_parts(query, metadata, table, kind), args.warps, device, kv_heads)
        del metadata, table
    print_table(rows, ["kind", "part", "block_n", "warps", "ms", "gb_per_s", "copy_fraction"])
    best = {
        f"{kind}_{part}": min((r for r in rows if (r["kind"], r["part"]) == (kind, part)), key=lambda r: r["ms"])
        for kind, part in dict.fromkeys((r["kind"], r["part"]) for r in rows)
    }
    result = {**run_record(device), "context": args.context, "batch": args.batch, "copy_gb_per_s": copy_gb_per_s,
              "metadata_dtype": str(metadata_dtype), "best": best, "rows": rows}  # fmt: skip
    write_json(args.out, result)
    return result


def combine_sweep(
    parts: tuple[torch.Tensor, torch.Tensor], warps: list[int], device, num_kv_heads: int
) -> list[dict[str, Any]]:
    """The hybrid rank interleave at the default depth, one row per warp count, then the selection after it."""
    from sparseserve_hf.ops import triton_rank

    depth = SparseServeConfig().selected_full_blocks
    rows = []
    for num_warps in warps:

        def combine(num_warps=num_warps) -> torch.Tensor:
            return triton_rank.combine_top_ranks(*parts, depth=depth, num_warps=num_warps)

        ms = graph_ms(combine, device) or time_ms(combine, device)
        rows.append({"kind": "hybrid", "part": "combine", "block_n": parts[0].shape[-1], "warps": num_warps, "ms": ms,
                     "gb_per_s": float("nan"), "copy_fraction": float("nan")})  # fmt: skip
    return rows + [select_row(triton_rank.combine_top_ranks(*parts, depth=depth), num_kv_heads, device)]


def select_row(combined: torch.Tensor, num_kv_heads: int, device) -> dict[str, Any]:
    """The default selection (per-head top-k + GQA union, `attention.pick_blocks`) over interleaved ranks."""
    from sparseserve_hf.attention import pick_blocks
    from sparseserve_hf.ops import get_ops

    config, ops = SparseServeConfig(), get_ops("triton", device)
    num_blocks = torch.full((combined.shape[0],), combined.shape[-1], dtype=torch.long, device=device)

    def select() -> tuple:
        return pick_blocks(ops, config, combined, num_blocks, num_kv_heads, combined.shape[-1])[:2]

    ms = graph_ms(select, device) or time_ms(select, device)
    return {"kind": "hybrid", "part": "select", "block_n": combined.shape[-1], "warps": 0, "ms": ms,
            "gb_per_s": float("nan"), "copy_fraction": float("nan")}  # fmt: skip


if __name__ == "__main__":
    main()
