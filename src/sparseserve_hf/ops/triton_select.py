"""The default block selection as one Triton kernel: per-head top-k and the GQA union.

`reference.select_group_union` takes ~15 PyTorch kernels per layer (two top-k's, a sort, scatters,
fills), several of them radix selects over every (row, query head, block). Here one program per
(row, KV head) holds its G query heads' scores for the row's whole table in registers and:
1. maps each score to an order-preserving integer key (sink and window blocks above every score,
   blocks past the row's count below every real one; NaN ranks as the lowest finite float, as
   the reference ranks it);
2. finds each head's K-th largest key by a radix search, four key bits per step (one 16-bin
   histogram per head and step: at most 9 steps for float keys, 2 when the caller promises small
   integer scores, as the hybrid rank interleave's are; it stops once the digits so far separate
   the top K), then takes every key above it and the lowest-index ties up to K: the head's exact
   top-K set;
3. ORs the G sets and compacts the union in ascending block order into the (G*K)-wide output.
Ties between equal scores go to the lower block index (the reference's top-k breaks them in no
particular order); the union is otherwise the reference's, entry for entry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The selection's keys are int64, so sink and window blocks can take a key above every float's
# (always in the top-K). The rank interleave, with no forced blocks, searches `order_key`'s 32 bits
# as uint32: fewer registers there; here uint32 keys were the slower choice (docs/performance.md).
FORCED_KEY = tl.constexpr((1 << 32) + 1)
FLOAT_KEY_BITS = 33
EARLY_EXIT_BITS = tl.constexpr(16)  # longer searches stop once they part the top k (`top_k_rows`)
RADIX_BITS = tl.constexpr(4)  # key bits one step of the top-k search decides (a 16-bin histogram per row)
RADIX = tl.constexpr(16)  # 2^RADIX_BITS
ORDER_KEY_BITS = tl.constexpr(32)


@triton.jit
def order_key(x):
    """float32 -> uint32 with the same order, every key >= 0x007FFFFF (-inf's); NaN -> the key of
    the lowest finite float. Dead entries can then be keyed 0, below every score."""
    x = tl.where(x != x, -3.4028234663852886e38, x)
    raw = x.to(tl.uint32, bitcast=True)
    return tl.where(raw >= 0x80000000, raw ^ 0xFFFFFFFF, raw | 0x80000000)


@triton.jit
def _search_digit(key, live, threshold, above, shift, k, RADIX_BITS: tl.constexpr, RADIX: tl.constexpr):
    """One digit of `top_k_rows`' search, at bit `shift`: among the live keys that agree with
    `threshold` above the digit, a histogram of the digit gives count(key >= threshold | d << shift)
    for every d at once; each row takes its largest d counted by at least k keys (d = 0 always
    is: the search keeps count(key >= threshold) >= k). `above`: the live keys above the
    threshold's prefix so far. Returns the new threshold, `above` and count(key >= threshold)."""
    rows: tl.constexpr = key.shape[0]
    width: tl.constexpr = key.shape[1]
    high = ((key >> shift) >> RADIX_BITS) == ((threshold >> shift) >> RADIX_BITS)[:, None]  # two shifts: < width
    agree = live & high
    digit = ((key >> shift) & (RADIX - 1)).to(tl.int32)
    bins = digit + tl.arange(0, rows)[:, None] * RADIX  # row r's histogram in bins [r * RADIX, (r + 1) * RADIX)
    counts = tl.histogram(tl.reshape(bins, [rows * width]), rows * RADIX, mask=tl.reshape(agree, [rows * width]))
    counts = tl.reshape(counts, [rows, RADIX])
    d = tl.arange(0, RADIX)
    at_least = above[:, None] + tl.sum(counts, axis=1)[:, None] - tl.cumsum(counts, axis=1) + counts  # (R, radix)
    best = tl.max(tl.where(at_least >= k, d[None, :], 0), axis=1)  # (R,)
    picked = d[None, :] == best[:, None]
    reach = tl.sum(tl.where(picked, at_least, 0), axis=1)
    above = reach - tl.sum(tl.where(picked, counts, 0), axis=1)
    return threshold | (best.to(key.dtype) << shift), above, reach


@triton.jit
def top_k_rows(key, live, k, BITS: tl.constexpr):
    """(R, BN) bool: the `k` largest keys of each row of `key` (R, BN), ties to the lower index.

    Keys are int64 (live ones in [0, 2^BITS), dead ones -1) or uint32 (dead ones 0); dead
    entries are never taken; R is a power of two. A search for each row's largest t with
    count(key >= t) >= k, RADIX_BITS bits at a time from the top (one histogram per digit serves
    every row at once). A search of more than EARLY_EXIT_BITS bits stops as soon as every row's
    prefix so far is reached by exactly k keys (those keys are then the row's top k, whatever the
    lower bits hold): the k-th and (k+1)-th largest scores usually part long before the last
    digit. Rows that ran to the last digit take every key above t and the lowest-index live ties
    up to k.
    """
    live = tl.broadcast_to(live, key.shape)
    threshold = tl.zeros([key.shape[0]], dtype=key.dtype)
    above = tl.zeros([key.shape[0]], dtype=tl.int32)
    reach = tl.sum(live.to(tl.int32), axis=1)  # live keys >= the threshold so far
    top_shift: tl.constexpr = (BITS - 1) // RADIX_BITS * RADIX_BITS
    if BITS > EARLY_EXIT_BITS:
        shift = tl.zeros([], tl.int32) + top_shift
        while (shift >= 0) & (tl.max((reach > k).to(tl.int32), axis=0) > 0):
            threshold, above, reach = _search_digit(
                key, live, threshold, above, shift.to(key.dtype), k, RADIX_BITS, RADIX
            )  # fmt: skip
            shift -= RADIX_BITS
    else:  # a few digits: an unrolled search costs less than the test that would end it early
        for shift in tl.static_range(top_shift, -1, -RADIX_BITS):
            threshold, above, reach = _search_digit(key, live, threshold, above, shift, k, RADIX_BITS, RADIX)
    exact = (reach == k)[:, None]  # the keys >= threshold are the top k
    greater = key > threshold[:, None]
    ties = (key == threshold[:, None]) & live
    room = k - tl.sum(greater.to(tl.int32), axis=1)
    tied = greater | (ties & (tl.cumsum(ties.to(tl.int32), axis=1) <= room[:, None]))
    return tl.where(exact, key >= threshold[:, None], tied) & live


@triton.jit
def _select_union_kernel(
    scores_ptr,
    num_blocks_ptr,
    union_ptr,
    valid_ptr,
    stride_sb,
    stride_sh,
    num_table,
    num_kv_heads,
    score_floor,
    K: tl.constexpr,
    SINK: tl.constexpr,
    WINDOW: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    U: tl.constexpr,
    BLOCK_U: tl.constexpr,
    INTEGER_KEYS: tl.constexpr,
    BITS: tl.constexpr,
):
    """Grid (B * Hkv,): writes union[b, h, :U] (ascending, 0 past the count) and valid[b, h, :U].

    INTEGER_KEYS: scores are -inf or integers >= score_floor, keyed score - score_floor + 1 (0
    below the floor) in BITS bits, the forced key 2^BITS - 1 above them; else float keys.
    """
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    n = tl.arange(0, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    count = tl.load(num_blocks_ptr + b)
    exist = (n < count) & (n < num_table)
    forced = exist & ((n < SINK) | (n >= count - WINDOW))
    live = (g < G)[:, None] & exist[None, :]  # (BG, BN)
    x = tl.load(scores_ptr + b * stride_sb + (h * G + g)[:, None] * stride_sh + n[None, :], mask=live, other=0.0)
    if INTEGER_KEYS:
        small = tl.where(x >= score_floor, (x - score_floor).to(tl.int64) + 1, 0)
        key = tl.where(forced[None, :], (1 << BITS) - 1, small)
    else:
        key = tl.where(forced[None, :], FORCED_KEY, order_key(x).to(tl.int64))
    key = tl.where(live, key, -1)  # never above a threshold of 0: padding and missing blocks are out
    chosen = top_k_rows(key, live, K, BITS)
    union = tl.max(chosen.to(tl.int32), axis=0)  # (BN,)
    position = tl.cumsum(union, axis=0) - 1
    total = tl.sum(union, axis=0)
    out = row_head * U
    u = tl.arange(0, BLOCK_U)
    tl.store(valid_ptr + out + u, (u < total).to(tl.int8), mask=u < U)
    tl.store(union_ptr + out + u, tl.zeros([BLOCK_U], dtype=tl.int64), mask=(u >= total) & (u < U))
    tl.store(union_ptr + out + position, n.to(tl.int64), mask=(union > 0) & (position < U))


def select_group_union(
    scores: torch.Tensor,
    num_blocks: torch.Tensor,
    num_selected: int,
    sink_blocks: int,
    window_blocks: int,
    num_kv_heads: int,
    score_floor: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.select_group_union` in one launch (no host sync). scores (B, Hq, N) fp32.

    score_floor: the caller's promise that every score is -inf or an integer >= it (and < 0):
    the top-K search then runs over the few bits of that range instead of 33.
    """
    batch, num_q_heads, num_table = scores.shape
    group = num_q_heads // num_kv_heads
    width = group * num_selected
    union = torch.empty((batch, num_kv_heads, width), dtype=torch.long, device=scores.device)
    valid = torch.empty((batch, num_kv_heads, width), dtype=torch.bool, device=scores.device)
    if union.numel() == 0:
        return union, valid
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    block_n = triton.next_power_of_2(max(num_table, 16))
    integer_keys = score_floor is not None
    bits = (1 - score_floor + 1).bit_length() if integer_keys else FLOAT_KEY_BITS  # keys 0 .. 1 - floor, then forced
    _select_union_kernel[(batch * num_kv_heads,)](
        scores, num_blocks, union, valid.view(torch.int8),
        scores.stride(0), scores.stride(1), num_table, num_kv_heads, float(score_floor or 0),
        K=num_selected, SINK=sink_blocks, WINDOW=window_blocks, G=group,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_N=block_n, U=width,
        BLOCK_U=triton.next_power_of_2(width), INTEGER_KEYS=integer_keys, BITS=bits,
        num_warps=4 if block_n <= 1024 else 8,
    )  # fmt: skip
    return union, valid
