"""The hybrid score's rank interleave (`reference.combine_by_rank` with a depth) as one Triton kernel.

The reference runs a top-k per ranking (a radix select over every (row, query head, block) each),
then scatters the ranks. Here one program per (row, query head), for both rankings at once:
1. finds each ranking's `depth`-th largest score by a bitwise search over order-preserving 32-bit
   keys (`triton_select.order_key`; one reduction per key bit serves both rankings) and takes
   every score above it and the lowest-index ties up to `depth`: the ranking's top list;
2. compacts the list through a small scratch row and ranks it exactly by pairwise comparison
   (depth x depth, ties to the lower block index);
3. writes back, per block, -2j for rank j in the first ranking or -(2j + 1) in the second (the
   larger where both), -2 * depth for blocks in neither, -inf where either score is -inf.
Only ties are decided differently from the reference (whose top-k breaks them in no particular
order); NaN ranks as the lowest finite score, where the reference's top-k puts it first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_select import ORDER_KEY_BITS, order_key, top_k_rows, wide_table_warps

COMBINE_WARPS: int | None = None  # the kernel's warps (a launch knob); None: by the table's width


@triton.jit
def top_list_ranks(x, live, n, scratch_key_ptr, scratch_idx_ptr, scratch_rank_ptr, DEPTH, BLOCK_K: tl.constexpr):
    """Rank (0 = best) of each block in each ranking's top-`DEPTH` list, DEPTH where not listed.

    x: (2, BN) the two rankings' scores, searched together: each search step is one reduction
    for both, so the latency chain is that of one ranking.
    """
    which = tl.arange(0, 2)
    key = tl.where(live[None, :], order_key(x), 0)  # (2, BN) uint32, dead 0
    listed = top_k_rows(key, live[None, :], DEPTH, ORDER_KEY_BITS)
    position = tl.cumsum(listed.to(tl.int32), axis=1) - 1 + which[:, None] * BLOCK_K  # (2, BN) scratch index
    tl.store(scratch_key_ptr + position, key.to(tl.int32, bitcast=True), mask=listed)
    tl.store(scratch_idx_ptr + position, n[None, :] + tl.zeros_like(position), mask=listed)
    tl.debug_barrier()
    k = tl.arange(0, BLOCK_K)
    k_ok = k < DEPTH
    entry = which[:, None] * BLOCK_K + k[None, :]  # (2, BK)
    list_key = tl.load(scratch_key_ptr + entry, mask=k_ok[None, :], other=0).to(tl.uint32, bitcast=True)
    list_idx = tl.load(scratch_idx_ptr + entry, mask=k_ok[None, :], other=0)
    key_i, key_j = list_key[:, :, None], list_key[:, None, :]
    better = (key_j > key_i) | ((key_j == key_i) & (list_idx[:, None, :] < list_idx[:, :, None]))  # [r, i, j]: j first
    rank = tl.sum((better & k_ok[None, None, :]).to(tl.int32), axis=2)  # (2, BK)
    tl.store(scratch_rank_ptr + entry, rank, mask=k_ok[None, :])
    tl.debug_barrier()
    return tl.where(listed, tl.load(scratch_rank_ptr + position, mask=listed, other=0), DEPTH)


@triton.jit
def interleave(
    first, second, live, n, scratch_key_ptr, scratch_idx_ptr, scratch_rank_ptr, DEPTH, BLOCK_K: tl.constexpr
):
    """The interleave of two rankings' top-DEPTH lists, scores first and second (W,) of blocks n:
    (W,) -2j for rank j of the first, -(2j + 1) of the second (the larger where both list it),
    -2 * DEPTH where neither does, -inf where either score is -inf; and (W,) whether either lists it."""
    which = tl.arange(0, 2)[:, None]  # (2, 1): 0 = first, 1 = second
    both = tl.where(which == 0, first[None, :], second[None, :])  # (2, W)
    rank = top_list_ranks(both, live, n, scratch_key_ptr, scratch_idx_ptr, scratch_rank_ptr, DEPTH, BLOCK_K)
    scored = tl.where(rank < DEPTH, -(2.0 * rank + which.to(tl.float32)), -2.0 * DEPTH)
    out = tl.where((first == float("-inf")) | (second == float("-inf")), float("-inf"), tl.max(scored, axis=0))
    return out, tl.min(rank, axis=0) < DEPTH


@triton.jit
def _combine_kernel(
    first_ptr,
    second_ptr,
    out_ptr,
    scratch_key_ptr,
    scratch_idx_ptr,
    scratch_rank_ptr,
    num_table,
    DEPTH,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid (B * Hq,), contiguous (B * Hq, N) inputs and output; scratch rows of 2 * BLOCK_K per program."""
    row = tl.program_id(0)
    n = tl.arange(0, BLOCK_N)
    live = n < num_table
    first = tl.load(first_ptr + row * num_table + n, mask=live, other=float("-inf"))
    second = tl.load(second_ptr + row * num_table + n, mask=live, other=float("-inf"))
    scratch = row * 2 * BLOCK_K
    out, _ = interleave(
        first, second, live, n, scratch_key_ptr + scratch, scratch_idx_ptr + scratch, scratch_rank_ptr + scratch,
        DEPTH, BLOCK_K,
    )  # fmt: skip
    tl.store(out_ptr + row * num_table + n, out, mask=live)


def combine_top_ranks(
    first: torch.Tensor, second: torch.Tensor, depth: int, *, num_warps: int | None = None
) -> torch.Tensor:
    """`reference.combine_by_rank(first, second, depth)` for (B, H, N) fp32 scores, one launch.

    `num_warps` (a launch knob for `eval.bench.score_tuning`): None picks by the table width.
    """
    depth = min(depth, first.shape[-1])
    out = torch.empty(first.shape, dtype=torch.float32, device=first.device)
    rows, num_table = first.numel() // max(first.shape[-1], 1), first.shape[-1]
    if out.numel() == 0 or depth == 0:
        return out.fill_(-2.0 * depth).masked_fill_(torch.isneginf(first) | torch.isneginf(second), float("-inf"))
    block_k = triton.next_power_of_2(depth)
    scratch_key = torch.empty((rows, 2 * block_k), dtype=torch.int32, device=first.device)  # uint32 bits
    scratch_idx = torch.empty_like(scratch_key)
    scratch_rank = torch.empty_like(scratch_key)
    block_n = triton.next_power_of_2(max(num_table, 16))
    _combine_kernel[(rows,)](
        first.contiguous(), second.contiguous(), out, scratch_key, scratch_idx, scratch_rank, num_table, depth,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps or COMBINE_WARPS or wide_table_warps(block_n, narrow=2),
    )  # fmt: skip
    return out
