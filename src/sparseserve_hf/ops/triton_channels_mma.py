"""Channel scores on tensor cores: `triton_channels.block_logsumexp`'s estimate as `mma.m16n8k16` products.

A block's logits for the G query heads are a (G x P) by (P x S) product: the heads' query on each
stored channel times its step (fp16 weights), by the channels' 2-bit codes of the block's tokens.
`tl.dot` would take both operands in a register layout of its own and move them there through
shared memory, which cost what the tensor cores saved. Here a program is one warp and every tensor
has 32 elements, one per lane, so each lane builds exactly the registers PTX's fragment layout gives
it and hands them to the instruction (`tl.inline_asm_elementwise`). Lane = 4 x g + t; per step of 16
stored channels the lane holds four of them, 4t .. 4t + 3, as the fragment's k positions 2t, 2t + 8,
2t + 1, 2t + 9 (any order of k serves, as long as A and B agree): four adjacent bytes, so each field
of theirs is one 32-bit load.
- A (16 x 16): row g is query head g (rows G..15 zero): the head's query on each channel times its
  step, an fp16 pair product (`mul.rn.f16x2`) of the query converted in pairs and the steps converted
  from 8-bit floats two at a time;
- B (16 x 8): the same channels' codes of token g of an 8-token tile. A code word holds the four
  channels' bytes of 4 tokens; shifting it to the token's bits and masking two bytes leaves two codes
  at the bottom of each 16-bit half, which under 1024's exponent (an `or`) read 1024 + code, and one
  `sub.f16x2` makes them exact;
- D (16 x 8, fp32): row g, tokens 2t and 2t + 1 of the tile; four tiles cover a 32-token block.
The query times the minima and the query's magnitude on the stored channels (SparQ's correction) are
one more product per step, against a B of ones, in A's rows g and g + 8 (rows no head uses): the lane
reads its head's sums over every channel in its own D.
Weights in fp16 (the FMA kernel and the spec multiply in fp32): the estimates differ from the spec's
by about 1e-3 of a logit's size. Shapes it takes (`fits`): 2-bit codes of 32-token blocks, P a
multiple of 16, G <= 8, on a GPU that converts 8-bit floats (compute capability 8.9 or newer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import channels
from .triton_channels import LN2, LOG2E, native_fp8

BLOCKS = 16  # blocks one program (one warp) scores in turn (a launch knob)
MAX_REGISTERS = 64  # per thread (the launch's maxnreg): at 64 an SM holds 32 programs, at 65 only 28 (a launch knob)


def fits(block_size: int, stored: int, group: int, device: torch.device) -> bool:
    """Whether the tensor-core form takes this shape: 32-token blocks of 2-bit codes, P a multiple of
    16 (whole steps of the product), at most 8 query heads per KV head (the rows a lane group holds),
    on a GPU that converts 8-bit floats in hardware."""
    return (channels.BITS == 2 and block_size == 32 and stored % 16 == 0 and group <= 8
            and native_fp8(device))  # fmt: skip


@triton.jit
def _asm(instruction: tl.constexpr, constraints: tl.constexpr, args):
    """One PTX instruction on 32-bit registers, lane by lane: int32 result."""
    return tl.inline_asm_elementwise(instruction, constraints, args, dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _half2(high, low):
    """fp32 pairs -> int32 words holding two fp16 (`low` in the low half): an MMA operand register."""
    return tl.inline_asm_elementwise(
        "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [high, low], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _fp8_pair(words, first: tl.constexpr):
    """Bytes `first` and `first` + 2 of each int32 word, read as float8_e4m3fn, as an fp16 pair (byte
    `first` low): one byte permute, one conversion."""
    if first == 0:
        return _asm("{ .reg .b32 p; .reg .b16 t; prmt.b32 p, $1, 0, 0x4420; cvt.u16.u32 t, p; "
                    "cvt.rn.f16x2.e4m3x2 $0, t; }", "=r,r", [words])  # fmt: skip
    return _asm("{ .reg .b32 p; .reg .b16 t; prmt.b32 p, $1, 0, 0x4431; cvt.u16.u32 t, p; "
                "cvt.rn.f16x2.e4m3x2 $0, t; }", "=r,r", [words])  # fmt: skip


@triton.jit
def _channel_row(pairs, k: tl.constexpr, rows):
    """The address of the query entry of the channel in byte k of `pairs`: `rows` + 32 bytes (a channel's
    eight heads) per channel, as one byte permute and one wide multiply-add (the compiler's own form
    spends a shift and a mask where the permute suffices)."""
    if k == 0:
        instruction: tl.constexpr = "{ .reg .b32 c; prmt.b32 c, $1, 0, 0x4440; mad.wide.u32 $0, c, 32, $2; }"
    elif k == 1:
        instruction: tl.constexpr = "{ .reg .b32 c; prmt.b32 c, $1, 0, 0x4441; mad.wide.u32 $0, c, 32, $2; }"
    elif k == 2:
        instruction: tl.constexpr = "{ .reg .b32 c; prmt.b32 c, $1, 0, 0x4442; mad.wide.u32 $0, c, 32, $2; }"
    else:
        instruction: tl.constexpr = "{ .reg .b32 c; prmt.b32 c, $1, 0, 0x4443; mad.wide.u32 $0, c, 32, $2; }"
    address = tl.inline_asm_elementwise(instruction, "=l,r,l", [pairs, rows], dtype=tl.int64, is_pure=True, pack=1)
    return address.to(tl.pointer_type(tl.float32))


@triton.jit
def _codes_pair(words, shift, code_mask, magic):
    """The codes at bit `shift` of bytes 0 and 2 of each int32 word as an exact fp16 pair (byte 0 low):
    placed under 1024's exponent (1024 + code), then 1024 taken off both halves at once. `code_mask`
    (0x00030003) comes in a register, so that the mask and the exponent join in one instruction."""
    return _asm("sub.f16x2 $0, $1, $2;", "=r,r,r", [((words >> shift) & code_mask) | magic, magic])


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """One `mma.m16n8k16` (fp16 in, fp32 accumulate): the lane's four D entries (rows g and g + 8, its two
    columns) from its A, B and C registers. Accumulators are carried whole, rows 8..15 too, so that they
    keep their registers from one product to the next."""
    return tl.inline_asm_elementwise(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _log2(x):
    """log2 of positive fp32 values, the hardware's approximation (a sum of exponentials is at least 1 here)."""
    return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _group_max(x):
    """(32,) -> the maximum over each lane's group of 4 lanes (lanes 4g .. 4g + 3), on every lane of it."""
    best = tl.max(tl.reshape(x, (8, 4)), axis=1)
    return tl.reshape(tl.broadcast_to(best[:, None], (8, 4)), (32,))


