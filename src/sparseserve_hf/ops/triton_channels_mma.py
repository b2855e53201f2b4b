"""Channel scores on tensor cores: `triton_channels.block_logsumexp`'s estimate as `mma.m16n8k16` products.

A block's logits for the G query heads are a (G x P) by (P x S) product: the heads' query on each
stored channel times its step (fp16 weights), by the channels' 2-bit codes of the block's tokens.
`tl.dot` would take both operands in a register layout of its own and move them there through
shared memory, which cost what the tensor cores saved. Here a program is one warp and every tensor
has 32 elements, one per lane, so each lane builds exactly the registers PTX's fragment layout gives
it and hands them to the instruction (`tl.inline_asm_elementwise`):
- lane = 4 x g + t. A (weights, 16 x 16 per step of 16 channels): row g is query head g (rows G..15
  zero), the lane's columns are channels 2t, 2t + 1, 2t + 8 and 2t + 9 of the step;
- B (codes, 16 x 8): the same four channels of token g of an 8-token tile; the code bytes of two
  adjacent channels are adjacent (byte j * P + i holds tokens 4j .. 4j + 3 of channel i), so one
  16-bit load holds both, and each code becomes an exact fp16 by placing it under 1024's exponent
  and subtracting 1024 in the same pair (`sub.f16x2`);
- D (16 x 8, fp32): row g, tokens 2t and 2t + 1 of the tile; four tiles cover a 32-token block.
Each lane adds its channels' share of q . minimum and |q|, the four lanes of a head sum them, and the
log-sum-exp over the block's tokens is taken across those four lanes. Weights in fp16 (the FMA kernel
and the spec multiply in fp32): the estimates differ from the spec's by about 1e-3 of a logit's size.
Shapes it takes (`fits`): 2-bit codes of 32-token blocks, P a multiple of 16, G <= 8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import channels
from .triton_channels import _fp8_value, _query_by_channel, native_fp8

BLOCKS = 16  # blocks one program (one warp) scores in turn (a launch knob)


def fits(block_size: int, stored: int, group: int) -> bool:
    """Whether the tensor-core form takes this shape: 32-token blocks of 2-bit codes, P a multiple of
    16 (whole steps of the product), at most 8 query heads per KV head (the rows a lane group holds)."""
    return channels.BITS == 2 and block_size == 32 and stored % 16 == 0 and group <= 8


@triton.jit
def _half2(high, low):
    """fp32 pairs -> int32 words holding two fp16 (`low` in the low half): an MMA operand register."""
    return tl.inline_asm_elementwise(
        "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [high, low], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _codes_half2(halves, shift, magic):
    """int32 words whose low 16 bits hold two adjacent channels' code bytes -> the codes at bit `shift`
    of each byte as an exact fp16 pair (the first channel low): each byte moved to its half, its code
    put under 1024's exponent (1024 + code), then 1024 taken off both halves at once."""
    spread = (halves & 0xFF) | ((halves & 0xFF00) << 8)  # byte 1 to bits 16..23
    biased = ((spread >> shift) & 0x00030003) | magic
    return tl.inline_asm_elementwise(
        "sub.f16x2 $0, $1, $2;", "=r,r,r", [biased, magic], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _mma(a0, a2, b0, b1, c0, c1):
    """One `mma.m16n8k16` (fp16 in, fp32 accumulate) whose A rows 8..15 are zero: the lane's D entries
    of rows g (the two it keeps) from its A, B and C registers."""
    zero_a = tl.zeros_like(a0)
    zero_c = tl.zeros_like(c0)
    d0, d1, _, _ = tl.inline_asm_elementwise(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, zero_a, a2, zero_a, b0, b1, c0, c1, zero_c, zero_c],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1,
    )  # fmt: skip
    return d0, d1


@triton.jit
def _group_sum(x):
    """(32,) -> the sum over each lane's group of 4 lanes (lanes 4g .. 4g + 3), on every lane of it."""
    total = tl.sum(tl.reshape(x, (8, 4)), axis=1)
    return tl.reshape(tl.broadcast_to(total[:, None], (8, 4)), (32,))


@triton.jit
def _group_max(x):
    """(32,) -> the maximum over each lane's group of 4 lanes, on every lane of it."""
    best = tl.max(tl.reshape(x, (8, 4)), axis=1)
    return tl.reshape(tl.broadcast_to(best[:, None], (8, 4)), (32,))


