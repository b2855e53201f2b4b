"""The decode step's load accounting as one small Triton launch (see `reference.account_loads`).

One program per KV head owns that head's counters, so nothing is atomic and the sums are exact
integers: the same totals as the reference, in any order. It reads only (B, U) flags and two
(B,) vectors, so it adds one short launch per layer and no host sync (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import LOAD_COUNTERS

MAX_ROWS_PER_TILE = 32


@triton.jit
def _account_kernel(
    totals_ptr,
    valid_ptr,
    num_blocks_ptr,
    tail_len_ptr,
    batch,
    width,
    stride_vb,
    stride_vh,
    stride_th,
    block_size,
    BLOCK_B: tl.constexpr,
    BLOCK_U: tl.constexpr,
):
    """Grid (Hkv,): adds head h's step to totals[h, 0:5] (loaded, context, live rows, scored, calls)."""
    h = tl.program_id(0)
    u = tl.arange(0, BLOCK_U)
    loaded = tl.zeros([BLOCK_B], dtype=tl.int64)
    context = tl.zeros([BLOCK_B], dtype=tl.int64)
    live_rows = tl.zeros([BLOCK_B], dtype=tl.int64)
    scored = tl.zeros([BLOCK_B], dtype=tl.int64)
    for start in range(0, batch, BLOCK_B):
        b = start + tl.arange(0, BLOCK_B)
        rows = b < batch
        blocks = tl.load(num_blocks_ptr + b, mask=rows, other=0).to(tl.int64)
        tail = tl.load(tail_len_ptr + b, mask=rows, other=0).to(tl.int64)
        tokens = blocks * block_size + tail
        live = rows & (tokens > 0)
        flags = tl.load(
            valid_ptr + b[:, None] * stride_vb + h * stride_vh + u[None, :],
            mask=live[:, None] & (u < width)[None, :],
            other=0,
        )
        picked = tl.sum((flags != 0).to(tl.int64), axis=1)  # (BLOCK_B,)
        loaded += tl.where(live, picked * block_size + tail, 0)
        context += tl.where(live, tokens, 0)
        live_rows += live.to(tl.int64)
        scored += tl.where(live, blocks, 0)
    row = totals_ptr + h * stride_th
    tl.store(row + 0, tl.load(row + 0) + tl.sum(loaded, axis=0))
    tl.store(row + 1, tl.load(row + 1) + tl.sum(context, axis=0))
    tl.store(row + 2, tl.load(row + 2) + tl.sum(live_rows, axis=0))
    tl.store(row + 3, tl.load(row + 3) + tl.sum(scored, axis=0))
    tl.store(row + 4, tl.load(row + 4) + 1)


def account_loads(
    totals: torch.Tensor, valid: torch.Tensor, num_blocks: torch.Tensor, tail_len: torch.Tensor, block_size: int
) -> None:
    """`reference.account_loads` in one launch. totals (Hkv, 5) int64 (rows may be strided, each
    contiguous); valid (B, Hkv, U) bool; num_blocks, tail_len (B,) contiguous, all on one device."""
    batch, num_kv_heads, width = valid.shape
    assert totals.shape == (num_kv_heads, LOAD_COUNTERS) and totals.dtype == torch.int64 and totals.stride(1) == 1
    if num_kv_heads == 0:
        return
    valid = valid if valid.stride(-1) == 1 else valid.contiguous()
    _account_kernel[(num_kv_heads,)](
        totals, valid.view(torch.int8), num_blocks.contiguous(), tail_len.contiguous(), batch, width,
        valid.stride(0), valid.stride(1), totals.stride(0), block_size,
        BLOCK_B=min(MAX_ROWS_PER_TILE, triton.next_power_of_2(max(batch, 1))),
        BLOCK_U=triton.next_power_of_2(max(width, 16)), num_warps=4,
    )  # fmt: skip