@triton.jit
def _group_sum(x):
    """(32,) -> the sum over each lane's group of 4 lanes, on every lane of it."""
    total = tl.sum(tl.reshape(x, (8, 4)), axis=1)
    return tl.reshape(tl.broadcast_to(total[:, None], (8, 4)), (32,))


@triton.jit
def _block_lse_mma_kernel(
    query_ptr,  # (B, Hkv, D, 8) fp32 queries times the softmax scale, heads last (zero past G)
    abs_sum_ptr,  # (B, Hkv, G) fp32 each head's sum of |scaled q| over all D channels
    words_ptr,  # the metadata pool as int32 (C, M, D / 4)
    ids_ptr,  # (B, Hkv, N) int64, unit stride on N
    out_ptr,  # (B, Hq, N) fp32
    stride_ib,
    stride_ih,
    stride_ob,
    stride_oh,
    stride_mw,  # words per block
    code_mask,  # 0x00030003, as an argument: held in a register it lets the compiler join a code's "and" and "or"
    num_blocks,
    num_kv_heads,
    D: tl.constexpr,
    G: tl.constexpr,
    P: tl.constexpr,
    HEADER: tl.constexpr,  # the header's first byte (a multiple of D)
    BLOCKS: tl.constexpr,
):
    """Grid (B * Hkv, cdiv(N, BLOCKS)), one warp: blocks n-tile * BLOCKS ... in turn; writes
    out[b, h*G:(h+1)*G, n]."""
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    lane = tl.arange(0, 32)
    g = lane // 4  # A's and D's row (query head g), B's column (token g of a tile)
    t = lane % 4  # the lane's stored channels 4t .. 4t + 3 of each step; D's tokens 2t, 2t + 1 of each tile
    head_live = g < G
    query_rows = query_ptr + row_head * D * 8 + g  # every lane's head has a row: no mask
    inverse_abs = 1.0 / tl.maximum(tl.load(abs_sum_ptr + row_head * G + g, mask=head_live, other=1.0), 1e-30)
    magic = tl.full([32], 0x64006400, tl.int32)  # 1024 in both fp16 halves
    ones = tl.full([32], 0x3C003C00, tl.int32)  # 1.0 in both fp16 halves
    no_rows = tl.zeros([32], tl.int32)  # A's rows 8..15 in the tiles' products: no head there
    code_word = ((g // 4) * P) // 4 + t  # token g of a tile: its code row (first or second) and the lane's word
    shift = 2 * (g % 4)  # the token's bits in each channel's byte
    for index in range(BLOCKS):
        n = tl.program_id(1) * BLOCKS + index
        in_table = n < num_blocks
        block = tl.load(ids_ptr + b * stride_ib + h * stride_ih + n, mask=in_table, other=-1).to(tl.int64)
        valid = block >= 0
        words = words_ptr + tl.maximum(block, 0) * stride_mw  # a missing block reads block 0, unused
        header = words + HEADER // 4
        zero = tl.zeros([32], tl.float32)
        tile0_lo, tile0_hi, tile0_c2, tile0_c3 = zero, zero, zero, zero  # D of tokens 0..7: row g's two, rows 8+'s two
        tile1_lo, tile1_hi, tile1_c2, tile1_c3 = zero, zero, zero, zero
        tile2_lo, tile2_hi, tile2_c2, tile2_c3 = zero, zero, zero, zero
        tile3_lo, tile3_hi, tile3_c2, tile3_c3 = zero, zero, zero, zero
        offset, offset_hi, kept, kept_hi = zero, zero, zero, zero  # q . minima (row g), |q| (row g + 8)
        for step_index in tl.static_range(P // 16):
            first = step_index * 16 + 4 * t  # (32,) the lane's first channel of the step
            pairs = tl.load(header + (first % (P // 2)) // 4)  # byte k: channel first + k's pair index
            lows = tl.load(header + (P // 2 + first) // 4)
            steps = tl.load(header + (P // 2 + P + first) // 4)
            half = (first // (P // 2)) * (D // 2)  # the four sit in one half: P / 2 is a multiple of 4
            rows = (query_rows + half * 8).to(tl.int64)  # the lane's query entry of channel 0 of the half
            q0 = tl.load(_channel_row(pairs, 0, rows))
            q1 = tl.load(_channel_row(pairs, 1, rows))
            q2 = tl.load(_channel_row(pairs, 2, rows))
            q3 = tl.load(_channel_row(pairs, 3, rows))
            q02, q13 = _half2(q2, q0), _half2(q3, q1)  # k positions (2t, 2t + 1) and (2t + 8, 2t + 9)
            a0 = _asm("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [q02, _fp8_pair(steps, 0)])
            a2 = _asm("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [q13, _fp8_pair(steps, 1)])
            low0 = _asm("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [q02, _fp8_pair(lows, 0)])
            low2 = _asm("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [q13, _fp8_pair(lows, 1)])
            offset, offset_hi, kept, kept_hi = _mma(  # against ones: every column holds the sums over k
                low0, q02 & 0x7FFF7FFF, low2, q13 & 0x7FFF7FFF, ones, ones, offset, offset_hi, kept, kept_hi
            )
            step_codes = words + code_word + 4 * step_index  # the token's word of the step in code row 0 or 1
            for tile in tl.static_range(4):
                packed = tl.load(step_codes + tile * (2 * P // 4))  # two code rows down per tile
                b0 = _codes_pair(packed, shift, code_mask, magic)  # channels 4t and 4t + 2
                b1 = _codes_pair(packed, shift + 8, code_mask, magic)  # channels 4t + 1 and 4t + 3
                if tile == 0:
                    tile0_lo, tile0_hi, tile0_c2, tile0_c3 = _mma(
                        a0, no_rows, a2, no_rows, b0, b1, tile0_lo, tile0_hi, tile0_c2, tile0_c3
                    )
                elif tile == 1:
                    tile1_lo, tile1_hi, tile1_c2, tile1_c3 = _mma(
                        a0, no_rows, a2, no_rows, b0, b1, tile1_lo, tile1_hi, tile1_c2, tile1_c3
                    )
                elif tile == 2:
                    tile2_lo, tile2_hi, tile2_c2, tile2_c3 = _mma(
                        a0, no_rows, a2, no_rows, b0, b1, tile2_lo, tile2_hi, tile2_c2, tile2_c3
                    )
                else:
                    tile3_lo, tile3_hi, tile3_c2, tile3_c3 = _mma(
                        a0, no_rows, a2, no_rows, b0, b1, tile3_lo, tile3_hi, tile3_c2, tile3_c3
                    )
        # base-2 logits: SparQ's correction and log2(e) in one factor, positive and the same on all of the
        # lane's entries (they are its head's), so the maximum is taken over the raw products and each
        # exponential is one multiply-add and one exp2
        correction = LOG2E * tl.math.rsqrt(tl.maximum(kept * inverse_abs, 1e-6))
        mine = tl.maximum(
            tl.maximum(tl.maximum(tile0_lo, tile0_hi), tl.maximum(tile1_lo, tile1_hi)),
            tl.maximum(tl.maximum(tile2_lo, tile2_hi), tl.maximum(tile3_lo, tile3_hi)),
        )
        best = _group_max(mine)
        shift_by = -best * correction
        total = (tl.math.exp2(tile0_lo * correction + shift_by) + tl.math.exp2(tile0_hi * correction + shift_by)
                 + tl.math.exp2(tile1_lo * correction + shift_by) + tl.math.exp2(tile1_hi * correction + shift_by)
                 + tl.math.exp2(tile2_lo * correction + shift_by) + tl.math.exp2(tile2_hi * correction + shift_by)
                 + tl.math.exp2(tile3_lo * correction + shift_by) + tl.math.exp2(tile3_hi * correction + shift_by))  # fmt: skip
        lse2 = (best + offset) * correction + _log2(_group_sum(total))
        lse = tl.where(valid, lse2 * LN2, float("-inf"))
        out = out_ptr + b * stride_ob + (h * G + g) * stride_oh + n
        tl.store(out, lse, mask=head_live & (t == 0) & in_table)


def launch(
    by_channel: torch.Tensor,
    abs_sum: torch.Tensor,
    metadata: torch.Tensor,
    block_ids: torch.Tensor,
    out: torch.Tensor,
    block_size: int,
    stored: int,
) -> None:
    """Write `triton_channels.block_logsumexp`'s estimates into `out` (B, Hq, N) on tensor cores, from
    the query that `triton_channels._query_by_channel` prepared for eight heads (by_channel (B, Hkv, D, 8), abs_sum
    (B, Hkv, G)), for the shapes `fits` takes (CUDA only: the interpreter runs no PTX). metadata (C, M, D)
    contiguous, block_ids (B, Hkv, N) with unit stride on N."""
    batch, num_kv_heads, num_blocks = block_ids.shape
    dim, group = metadata.shape[-1], abs_sum.shape[-1]
    assert fits(block_size, stored, group, out.device) and by_channel.shape[-1] == 8
    assert metadata.is_contiguous() and metadata.stride(0) % 4 == 0
    grid = (batch * num_kv_heads, triton.cdiv(num_blocks, BLOCKS))
    _block_lse_mma_kernel[grid](
        by_channel, abs_sum, metadata.view(torch.int32), block_ids, out, block_ids.stride(0), block_ids.stride(1),
        out.stride(0), out.stride(1), metadata.stride(0) // 4, 0x00030003, num_blocks, num_kv_heads, D=dim, G=group,
        P=stored, HEADER=channels.header_start(block_size, stored, dim), BLOCKS=BLOCKS,
        num_warps=1, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
