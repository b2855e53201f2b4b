"""Channel scores on the GPU (`ops.channels` is the spec): each block's log-sum-exp of its tokens'
estimated logits, read straight from the channel metadata pool through the rows' tables.

One program takes BLOCK_N blocks of one (row, KV head), side by side, for all G query heads of the
group. A key is `code * step + low` per stored channel, so a token's logit is the sum over the
block's channels of `code * (q * step)` plus `q . low`, scaled by SparQ's correction (the share of
|q| the block's channels hold); a log-sum-exp over the S tokens follows. A step reads each block's
metadata once; no (B, Hkv, N, S, P) key copy is ever made. Everything computes in fp32, like the
spec; only the order of the sums over channels differs. Two forms (`FORM`, a launch knob):
- "loop" (the default): a loop over the P stored channels, each reading its
  pair index, minimum and step and gathering the query on that channel before adding its codes'
  share into a (BLOCK_N, G, S) accumulator.
- "vector": every load of a program is issued up front, as whole tiles: the blocks' headers (P pair
  indices, minima and steps), the group's query on those channels (one gather) and the code bytes,
  the stored channels leading every tile so that the sums over them stay inside a thread; the codes
  of each token of a byte then meet the step-weighted query in one product summed over the channels,
  and a running log-sum-exp joins the tokens. About half the loop form's instructions per block;
  swept beside it by `eval.bench.channel_kernel` (docs/performance.md has the timings).
The softmax over a row's blocks (`channels.block_mass`) is one PyTorch op on (B, Hq, N).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import channels

FORM = "loop"  # "loop" or "vector" (a launch knob, see above)
BLOCK_N = 1  # "vector": blocks per program (a launch knob)
NUM_WARPS = 1  # "vector": warps per program (a launch knob)
UNROLL = 2  # "loop": unroll factor of the loop over the stored channels (a launch knob)
WORDS = True  # "loop": the codes of 4 channels per 32-bit load where P allows (a launch knob)
LOOP_BLOCK_N, LOOP_NUM_WARPS = 4, 1  # the loop form's launch, measured fastest for it on the H200


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
    the group's query on that channel in a (BLOCK_N, BLOCK_G, S) accumulator; SparQ's correction
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
    code_rows = start[:, None, None] + ((t // PER_BYTE) * P)[None, None, :]  # (BLOCK_N, 1, S)
    code_shift = ((t % PER_BYTE) * BITS)[None, None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_G, S], tl.float32)
    kept = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    offset = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    for first in tl.range(0, P, CHUNK, loop_unroll_factor=UNROLL):
        if CHUNK == 4:  # byte c of the word: channel first + c
            packed = tl.load(words_ptr + (code_rows + first) // 4, mask=valid[:, None, None], other=0)
        else:
            packed = tl.load(codes_ptr + code_rows + first, mask=valid[:, None, None], other=0).to(tl.int32)
        for c in tl.static_range(CHUNK):
            i = first + c
            pair = tl.load(codes_ptr + start + HEADER + i % (P // 2), mask=valid, other=0).to(tl.int32)
            channel = pair + (i // (P // 2)) * (D // 2)  # (BLOCK_N,) the pair's second half from i = P / 2 on
            low = tl.load(bounds_ptr + start + HEADER + P // 2 + i, mask=valid, other=0.0).to(tl.float32)
            step = tl.load(bounds_ptr + start + HEADER + P // 2 + P + i, mask=valid, other=0.0).to(tl.float32)
            q = tl.load(query_rows[None, :] + channel[:, None], mask=valid[:, None] & has_g[None, :], other=0.0)
            kept += tl.abs(q)
            offset += q * low[:, None]
            codes = ((packed >> (code_shift + 8 * c)) & ((1 << BITS) - 1)).to(tl.float32)  # (BLOCK_N, 1, S)
            acc += codes * (q * tl.maximum(step, 1e-8)[:, None])[:, :, None]
    total_abs = tl.maximum(tl.load(abs_sum_ptr + row_head * G + g, mask=has_g, other=1.0), 1e-30)
    correction = 1.0 / tl.sqrt(tl.maximum(kept / total_abs[None, :], 1e-6))  # (BLOCK_N, BLOCK_G)
    logits = (acc + offset[:, :, None]) * correction[:, :, None]
    best = tl.max(logits, axis=2)
    lse = best + tl.log(tl.sum(tl.exp(logits - best[:, :, None]), axis=2))
    lse = tl.where(valid[:, None], lse, float("-inf"))
    out = out_ptr + b * stride_ob + (h * G + g)[None, :] * stride_oh + n[:, None]
    tl.store(out, lse, mask=in_table[:, None] & has_g[None, :])


@triton.jit
def _channel_part(
    query_ptr, codes_ptr, bounds_ptr, start, valid, query_rows, g_ok, j,
    D: tl.constexpr, P: tl.constexpr, S: tl.constexpr, FIRST: tl.constexpr, SIZE: tl.constexpr,
    HEADER: tl.constexpr, PER_BYTE: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """The sums over stored channels FIRST .. FIRST + SIZE - 1 (those below P) of BLOCK_N blocks at DRAM
    byte offsets `start` for the group's query rows: |q|, q * minimum, q * step (each (BLOCK_N, BLOCK_G))
    and, for each token k of a code byte, q * step * (1 + code / 2^BITS) ((BLOCK_N, BLOCK_G, BLOCK_J)
    each). Channels lead every tile, so that the sums over them stay inside a thread (the layouts
    spread the trailing dimensions over a warp's lanes): no shuffles in the inner products."""
    p = FIRST + tl.arange(0, SIZE)
    stored = (p < P)[:, None] & valid[None, :]  # (SIZE, BLOCK_N)
    header = start[None, :] + HEADER  # (1, BLOCK_N)
    pair = tl.load(codes_ptr + header + (p % (P // 2))[:, None], mask=stored, other=0).to(tl.int32)
    channel = pair + (p // (P // 2))[:, None] * (D // 2)  # (SIZE, BLOCK_N): from i = P / 2 on, the second half
    low = tl.load(bounds_ptr + header + P // 2 + p[:, None], mask=stored, other=0.0).to(tl.float32)
    step = tl.load(bounds_ptr + header + P // 2 + P + p[:, None], mask=stored, other=0.0).to(tl.float32)
    code_bytes = start[None, :, None] + (j * P)[None, None, :] + p[:, None, None]  # (SIZE, BLOCK_N, BLOCK_J)
    code_ok = stored[:, :, None] & (j < S // PER_BYTE)[None, None, :]
    packed = tl.load(codes_ptr + code_bytes, mask=code_ok, other=0).to(tl.int32)
    q_ok = stored[:, :, None] & g_ok[None, None, :]
    q = tl.load(query_ptr + query_rows[None, None, :] + channel[:, :, None], mask=q_ok, other=0.0)  # (SIZE, BN, BG)
    weighted = q * tl.maximum(step, 1e-8)[:, :, None]
    # A code c becomes the float 1 + c / 2^BITS by placing its bits at the top of 1.0's mantissa: integer
    # operations, no conversion instruction.
    top = 23 - BITS
    one = (((packed << top) & (((1 << BITS) - 1) << top)) | 0x3F800000).to(tl.float32, bitcast=True)
    two = (((packed << (top - BITS)) & (((1 << BITS) - 1) << top)) | 0x3F800000).to(tl.float32, bitcast=True)
    three = (((packed << (top - 2 * BITS)) & (((1 << BITS) - 1) << top)) | 0x3F800000).to(tl.float32, bitcast=True)
    four = (((packed << (top - 3 * BITS)) & (((1 << BITS) - 1) << top)) | 0x3F800000).to(tl.float32, bitcast=True)
    return (
        tl.sum(tl.abs(q), axis=0),
        tl.sum(q * low[:, :, None], axis=0),
        tl.sum(weighted, axis=0),
        tl.sum(one[:, :, None, :] * weighted[:, :, :, None], axis=0),
        tl.sum(two[:, :, None, :] * weighted[:, :, :, None], axis=0),
        tl.sum(three[:, :, None, :] * weighted[:, :, :, None], axis=0),
        tl.sum(four[:, :, None, :] * weighted[:, :, :, None], axis=0),
    )


@triton.jit
def _running_lse(best, total, dots, weight_sum, offset, correction, j, S: tl.constexpr, PER_BYTE: tl.constexpr,
                 BITS: tl.constexpr):  # fmt: skip
    """(best, total) of a running log-sum-exp over the logits of one token per code byte, from
    `dots` = sum(q * step * (1 + code / 2^BITS)): sum(code * q * step) = 2^BITS * (dots - weight_sum)."""
    logits = ((dots - weight_sum[:, :, None]) * (1 << BITS) + offset[:, :, None]) * correction[:, :, None]
    logits = tl.where((j < S // PER_BYTE)[None, None, :], logits, float("-inf"))
    newest = tl.maximum(best, tl.max(logits, axis=2))
    return newest, total * tl.exp(best - newest) + tl.sum(tl.exp(logits - newest[:, :, None]), axis=2)


@triton.jit
def _block_lse_vector_kernel(
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
    S: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HIGH: tl.constexpr,  # the largest power of two <= P: the first part's stored channels
    REST: tl.constexpr,  # P - HIGH rounded up to a power of two (0: none): the second part's
    BLOCK_J: tl.constexpr,  # >= S / PER_BYTE, the code bytes of one stored channel
    HEADER: tl.constexpr,  # the header's first byte
    PER_BYTE: tl.constexpr,
    BITS: tl.constexpr,
):
    """Grid (B * Hkv, cdiv(N, BLOCK_N)); writes out[b, h*G:(h+1)*G, n-tile] (the "vector" form). The
    stored channels come in two parts of power-of-two sizes (48 = 32 + 16), so no tile is padded
    where P is a sum of two powers of two. Tokens are taken PER_BYTE at a time, one per code byte."""
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_J)
    in_table = n < num_blocks
    block = tl.load(ids_ptr + b * stride_ib + h * stride_ih + n, mask=in_table, other=-1).to(tl.int64)
    valid = block >= 0
    start = block * stride_mc  # (BLOCK_N,)
    query_rows = (row_head * G + g) * D  # (BLOCK_G,)
    kept, offset, weight_sum, one, two, three, four = _channel_part(
        query_ptr, codes_ptr, bounds_ptr, start, valid, query_rows, g < G, j, D, P, S, 0, HIGH, HEADER, PER_BYTE, BITS
    )
    if REST > 0:
        rest = _channel_part(
            query_ptr, codes_ptr, bounds_ptr, start, valid, query_rows, g < G, j, D, P, S, HIGH, REST, HEADER,
            PER_BYTE, BITS,
        )  # fmt: skip
        kept, offset, weight_sum = kept + rest[0], offset + rest[1], weight_sum + rest[2]
        one, two, three, four = one + rest[3], two + rest[4], three + rest[5], four + rest[6]
    total_abs = tl.maximum(tl.load(abs_sum_ptr + row_head * G + g, mask=g < G, other=1.0), 1e-30)
    correction = 1.0 / tl.sqrt(tl.maximum(kept / total_abs[None, :], 1e-6))  # (BLOCK_N, BLOCK_G)
    best = tl.full([BLOCK_N, BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
    best, total = _running_lse(best, total, one, weight_sum, offset, correction, j, S, PER_BYTE, BITS)
    best, total = _running_lse(best, total, two, weight_sum, offset, correction, j, S, PER_BYTE, BITS)
    best, total = _running_lse(best, total, three, weight_sum, offset, correction, j, S, PER_BYTE, BITS)
    best, total = _running_lse(best, total, four, weight_sum, offset, correction, j, S, PER_BYTE, BITS)
    lse = tl.where(valid[:, None], best + tl.log(total), float("-inf"))
    out = out_ptr + b * stride_ob + (h * G + g)[None, :] * stride_oh + n[:, None]
    tl.store(out, lse, mask=in_table[:, None] & (g < G)[None, :])


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
    query_args = (scaled.contiguous(), scaled.abs().sum(-1).contiguous())
    strides = (block_ids.stride(0), block_ids.stride(1), out.stride(0), out.stride(1), metadata.stride(0))
    header = channels.header_start(block_size, stored, dim)
    if FORM == "vector":
        assert channels.PER_BYTE == 4, "the vector form takes the four tokens of a code byte one by one"
        high = 1 << (stored.bit_length() - 1)
        _block_lse_vector_kernel[(batch * num_kv_heads, triton.cdiv(num_blocks, BLOCK_N))](
            *query_args, metadata.view(torch.uint8), metadata, block_ids, out, *strides, num_blocks, num_kv_heads,
            D=dim, G=group, P=stored, S=block_size, BLOCK_G=triton.next_power_of_2(group), BLOCK_N=BLOCK_N,
            HIGH=high, REST=triton.next_power_of_2(stored - high) if stored > high else 0,
            BLOCK_J=triton.next_power_of_2(block_size // channels.PER_BYTE),
            HEADER=header, PER_BYTE=channels.PER_BYTE, BITS=channels.BITS, num_warps=NUM_WARPS,
        )  # fmt: skip
        return out
    if FORM != "loop":
        raise ValueError(f"unknown channel kernel form {FORM!r}; one of 'vector', 'loop'")
    words = WORDS and stored % 4 == 0 and dim % 4 == 0  # then every block's code rows start 4-aligned
    _block_lse_kernel[(batch * num_kv_heads, triton.cdiv(num_blocks, LOOP_BLOCK_N))](
        *query_args, metadata.view(torch.uint8), metadata.view(torch.int32 if words else torch.uint8), metadata,
        block_ids, out, *strides, num_blocks, num_kv_heads, D=dim, G=group, P=stored, S=block_size,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_N=LOOP_BLOCK_N, HEADER=header, PER_BYTE=channels.PER_BYTE,
        BITS=channels.BITS, CHUNK=4 if words else 1, UNROLL=UNROLL, num_warps=LOOP_NUM_WARPS,
    )  # fmt: skip
    return out


def score_channels(
    query: torch.Tensor, metadata: torch.Tensor, block_ids: torch.Tensor, block_size: int, stored: int, scaling: float
) -> torch.Tensor:
    """`channels.score_channels` with the per-block pass as one kernel (same arguments and result)."""
    return channels.block_mass(block_logsumexp(query, metadata, block_ids, block_size, stored, scaling))