@triton.jit
def _channel_pair(header, i, query_rows, head_live, P: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                  NATIVE_FP8: tl.constexpr):  # fmt: skip
    """Stored channels i and i + 1 (i (32,) even) of a block whose header starts at `header` (a pointer
    to 16-bit halves): the lane's head's |q| summed over both, q . minimum summed over both, and the two
    weights (q x step) as one fp16 pair (channel i low). Each header field of the two is one 16-bit load."""
    pairs = tl.load(header + (i % (P // 2)) // 2).to(tl.int32)
    lows = tl.load(header + (P // 2 + i) // 2).to(tl.int32)
    steps = tl.load(header + (P // 2 + P + i) // 2).to(tl.int32)
    half = (i // (P // 2)) * (D // 2)  # (i and i + 1 sit in the same half: P / 2 is even)
    q0 = tl.load(query_rows + (half + (pairs & 0xFF)) * BLOCK_G, mask=head_live, other=0.0)
    q1 = tl.load(query_rows + (half + ((pairs >> 8) & 0xFF)) * BLOCK_G, mask=head_live, other=0.0)
    low0, low1 = _fp8_value(lows & 0xFF, NATIVE_FP8), _fp8_value((lows >> 8) & 0xFF, NATIVE_FP8)
    step0, step1 = _fp8_value(steps & 0xFF, NATIVE_FP8), _fp8_value((steps >> 8) & 0xFF, NATIVE_FP8)
    return tl.abs(q0) + tl.abs(q1), q0 * low0 + q1 * low1, _half2(q1 * step1, q0 * step0)


@triton.jit
def _block_lse_mma_kernel(
    query_ptr,  # (B, Hkv, D, BLOCK_G) fp32 queries times the softmax scale, heads last (zero past G)
    abs_sum_ptr,  # (B, Hkv, G) fp32 each head's sum of |scaled q| over all D channels
    halves_ptr,  # the metadata pool as int16 (C, M, D / 2): two bytes a load
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
    HEADER: tl.constexpr,  # the header's first byte
    BLOCKS: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
):
    """Grid (B * Hkv, cdiv(N, BLOCKS)), one warp: blocks n-tile * BLOCKS ... in turn; writes
    out[b, h*G:(h+1)*G, n]."""
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    lane = tl.arange(0, 32)
    g = lane // 4  # A's and D's row (query head g), B's column (token g of a tile)
    t = lane % 4  # A's and B's channels 2t, 2t + 1 (+ 8), D's tokens 2t, 2t + 1
    head_live = g < G
    query_rows = query_ptr + row_head * D * BLOCK_G + g
    total_abs = tl.maximum(tl.load(abs_sum_ptr + row_head * G + g, mask=head_live, other=1.0), 1e-30)
    magic = tl.full([32], 0x64006400, tl.int32)  # 1024 in both fp16 halves
    code_row = g // 4  # token g of a tile sits in the tile's first or second code row,
    shift = 2 * (g % 4)  # at these bits of its channel's byte
    for index in range(BLOCKS):
        n = tl.program_id(1) * BLOCKS + index
        in_table = n < num_blocks
        block = tl.load(ids_ptr + b * stride_ib + h * stride_ih + n, mask=in_table, other=-1).to(tl.int64)
        valid = block >= 0
        codes = halves_ptr + tl.maximum(block, 0) * (stride_mc // 2)  # a missing block reads block 0, unused
        header = codes + HEADER // 2
        kept = tl.zeros([32], tl.float32)
        offset = tl.zeros([32], tl.float32)
        tile0_lo, tile0_hi = tl.zeros([32], tl.float32), tl.zeros([32], tl.float32)
        tile1_lo, tile1_hi = tl.zeros([32], tl.float32), tl.zeros([32], tl.float32)
        tile2_lo, tile2_hi = tl.zeros([32], tl.float32), tl.zeros([32], tl.float32)
        tile3_lo, tile3_hi = tl.zeros([32], tl.float32), tl.zeros([32], tl.float32)
        for step_index in tl.static_range(P // 16):
            first = step_index * 16 + 2 * t  # (32,) the lane's channels first, first + 1, first + 8, first + 9
            kept_a, offset_a, a0 = _channel_pair(header, first, query_rows, head_live, P, D, BLOCK_G, NATIVE_FP8)
            kept_b, offset_b, a2 = _channel_pair(header, first + 8, query_rows, head_live, P, D, BLOCK_G, NATIVE_FP8)
            kept += kept_a + kept_b
            offset += offset_a + offset_b
            pair_codes = codes + first // 2  # the pair's bytes in code row 0
            for tile in tl.static_range(4):
                row = (2 * tile + code_row) * P // 2  # halves to the token's code row
                b0 = _codes_half2(tl.load(pair_codes + row).to(tl.int32), shift, magic)
                b1 = _codes_half2(tl.load(pair_codes + row + 4).to(tl.int32), shift, magic)
                if tile == 0:
                    tile0_lo, tile0_hi = _mma(a0, a2, b0, b1, tile0_lo, tile0_hi)
                elif tile == 1:
                    tile1_lo, tile1_hi = _mma(a0, a2, b0, b1, tile1_lo, tile1_hi)
                elif tile == 2:
                    tile2_lo, tile2_hi = _mma(a0, a2, b0, b1, tile2_lo, tile2_hi)
                else:
                    tile3_lo, tile3_hi = _mma(a0, a2, b0, b1, tile3_lo, tile3_hi)
        correction = 1.0 / tl.sqrt(tl.maximum(_group_sum(kept) / total_abs, 1e-6))
        offset = _group_sum(offset)
        l0, l1 = (tile0_lo + offset) * correction, (tile0_hi + offset) * correction
        l2, l3 = (tile1_lo + offset) * correction, (tile1_hi + offset) * correction
        l4, l5 = (tile2_lo + offset) * correction, (tile2_hi + offset) * correction
        l6, l7 = (tile3_lo + offset) * correction, (tile3_hi + offset) * correction
        mine = tl.maximum(
            tl.maximum(tl.maximum(l0, l1), tl.maximum(l2, l3)), tl.maximum(tl.maximum(l4, l5), tl.maximum(l6, l7))
        )
        best = _group_max(mine)
        total = tl.exp(l0 - best) + tl.exp(l1 - best) + tl.exp(l2 - best) + tl.exp(l3 - best)
        total += tl.exp(l4 - best) + tl.exp(l5 - best) + tl.exp(l6 - best) + tl.exp(l7 - best)
        lse = tl.where(valid, best + tl.log(_group_sum(total)), float("-inf"))
        out = out_ptr + b * stride_ob + (h * G + g) * stride_oh + n
        tl.store(out, lse, mask=head_live & (t == 0) & in_table)


def block_logsumexp(
    query: torch.Tensor,
    metadata: torch.Tensor,
    block_ids: torch.Tensor,
    block_size: int,
    stored: int,
    scaling: float,
) -> torch.Tensor:
    """`triton_channels.block_logsumexp` on tensor cores, for the shapes `fits` takes (CUDA only: the
    interpreter runs no PTX). Same arguments and result: (B, Hq, N) fp32, -inf where the id is -1."""
    batch, num_kv_heads, num_blocks = block_ids.shape
    num_q_heads, dim = query.shape[1], query.shape[2]
    group = num_q_heads // num_kv_heads
    assert fits(block_size, stored, group) and metadata.element_size() == 1 and metadata.is_contiguous()
    out = torch.empty((batch, num_q_heads, num_blocks), dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    block_g = triton.next_power_of_2(group)
    by_channel, abs_sum = _query_by_channel(query, num_kv_heads, block_g, scaling)
    block_ids = block_ids if block_ids.stride(-1) == 1 else block_ids.contiguous()
    grid = (batch * num_kv_heads, triton.cdiv(num_blocks, BLOCKS))
    _block_lse_mma_kernel[grid](
        by_channel, abs_sum, metadata.view(torch.int16), block_ids, out,
        block_ids.stride(0), block_ids.stride(1), out.stride(0), out.stride(1), metadata.stride(0), num_blocks,
        num_kv_heads, D=dim, G=group, P=stored, BLOCK_G=block_g,
        HEADER=channels.header_start(block_size, stored, dim), BLOCKS=BLOCKS,
        NATIVE_FP8=native_fp8(query.device), num_warps=1,
    )  # fmt: skip
    return out
