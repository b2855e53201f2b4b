"""Channel scores on the GPU (`ops.channels` is the spec): each block's log-sum-exp of its tokens'
estimated logits, read straight from the channel metadata pool through the rows' tables.

One program takes BLOCK_N blocks of one (row, KV head), side by side, for all G query heads of the
group. A key is `code * step + low` per stored channel, so a token's logit is the sum over the
block's channels of `code * (q * step)` plus `q . low`: a loop over the P stored channels reads
each block's pair index, minimum and step, gathers the group's query on that channel and adds
its codes' share into an (S, BLOCK_N, G) accumulator; SparQ's correction (the share of |q| the
block's channels hold) scales each (block, head) at the end, and a log-sum-exp over the S tokens
follows. A code c enters as the float 1 + c / 2^BITS, made by placing its bits at the top of 1.0's
mantissa (integer operations, where a conversion instruction runs at a quarter of the rate), and the
sum of q * step over the channels is taken off at the end. A step reads each block's metadata once; no (B, Hkv, N, S, P) key copy is ever made.
Everything computes in fp32, like the spec; only the order of the sums over channels differs.
The softmax over a row's blocks (`channels.block_mass`) is one PyTorch op on (B, Hq, N).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import channels

BLOCK_N = 4  # blocks per program (a launch knob)
NUM_WARPS = 1  # (a launch knob)
UNROLL = 2  # unroll factor of the loop over the stored channels (a launch knob)
WORDS = True  # the codes of 4 channels per 32-bit load where P allows (a launch knob)


@triton.jit
def _block_lse_kernel(
    query_ptr,  # (B, Hkv, G, D) fp32 queries times the softmax scale, contiguous
    abs_sum_ptr,  # (B, Hkv, G) fp32 each head's sum of |scaled q| over all D channels
    codes_ptr,  # the pool's bytes, uint8 (C, M, D)
    words_ptr,  # the same pool as int32 (C, M, D / 4) where CHUNK is 4 (else its bytes again)
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
    S: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEADER: tl.constexpr,  # the header's first byte
    PER_BYTE: tl.constexpr,
    BITS: tl.constexpr,
    CHUNK: tl.constexpr,  # channels per code load: 4 (a 32-bit word) or 1 (a byte)
    UNROLL: tl.constexpr,
):
    """Grid (B * Hkv, cdiv(N, BLOCK_N)); writes out[b, h*G:(h+1)*G, n-tile]. The BLOCK_N blocks side by
    side, a loop over the P stored channels: per channel each block's (S,) codes times its step meet
    the group's query on that channel in an (S, BLOCK_N, BLOCK_G) accumulator; SparQ's correction
    scales each (block, head) at the end. With CHUNK 4 (P a multiple of 4) the codes of 4 channels come
    in one 32-bit load from `words_ptr`; with CHUNK 1, a byte per channel."""
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    t = tl.arange(0, S)
    in_table = n < num_blocks
    block = tl.load(ids_ptr + b * stride_ib + h * stride_ih + n, mask=in_table, other=-1).to(tl.int64)
    valid = block >= 0
    start = block * stride_mc  # (BLOCK_N,)
    has_g = g < G
    query_rows = query_ptr + (row_head * G + g) * D  # (BLOCK_G,)
    # Tokens lead the accumulator, so that a thread holds many tokens of one (block, head): the
    # layouts spread the trailing (block, head) pairs over a warp's lanes, and a channel's query,
    # pair index, minimum and step are one load per lane instead of a copy of them all per lane.
    code_rows = start[None, :, None] + ((t // PER_BYTE) * P)[:, None, None]  # (S, BLOCK_N, 1)
    code_shift = ((t % PER_BYTE) * BITS)[:, None, None]
    top = 23 - BITS  # a code c placed at the top of 1.0's mantissa is the float 1 + c / 2^BITS
    acc = tl.zeros([S, BLOCK_N, BLOCK_G], tl.float32)  # sum over channels of q * step * (1 + code / 2^BITS)
    weight_sum = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)  # sum over channels of q * step
    kept = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    offset = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    for first in tl.range(0, P, CHUNK, loop_unroll_factor=UNROLL):
        if CHUNK == 4:  # byte c of the word: channel first + c
            packed = tl.load(words_ptr + (code_rows + first) // 4, mask=valid[None, :, None], other=0)
        else:
            packed = tl.load(codes_ptr + code_rows + first, mask=valid[None, :, None], other=0).to(tl.int32)
        for c in tl.static_range(CHUNK):
            i = first + c
            pair = tl.load(codes_ptr + start + HEADER + i % (P // 2), mask=valid, other=0).to(tl.int32)
            channel = pair + (i // (P // 2)) * (D // 2)  # (BLOCK_N,) the pair's second half from i = P / 2 on
            low = tl.load(bounds_ptr + start + HEADER + P // 2 + i, mask=valid, other=0.0).to(tl.float32)
            step = tl.load(bounds_ptr + start + HEADER + P // 2 + P + i, mask=valid, other=0.0).to(tl.float32)
            q = tl.load(query_rows[None, :] + channel[:, None], mask=valid[:, None] & has_g[None, :], other=0.0)
            kept += tl.abs(q)
            offset += q * low[:, None]
            weighted = q * tl.maximum(step, 1e-8)[:, None]  # (BLOCK_N, BLOCK_G)
            weight_sum += weighted
            shifted = (packed >> (code_shift + 8 * c)) << top  # (S, BLOCK_N, 1)
            codes = ((shifted & (((1 << BITS) - 1) << top)) | 0x3F800000).to(tl.float32, bitcast=True)
            acc += codes * weighted[None, :, :]
    total_abs = tl.maximum(tl.load(abs_sum_ptr + row_head * G + g, mask=has_g, other=1.0), 1e-30)
    correction = 1.0 / tl.sqrt(tl.maximum(kept / total_abs[None, :], 1e-6))  # (BLOCK_N, BLOCK_G)
    dots = (acc - weight_sum[None, :, :]) * (1 << BITS)  # sum over channels of q * step * code
    logits = (dots + offset[None, :, :]) * correction[None, :, :]  # (S, BLOCK_N, BLOCK_G)
    best = tl.max(logits, axis=0)
    lse = best + tl.log(tl.sum(tl.exp(logits - best[None, :, :]), axis=0))
    lse = tl.where(valid[:, None], lse, float("-inf"))
    out = out_ptr + b * stride_ob + (h * G + g)[None, :] * stride_oh + n[:, None]
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
    words = WORDS and stored % 4 == 0 and dim % 4 == 0  # then every block's code rows start 4-aligned
    _block_lse_kernel[grid](
        scaled.contiguous(), scaled.abs().sum(-1).contiguous(), metadata.view(torch.uint8),
        metadata.view(torch.int32 if words else torch.uint8), metadata, block_ids, out,
        block_ids.stride(0), block_ids.stride(1), out.stride(0), out.stride(1), metadata.stride(0), num_blocks,
        num_kv_heads, D=dim, G=group, P=stored, S=block_size, BLOCK_G=triton.next_power_of_2(group),
        BLOCK_N=BLOCK_N, HEADER=channels.header_start(block_size, stored, dim), PER_BYTE=channels.PER_BYTE,
        BITS=channels.BITS, CHUNK=4 if words else 1, UNROLL=UNROLL, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def score_channels(
    query: torch.Tensor, metadata: torch.Tensor, block_ids: torch.Tensor, block_size: int, stored: int, scaling: float
) -> torch.Tensor:
    """`channels.score_channels` with the per-block pass as one kernel (same arguments and result)."""
    return channels.block_mass(block_logsumexp(query, metadata, block_ids, block_size, stored, scaling))
