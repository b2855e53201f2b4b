"""Channel scores on the GPU (`ops.channels` is the spec): each block's log-sum-exp of its tokens'
estimated logits, read straight from the channel metadata pool through the rows' tables.

One program takes BLOCK_N blocks of one (row, KV head) for all G query heads of the group: it reads
the R chosen channels' minimum and step of each block, then, code row by code row, the packed
2-bit codes of 8 / BITS tokens, and keeps a running maximum and sum of exp per (block, query head)
over the block's tokens (an online log-sum-exp), so no (B, Hkv, N, S, R) key copy is ever made.
Everything computes in fp32, like the spec; only the order of the sums over channels differs.
The channel choice and the query's scale (`channels.channel_queries`) and the softmax over a row's
blocks (`channels.block_mass`) are a few PyTorch ops on (B, Hq, R) and (B, Hq, N) tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import channels

BLOCK_N = 16  # blocks per program
NUM_WARPS = 4
# A launch knob, off by default until timed: the group's products as one fp16 tensor-core product per
# token (keys and the scaled query rounded to fp16, about 1e-3 relative) instead of fp32 products
# summed over the channels in registers (exact up to the order of the sum).
TENSOR_CORES = False
MIN_DOT = 16  # tl.dot's smallest tile side


@triton.jit
def _block_lse_kernel(
    scaled_ptr,  # (B, Hkv, G, R) fp32, contiguous
    chosen_ptr,  # (B, Hkv, R) int32, contiguous
    codes_ptr,  # the pool's bytes, uint8 (C, M, D)
    bounds_ptr,  # the same pool as float8_e4m3fn (for the minimum and the step rows)
    ids_ptr,  # (B, Hkv, N) int64, unit stride on N
    out_ptr,  # (B, Hq, N) fp32
    stride_ib,
    stride_ih,
    stride_ob,
    stride_oh,
    stride_mc,
    num_blocks,
    num_kv_heads,
    R,
    D: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CODE_ROWS: tl.constexpr,
    PER_BYTE: tl.constexpr,
    BITS: tl.constexpr,
    DOT: tl.constexpr,
):
    """Grid (B * Hkv, cdiv(N, BLOCK_N)); writes out[b, h*G:(h+1)*G, n-tile]. BLOCK_G >= 16 with DOT."""
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    g = tl.arange(0, BLOCK_G)
    in_table = n < num_blocks
    ids = tl.load(ids_ptr + b * stride_ib + h * stride_ih + n, mask=in_table, other=-1).to(tl.int64)
    valid = ids >= 0
    has_r = r < R
    channel = tl.load(chosen_ptr + row_head * R + r, mask=has_r, other=0)  # (BLOCK_R,)
    q = tl.load(
        scaled_ptr + (row_head * G + g)[:, None] * R + r[None, :], mask=(g < G)[:, None] & has_r[None, :], other=0.0
    )  # (BLOCK_G, BLOCK_R): padded heads and channels are 0
    cell = ids[:, None] * stride_mc + channel[None, :]  # (BLOCK_N, BLOCK_R) byte offset of row 0
    mask = valid[:, None] & has_r[None, :]
    low = tl.load(bounds_ptr + cell + CODE_ROWS * D, mask=mask, other=0.0).to(tl.float32)
    step = tl.maximum(tl.load(bounds_ptr + cell + (CODE_ROWS + 1) * D, mask=mask, other=0.0).to(tl.float32), 1e-8)
    q_half = tl.trans(q.to(tl.float16))  # (BLOCK_R, BLOCK_G), for DOT
    best = tl.full([BLOCK_N, BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    for j in tl.static_range(CODE_ROWS):
        packed = tl.load(codes_ptr + cell + j * D, mask=mask, other=0).to(tl.int32)  # (BLOCK_N, BLOCK_R)
        for t in tl.static_range(PER_BYTE):
            keys = ((packed >> (t * BITS)) & ((1 << BITS) - 1)).to(tl.float32) * step + low  # (BLOCK_N, BLOCK_R)
            if DOT:
                logits = tl.dot(keys.to(tl.float16), q_half)  # (BLOCK_N, BLOCK_G), fp32 accumulation
            else:
                logits = tl.sum(keys[:, None, :] * q[None, :, :], axis=2)  # (BLOCK_N, BLOCK_G)
            newest = tl.maximum(best, logits)
            total = total * tl.exp(best - newest) + tl.exp(logits - newest)
            best = newest
    lse = tl.where(valid[:, None], best + tl.log(total), float("-inf"))
    out = out_ptr + b * stride_ob + (h * G + g)[None, :] * stride_oh + n[:, None]  # (BLOCK_N, BLOCK_G)
    tl.store(out, lse, mask=in_table[:, None] & (g < G)[None, :])


def block_logsumexp(
    scaled: torch.Tensor,
    chosen: torch.Tensor,
    metadata: torch.Tensor,
    block_ids: torch.Tensor,
    tensor_cores: bool | None = None,
) -> torch.Tensor:
    """`channels.block_logsumexp` as one kernel: (B, Hq, N) fp32, -inf where the id is -1.
    `tensor_cores`: the products in fp16 on tensor cores (None: `TENSOR_CORES`).

    Args:
        scaled, chosen: (B, Hkv, G, R) and (B, Hkv, R), from `channels.channel_queries`.
        metadata: (C, M, D) float8_e4m3fn channel metadata pool, each block's rows contiguous.
        block_ids: (B, Hkv, N) long DRAM ids, -1 where unused.
    """
    batch, num_kv_heads, group, count = scaled.shape
    num_blocks, dim = block_ids.shape[2], metadata.shape[2]
    assert metadata.element_size() == 1 and metadata.stride(2) == 1 and metadata.stride(1) == dim
    out = torch.empty((batch, num_kv_heads * group, num_blocks), dtype=torch.float32, device=scaled.device)
    if out.numel() == 0:
        return out
    block_ids = block_ids if block_ids.stride(-1) == 1 else block_ids.contiguous()
    grid = (batch * num_kv_heads, triton.cdiv(num_blocks, BLOCK_N))
    dot = TENSOR_CORES if tensor_cores is None else tensor_cores
    block_g = triton.next_power_of_2(group)
    _block_lse_kernel[grid](
        scaled.float().contiguous(), chosen.to(torch.int32).contiguous(), metadata.view(torch.uint8), metadata,
        block_ids, out, block_ids.stride(0), block_ids.stride(1), out.stride(0), out.stride(1),
        metadata.stride(0), num_blocks, num_kv_heads, count,
        D=dim, G=group, BLOCK_G=max(MIN_DOT, block_g) if dot else block_g,
        BLOCK_R=max(MIN_DOT, triton.next_power_of_2(count)), BLOCK_N=BLOCK_N, CODE_ROWS=metadata.shape[1] - 2,
        PER_BYTE=8 // channels.BITS, BITS=channels.BITS, DOT=dot, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def score_channels(
    query: torch.Tensor, metadata: torch.Tensor, block_ids: torch.Tensor, channels_read: int, scaling: float
) -> torch.Tensor:
    """`channels.score_channels` with the per-block pass as one kernel (same arguments and result)."""
    chosen, scaled = channels.channel_queries(query, block_ids.shape[1], channels_read, scaling)
    return channels.block_mass(block_logsumexp(scaled, chosen, metadata, block_ids))
