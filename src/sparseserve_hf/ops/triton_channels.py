"""Channel scores on the GPU (`ops.channels` is the spec): each block's log-sum-exp of its tokens'
estimated logits, read straight from the channel metadata pool through the rows' tables.

One program takes BLOCK_N blocks of one (row, KV head), side by side, for all G query heads of the
group. A key is `code * step + low` per stored channel, so a token's logit is the sum over the
block's channels of `code * (q * step)` plus `q . low`: a loop over the P stored channels reads
each block's pair index, minimum and step, gathers the group's query on that channel and adds
its codes' share into a (G, tokens, BLOCK_N) accumulator; SparQ's correction (the share of |q| the
block's channels hold) scales each (block, head) at the end, and a log-sum-exp over the S tokens
follows. A code c enters as the float 1 + c / 2^BITS, made by placing its bits at the top of 1.0's
mantissa (integer operations, where a conversion instruction runs at a quarter of the rate), and the
sum of q * step over the channels is taken off at the end. A step reads each block's metadata once; no (B, Hkv, N, S, P) key copy is ever made.
Everything computes in fp32, like the spec; only the order of the sums over channels differs. The
8-bit minima and steps are converted in hardware where the GPU can (compute capability 8.9 or newer)
and from their bits elsewhere (`NATIVE_FP8`), so the kernel builds for an A100 too.
The query enters scaled and regrouped by channel (`_query_by_channel`, one small launch). Where the
shape fits (`triton_channels_mma.fits`: 32-token blocks of 2-bit codes, a GPU that converts 8-bit
floats) the products run on tensor cores instead, with fp16 weights (`MMA`); this kernel is the
form for every other shape and device, and the one exact to fp32's rounding.
`feedback_mass` then turns the estimates into what the scorer ranks (`channels.feedback_mass`) in one
launch, one program per (row, query head): the last step's exact numbers raised into its row in place
(only with feedback), then the head's softmax over its row's blocks.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import channels, reference

BLOCK_N = 16  # blocks per program (a launch knob)
NUM_WARPS = 1  # (a launch knob)
UNROLL = 1  # unroll factor of the loop over the stored channels (a launch knob)
WORDS = True  # the codes of 4 channels per 32-bit load where P allows (a launch knob)
PREFETCH = True  # with WORDS: load the next chunk's code and header words a pass ahead (a launch knob)
HOIST_Q = True  # with WORDS: gather the group's query on a chunk's 4 channels before its first one (a launch knob)
Q_AHEAD = False  # with PREFETCH, HOIST_Q: those gathers a pass ahead, from pair words two ahead (a launch knob)
MMA = True  # the products on tensor cores where the shape fits (`triton_channels_mma`; a launch knob)
NATIVE_FP8: bool | None = None  # convert 8-bit floats in hardware; None: where the device can (a launch knob)
LOG2E = tl.constexpr(1.4426950408889634)  # kernels read module constants only as constexprs
LN2 = tl.constexpr(0.6931471805599453)
STAGES = 0  # Triton's software pipelining of the loop over channels, 0 = its default (a launch knob)


@triton.jit
def _fp8_value(byte, NATIVE: tl.constexpr):
    """int32 bytes (0..255) read as float8_e4m3fn values, in fp32: converted in hardware where NATIVE,
    else from their bits (sign, 4 exponent bits of bias 7, 3 mantissa bits; the pool holds no NaN)."""
    if NATIVE:
        return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    normal = (((byte & 0x80) << 24) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # m x 2^-9
    return tl.where(exponent == 0, tl.where(byte >= 0x80, -subnormal, subnormal), normal)


@triton.jit
def _fp8_byte(words, c: tl.constexpr, NATIVE: tl.constexpr):
    """Byte c of each 32-bit word, read as a float8_e4m3fn value, in fp32."""
    return _fp8_value((words >> (8 * c)) & 0xFF, NATIVE)


@triton.jit
def _chunk_words(words_ptr, code_words, start_word, valid, first, HEADER: tl.constexpr, P: tl.constexpr):
    """The 32-bit words of the 4 stored channels from `first` on: (S / PER_BYTE, BLOCK_N) code words
    and (BLOCK_N,) words of their pair indices, minima and steps (byte c of each is channel first + c;
    P // 2 a multiple of 4 keeps each run of 4 in one word)."""
    packed = tl.load(words_ptr + code_words + first // 4, mask=valid[None, :], other=0)
    pairs = _pair_words(words_ptr, start_word, valid, first, HEADER, P)
    lows = tl.load(words_ptr + start_word + (HEADER + P // 2 + first) // 4, mask=valid, other=0)
    steps = tl.load(words_ptr + start_word + (HEADER + P // 2 + P + first) // 4, mask=valid, other=0)
    return packed, pairs, lows, steps


@triton.jit
def _pair_words(words_ptr, start_word, valid, first, HEADER: tl.constexpr, P: tl.constexpr):
    """(BLOCK_N,) the words of the pair indices of the 4 stored channels from `first` on."""
    return tl.load(words_ptr + start_word + (HEADER + first % (P // 2)) // 4, mask=valid, other=0)


@triton.jit
def _query_on(query_rows, pair, valid, i, P: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr):
    """(BLOCK_G, BLOCK_N) the group's query on stored channel i of each block, whose pair index is `pair`
    (BLOCK_N,) (the pair's second half from i = P / 2 on)."""
    channel = pair + (i // (P // 2)) * (D // 2)
    return tl.load(query_rows[:, None] + (channel * BLOCK_G)[None, :], mask=valid[None, :], other=0.0)


@triton.jit
def _chunk_query(query_rows, pairs, valid, first, P: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr):
    """The group's query on the 4 stored channels from `first` on, each (BLOCK_G, BLOCK_N), from their
    pair words `pairs` (BLOCK_N,) (byte c: channel first + c)."""
    q0 = _query_on(query_rows, pairs & 0xFF, valid, first, P, D, BLOCK_G)
    q1 = _query_on(query_rows, (pairs >> 8) & 0xFF, valid, first + 1, P, D, BLOCK_G)
    q2 = _query_on(query_rows, (pairs >> 16) & 0xFF, valid, first + 2, P, D, BLOCK_G)
    q3 = _query_on(query_rows, (pairs >> 24) & 0xFF, valid, first + 3, P, D, BLOCK_G)
    return q0, q1, q2, q3


@triton.jit
def _block_lse_kernel(
    query_ptr,  # (B, Hkv, D, BLOCK_G) fp32 queries times the softmax scale, heads last (zero past G), contiguous
    abs_sum_ptr,  # (B, Hkv, G) fp32 each head's sum of |scaled q| over all D channels
    codes_ptr,  # the pool's bytes, uint8 (C, M, D)
    words_ptr,  # the same pool as int32 (C, M, D / 4) where CHUNK is 4 (else its bytes again)
    ids_ptr,  # (B, Hkv, N) int64, unit stride on N
    out_ptr,  # (B, Hq, N) fp32
    stride_ib,
    stride_ih,
    stride_ob,
    stride_oh,
    stride_mc,
    stride_mw,
    code_mask,  # ((1 << BITS) - 1) << (23 - BITS) and 1.0's bits, as arguments: held in registers they let
    one_bits,  # the compiler join a code's "and" and "or" into one instruction (two immediates cannot)
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
    PREFETCH: tl.constexpr,  # (only with CHUNK 4) a chunk's words loaded during the pass before it
    HOIST_Q: tl.constexpr,  # (only with CHUNK 4) a chunk's 4 query gathers issued together at its start
    Q_AHEAD: tl.constexpr,  # (only with PREFETCH and HOIST_Q) those gathers issued during the pass before
    NATIVE_FP8: tl.constexpr,  # the minima and steps converted in hardware (compute capability >= 8.9)
    STAGES: tl.constexpr,
):
    """Grid (B * Hkv, cdiv(N, BLOCK_N)); writes out[b, h*G:(h+1)*G, n-tile]. Token t = PER_BYTE * j + k
    of a block sits in code row j at bits BITS * k, so the accumulator is (BLOCK_G, PER_BYTE, S /
    PER_BYTE, BLOCK_N): a loop over the P stored channels, each code load holding CHUNK channels of
    PER_BYTE tokens; per channel each block's codes times its step meet the group's query on that
    channel; SparQ's correction scales each (head, block) at the end."""
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, S // PER_BYTE)
    k = tl.arange(0, PER_BYTE)
    in_table = n < num_blocks
    block = tl.load(ids_ptr + b * stride_ib + h * stride_ih + n, mask=in_table, other=-1).to(tl.int64)
    valid = block >= 0
    start = block * stride_mc  # (BLOCK_N,)
    has_g = g < G
    query_rows = query_ptr + row_head * D * BLOCK_G + g  # (BLOCK_G,): channel c of head g at c * BLOCK_G + g
    # The heads come first and a code's tokens next, so that each thread holds every head and every
    # token of its code loads: a code is decoded once and meets the G heads in registers (with the
    # heads spread over lanes, each lane would decode the same codes again).
    if CHUNK == 4:  # addressed in 32-bit words (stride_mw = stride_mc / 4)
        start_word = block * stride_mw  # (BLOCK_N,)
        code_words = start_word[None, :] + (j * (P // 4))[:, None]  # (S / PER_BYTE, BLOCK_N) each row's first word
    else:
        code_rows = start[None, :] + (j * P)[:, None]  # (S / PER_BYTE, BLOCK_N) byte of each row's first channel
    shift = (k * BITS)[:, None, None]  # (PER_BYTE, 1, 1)
    top = 23 - BITS  # a code c placed at the top of 1.0's mantissa is the float 1 + c / 2^BITS
    acc = tl.zeros([BLOCK_G, PER_BYTE, S // PER_BYTE, BLOCK_N], tl.float32)  # sum of q * step * (1 + code / 2^BITS)
    weight_sum = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)  # sum over channels of q * step
    kept = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    offset = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    if PREFETCH:
        next_packed, next_pairs, next_lows, next_steps = _chunk_words(
            words_ptr, code_words, start_word, valid, 0, HEADER, P
        )
        if Q_AHEAD:  # the first chunk's gathers, and the second chunk's pair words
            next_q0, next_q1, next_q2, next_q3 = _chunk_query(query_rows, next_pairs, valid, 0, P, D, BLOCK_G)
            later_pairs = _pair_words(words_ptr, start_word, valid, CHUNK % P, HEADER, P)
    for first in tl.range(0, P, CHUNK, loop_unroll_factor=UNROLL, num_stages=STAGES if STAGES > 0 else None):
        if PREFETCH:  # this chunk's words came a pass ago; the next chunk's (the first again at the end) go out
            packed, pairs, lows, steps = next_packed, next_pairs, next_lows, next_steps
            next_packed, next_pairs, next_lows, next_steps = _chunk_words(
                words_ptr, code_words, start_word, valid, (first + CHUNK) % P, HEADER, P
            )
        elif CHUNK == 4:  # byte c of each word: channel first + c
            packed, pairs, lows, steps = _chunk_words(words_ptr, code_words, start_word, valid, first, HEADER, P)
        else:
            packed = tl.load(codes_ptr + code_rows + first, mask=valid[None, :], other=0).to(tl.int32)
        if Q_AHEAD:  # this chunk's gathers came a pass ago; the next chunk's go out from its pair words,
            # loaded a pass ago too, and the pair words of the chunk after it are loaded
            q0, q1, q2, q3 = next_q0, next_q1, next_q2, next_q3
            ahead = (first + CHUNK) % P
            next_q0, next_q1, next_q2, next_q3 = _chunk_query(query_rows, later_pairs, valid, ahead, P, D, BLOCK_G)
            later_pairs = _pair_words(words_ptr, start_word, valid, (first + 2 * CHUNK) % P, HEADER, P)
        elif HOIST_Q:
            q0, q1, q2, q3 = _chunk_query(query_rows, pairs, valid, first, P, D, BLOCK_G)
        for c in tl.static_range(CHUNK):
            i = first + c
            if CHUNK == 4:
                pair = (pairs >> (8 * c)) & 0xFF
                low = _fp8_byte(lows, c, NATIVE_FP8)
                step = _fp8_byte(steps, c, NATIVE_FP8)
            else:
                pair = tl.load(codes_ptr + start + HEADER + i % (P // 2), mask=valid, other=0).to(tl.int32)
                low_byte = tl.load(codes_ptr + start + HEADER + P // 2 + i, mask=valid, other=0).to(tl.int32)
                step_byte = tl.load(codes_ptr + start + HEADER + P // 2 + P + i, mask=valid, other=0).to(tl.int32)
                low = _fp8_value(low_byte, NATIVE_FP8)
                step = _fp8_value(step_byte, NATIVE_FP8)
            if HOIST_Q:
                if c == 0:
                    q = q0
                elif c == 1:
                    q = q1
                elif c == 2:
                    q = q2
                else:
                    q = q3
            else:
                q = _query_on(query_rows, pair, valid, i, P, D, BLOCK_G)
            kept += tl.abs(q)
            offset += q * low[None, :]
            weighted = q * tl.maximum(step, 1e-8)[None, :]  # (BLOCK_G, BLOCK_N)
            weight_sum += weighted
            shifted = (packed[None, :, :] >> (shift + 8 * c)) << top  # (PER_BYTE, S / PER_BYTE, BLOCK_N)
            codes = ((shifted & code_mask) | one_bits).to(tl.float32, bitcast=True)
            acc += codes[None, :, :, :] * weighted[:, None, None, :]
    total_abs = tl.maximum(tl.load(abs_sum_ptr + row_head * G + g, mask=has_g, other=1.0), 1e-30)
    # base-2 logits (log2(e) joins the correction), so each exponential is one exp2
    correction = LOG2E / tl.sqrt(tl.maximum(kept / total_abs[:, None], 1e-6))  # (BLOCK_G, BLOCK_N)
    dots = (acc - weight_sum[:, None, None, :]) * (1 << BITS)  # sum over channels of q * step * code
    logits = (dots + offset[:, None, None, :]) * correction[:, None, None, :]
    best = tl.max(tl.max(logits, axis=2), axis=1)  # (BLOCK_G, BLOCK_N)
    total = tl.sum(tl.sum(tl.math.exp2(logits - best[:, None, None, :]), axis=2), axis=1)
    lse = tl.where(valid[None, :], (best + tl.math.log2(total)) * LN2, float("-inf"))
    out = out_ptr + b * stride_ob + (h * G + g)[:, None] * stride_oh + n[None, :]
    tl.store(out, lse, mask=has_g[:, None] & in_table[None, :])


@functools.cache  # asked per layer and step: the answer never changes for a device
def native_fp8(device: torch.device) -> bool:
    """Whether `device` converts 8-bit floats in hardware (CUDA compute capability 8.9 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= reference.FP8_CAPABILITY


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
    block_ids = block_ids if block_ids.stride(-1) == 1 else block_ids.contiguous()
    if _tensor_cores_take(query, metadata, block_size, stored, group):
        from . import triton_channels_mma

        # the tensor-core form reads eight heads' rows, zeros past G (a lane per head of the fragment)
        by_channel, abs_sum = _query_by_channel(query, num_kv_heads, 8, scaling)
        triton_channels_mma.launch(by_channel, abs_sum, metadata, block_ids, out, block_size, stored)
        return out
    block_g = triton.next_power_of_2(group)
    by_channel, abs_sum = _query_by_channel(query, num_kv_heads, block_g, scaling)
    grid = (batch * num_kv_heads, triton.cdiv(num_blocks, BLOCK_N))
    words = WORDS and stored % 8 == 0 and dim % 4 == 0  # then code rows and header runs start 4-aligned
    _block_lse_kernel[grid](
        by_channel, abs_sum, metadata.view(torch.uint8),
        metadata.view(torch.int32 if words else torch.uint8), block_ids, out,
        block_ids.stride(0), block_ids.stride(1), out.stride(0), out.stride(1), metadata.stride(0),
        metadata.stride(0) // 4, ((1 << channels.BITS) - 1) << (23 - channels.BITS), 0x3F800000, num_blocks,
        num_kv_heads, D=dim, G=group, P=stored, S=block_size, BLOCK_G=block_g,
        BLOCK_N=BLOCK_N, HEADER=channels.header_start(block_size, stored, dim), PER_BYTE=channels.PER_BYTE,
        BITS=channels.BITS, CHUNK=4 if words else 1, UNROLL=UNROLL, PREFETCH=PREFETCH and words,
        HOIST_Q=HOIST_Q and words, Q_AHEAD=Q_AHEAD and PREFETCH and HOIST_Q and words,
        NATIVE_FP8=native_fp8(query.device) if NATIVE_FP8 is None else NATIVE_FP8,
        STAGES=STAGES,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def _tensor_cores_take(query: torch.Tensor, metadata: torch.Tensor, block_size: int, stored: int, group: int) -> bool:
    """Whether `block_logsumexp` runs the tensor-core form (`MMA`, on CUDA, a shape it fits)."""
    if not (MMA and query.is_cuda and metadata.is_contiguous()):
        return False
    from . import triton_channels_mma  # it imports this module's helpers: only here

    return triton_channels_mma.fits(block_size, stored, group, query.device)


@triton.jit
def _by_channel_kernel(
    query_ptr, by_channel_ptr, abs_sum_ptr, stride_qb, stride_qh, stride_qd, scaling, num_kv_heads,
    D: tl.constexpr, G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Grid (B * Hkv,): the group's queries times `scaling` in fp32, a channel's heads side by side
    (zeros past G), and each head's sum of their magnitudes over the D channels."""
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    in_dim = d < D
    heads = query_ptr + b * stride_qb + (h * G + g)[None, :] * stride_qh + d[:, None] * stride_qd  # (BLOCK_D, BLOCK_G)
    scaled = tl.load(heads, mask=in_dim[:, None] & (g < G)[None, :], other=0.0).to(tl.float32) * scaling
    tl.store(by_channel_ptr + row_head * D * BLOCK_G + d[:, None] * BLOCK_G + g[None, :], scaled, mask=in_dim[:, None])
    tl.store(abs_sum_ptr + row_head * G + g, tl.sum(tl.abs(scaled), axis=0), mask=g < G)


def _query_by_channel(
    query: torch.Tensor, num_kv_heads: int, block_g: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Hq, D) queries -> (B, Hkv, D, BLOCK_G) fp32 scaled queries, heads last (zeros past G), and
    (B, Hkv, G) each head's sum of magnitudes, in one launch (a decode step's query is a few KiB:
    the five torch kernels that would make them cost more than the work)."""
    batch, num_q_heads, dim = query.shape
    group = num_q_heads // num_kv_heads
    by_channel = torch.empty((batch, num_kv_heads, dim, block_g), dtype=torch.float32, device=query.device)
    abs_sum = torch.empty((batch, num_kv_heads, group), dtype=torch.float32, device=query.device)
    _by_channel_kernel[(batch * num_kv_heads,)](
        query, by_channel, abs_sum, query.stride(0), query.stride(1), query.stride(2), scaling, num_kv_heads,
        D=dim, G=group, BLOCK_D=triton.next_power_of_2(dim), BLOCK_G=block_g, num_warps=1,
    )  # fmt: skip
    return by_channel, abs_sum


MASS_BLOCK = 1024  # table entries per pass of the softmax over a row's blocks


@triton.jit
def _mass_kernel(
    lse_ptr,  # (B * Hq, N) fp32 estimates, contiguous (raised in place where FEEDBACK)
    out_ptr,  # (B * Hq, N) fp32 masses
    picked_ptr,  # (B, Hkv, U) int64 table positions the last step loaded (where FEEDBACK)
    exact_ptr,  # (B, Hq, U) fp32 exact log-sum-exps over them, -inf where a head attended none (where FEEDBACK)
    stride_pb,
    stride_ph,
    stride_eb,
    stride_eh,
    num_q_heads,
    num_blocks,
    num_picked,
    G: tl.constexpr,
    FEEDBACK: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_U: tl.constexpr,
):
    """Grid (B * Hq,), one program per (row, query head). With FEEDBACK, each picked position's
    estimate first becomes the larger of it and the exact number where the estimate is not -inf
    (outside the row's table); positions may repeat, so by atomic max. Then out = softmax of the
    row, -inf where it is -inf (every entry of a row that has none finite)."""
    row_head = tl.program_id(0)
    row = row_head.to(tl.int64) * num_blocks
    if FEEDBACK:
        b = row_head // num_q_heads
        head = row_head % num_q_heads
        for first in range(0, num_picked, BLOCK_U):
            u = first + tl.arange(0, BLOCK_U)
            in_pick = u < num_picked
            position = tl.load(picked_ptr + b * stride_pb + (head // G) * stride_ph + u, mask=in_pick, other=0)
            position = tl.minimum(tl.maximum(position, 0), num_blocks - 1)
            exact = tl.load(exact_ptr + b * stride_eb + head * stride_eh + u, mask=in_pick, other=float("-inf"))
            estimate = tl.load(lse_ptr + row + position, mask=in_pick, other=float("-inf"))
            raise_ = in_pick & (estimate > float("-inf")) & (exact > estimate)
            tl.atomic_max(lse_ptr + row + position, exact, mask=raise_)
        tl.debug_barrier()  # the raised row is read below by every thread of the program (volatile: not from L1)
    best = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    for first in range(0, num_blocks, BLOCK):  # the running maximum and the sum of exps under it
        n = first + tl.arange(0, BLOCK)
        x = tl.load(lse_ptr + row + n, mask=n < num_blocks, other=float("-inf"), volatile=FEEDBACK)
        new_best = tl.maximum(best, tl.max(x, axis=0))
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)  # exp(-inf - shift) is 0, never NaN
        total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), axis=0)
        best = new_best
    shift = tl.where(best == float("-inf"), 0.0, best)
    total = tl.maximum(total, 1.0)  # the largest entry adds exp(0) = 1; a row of none adds 0 and writes -inf
    for first in range(0, num_blocks, BLOCK):
        n = first + tl.arange(0, BLOCK)
        x = tl.load(lse_ptr + row + n, mask=n < num_blocks, other=float("-inf"), volatile=FEEDBACK)
        mass = tl.where(x == float("-inf"), float("-inf"), tl.exp(x - shift) / total)
        tl.store(out_ptr + row + n, mass, mask=n < num_blocks)


def feedback_mass(logsumexp: torch.Tensor, fed_back: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`channels.feedback_mass` in one launch: (B, Hq, N) fp32 estimates (raised in place where fed
    back) -> (B, Hq, N) masses. fed_back: (B, Hkv, U) picked table positions and (B, Hq, U) exact
    log-sum-exps, or None."""
    batch, num_q_heads, num_blocks = logsumexp.shape
    assert logsumexp.dtype == torch.float32 and logsumexp.is_contiguous()
    out = torch.empty_like(logsumexp)
    if out.numel() == 0:
        return out
    feedback = fed_back is not None and fed_back[0].shape[-1] > 0
    picked, exact = fed_back if feedback else (logsumexp, logsumexp)  # unread without feedback
    picked = picked if picked.stride(-1) == 1 else picked.contiguous()
    exact = exact if exact.stride(-1) == 1 else exact.contiguous()
    width = picked.shape[-1] if feedback else 1
    _mass_kernel[(batch * num_q_heads,)](
        logsumexp, out, picked, exact, picked.stride(0), picked.stride(1), exact.stride(0), exact.stride(1),
        num_q_heads, num_blocks, width, G=num_q_heads // picked.shape[1] if feedback else 1, FEEDBACK=feedback,
        BLOCK=min(triton.next_power_of_2(num_blocks), MASS_BLOCK), BLOCK_U=min(triton.next_power_of_2(width), 1024),
        num_warps=4,
    )  # fmt: skip
    return out
