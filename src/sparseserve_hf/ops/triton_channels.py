"""Channel scores on the GPU (`ops.channels` is the spec): each block's log-sum-exp of its tokens'
estimated logits, read straight from the channel metadata pool through the rows' tables.

One program takes BLOCK_N blocks of one (row, KV head) for all G query heads of the group. Per block it
reads the header (the stored pairs, minima and steps), gathers the group's query on the block's own
channels and scales it by SparQ's correction for the share of |q| they hold; then, code byte row by
code byte row, it decodes 8 / BITS tokens at a time and keeps a running maximum and sum of exp per
(block, query head) (an online log-sum-exp), so no (B, Hkv, N, S, P) key copy is ever made. A step
reads each block's metadata once, in whole contiguous rows. Everything computes in fp32, like the
spec; only the order of the sums over channels differs. The softmax over a row's blocks
(`channels.block_mass`) is one PyTorch op on (B, Hq, N).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import channels

BLOCK_N = 4  # blocks per program (the fastest of 4-16 blocks x 1-8 warps on the H200)
NUM_WARPS = 1


@triton.jit
def _block_lse_kernel(
    query_ptr,  # (B, Hkv, G, D) fp32 queries times the softmax scale, contiguous
    abs_sum_ptr,  # (B, Hkv, G) fp32 each head's sum of |scaled q| over all D channels
    codes_ptr,  # the pool's bytes, uint8 (C, M, D)
    bounds_ptr,  # the same pool as float8_e4m3fn (for the minima and the steps)
    ids_ptr,  # (B, Hkv, N) int64, unit stride on N
    out_ptr,  # (B, Hq, N) fp32
    stride_ib,
    stride_ih,
    stride_ob,
    stride_oh,
    stride_mc,
    num_blocks,
    num_kv_heads,
    D: tl.constexpr,
    G: tl.constexpr,
    P: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CODE_ROWS: tl.constexpr,  # packed code rows of P bytes: S / PER_BYTE
    HEADER: tl.constexpr,  # the header's first byte
    PER_BYTE: tl.constexpr,
    BITS: tl.constexpr,
):
    """Grid (B * Hkv, cdiv(N, BLOCK_N)); writes out[b, h*G:(h+1)*G, n-tile]."""
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    p = tl.arange(0, BLOCK_P)
    g = tl.arange(0, BLOCK_G)
    in_table = n < num_blocks
    ids = tl.load(ids_ptr + b * stride_ib + h * stride_ih + n, mask=in_table, other=-1).to(tl.int64)
    valid = ids >= 0
    has_p = p < P
    mask = valid[:, None] & has_p[None, :]  # (BLOCK_N, BLOCK_P)
    block = ids[:, None] * stride_mc  # (BLOCK_N, 1) the block's first byte
    half = P // 2
    pair = tl.load(codes_ptr + block + HEADER + (p % half)[None, :], mask=mask, other=0).to(tl.int32)
    channel = pair + (p >= half).to(tl.int32)[None, :] * (D // 2)  # (BLOCK_N, BLOCK_P)
    low = tl.load(bounds_ptr + block + HEADER + half + p[None, :], mask=mask, other=0.0).to(tl.float32)
    step = tl.load(bounds_ptr + block + HEADER + half + P + p[None, :], mask=mask, other=0.0).to(tl.float32)
    step = tl.maximum(step, 1e-8)
    has_g = g < G
    q = tl.load(
        query_ptr + ((row_head * G + g) * D)[None, :, None] + channel[:, None, :],
        mask=mask[:, None, :] & has_g[None, :, None],
        other=0.0,
    )  # (BLOCK_N, BLOCK_G, BLOCK_P) the group's scaled query on each block's channels; padding 0
    total_abs = tl.load(abs_sum_ptr + row_head * G + g, mask=has_g, other=1.0)  # (BLOCK_G,)
    kept = tl.sum(tl.abs(q), axis=2) / tl.maximum(total_abs, 1e-30)[None, :]  # (BLOCK_N, BLOCK_G); scale cancels
    q = q / tl.sqrt(tl.maximum(kept, 1e-6))[:, :, None]
    best = tl.full([BLOCK_N, BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    for j in tl.static_range(CODE_ROWS):
        packed = tl.load(codes_ptr + block + j * P + p[None, :], mask=mask, other=0).to(tl.int32)  # (BLOCK_N, BLOCK_P)
        for t in tl.static_range(PER_BYTE):
            keys = ((packed >> (t * BITS)) & ((1 << BITS) - 1)).to(tl.float32) * step + low  # (BLOCK_N, BLOCK_P)
            logits = tl.sum(keys[:, None, :] * q, axis=2)  # (BLOCK_N, BLOCK_G)
            newest = tl.maximum(best, logits)
            total = total * tl.exp(best - newest) + tl.exp(logits - newest)
            best = newest
    lse = tl.where(valid[:, None], best + tl.log(total), float("-inf"))
    out = out_ptr + b * stride_ob + (h * G + g)[None, :] * stride_oh + n[:, None]  # (BLOCK_N, BLOCK_G)
    tl.store(out, lse, mask=in_table[:, None] & has_g[None, :])


def block_logsumexp(
    query: torch.Tensor,
    metadata: torch.Tensor,
    block_ids: torch.Tensor,
    block_size: int,
    stored: int,
    scaling: float,
) -> torch.Tensor:
    """`channels.block_logsumexp` as one kernel: (B, Hq, N) fp32, -inf where the id is -1.

    Args:
        query: (B, Hq, D) decode queries.
        metadata: (C, M, D) float8_e4m3fn channel metadata pool, each block's rows contiguous.
        block_ids: (B, Hkv, N) long DRAM ids, -1 where unused.
        block_size, stored: S and P of the metadata (`channels.stored_channels`).
        scaling: the attention's softmax scale.
    """
    batch, num_kv_heads, num_blocks = block_ids.shape
    num_q_heads, dim = query.shape[1], query.shape[2]
    group = num_q_heads // num_kv_heads
    assert metadata.element_size() == 1 and metadata.stride(2) == 1 and metadata.stride(1) == dim
    out = torch.empty((batch, num_q_heads, num_blocks), dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    scaled = query.float().view(batch, num_kv_heads, group, dim) * scaling
    block_ids = block_ids if block_ids.stride(-1) == 1 else block_ids.contiguous()
    grid = (batch * num_kv_heads, triton.cdiv(num_blocks, BLOCK_N))
    _block_lse_kernel[grid](
        scaled.contiguous(), scaled.abs().sum(-1).contiguous(), metadata.view(torch.uint8), metadata,
        block_ids, out, block_ids.stride(0), block_ids.stride(1), out.stride(0), out.stride(1),
        metadata.stride(0), num_blocks, num_kv_heads,
        D=dim, G=group, P=stored, BLOCK_G=triton.next_power_of_2(group),
        BLOCK_P=triton.next_power_of_2(stored), BLOCK_N=BLOCK_N, CODE_ROWS=block_size // channels.PER_BYTE,
        HEADER=channels.header_start(block_size, stored, dim), PER_BYTE=channels.PER_BYTE,
        BITS=channels.BITS, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def score_channels(
    query: torch.Tensor, metadata: torch.Tensor, block_ids: torch.Tensor, block_size: int, stored: int, scaling: float
) -> torch.Tensor:
    """`channels.score_channels` with the per-block pass as one kernel (same arguments and result)."""
    return channels.block_mass(block_logsumexp(query, metadata, block_ids, block_size, stored, scaling))
