"""The default block selection as one Triton kernel: per-head top-k and the GQA union.

`reference.select_group_union` takes ~15 PyTorch kernels per layer (two top-k's, a sort, scatters,
fills), several of them radix selects over every (row, query head, block). Here one program per
(row, KV head) holds its G query heads' scores for the row's whole table in registers and:
1. maps each score to an order-preserving integer key (sink and window blocks above every score,
   blocks past the row's count below every real one; NaN ranks as the lowest finite float, as
   the reference ranks it);
2. finds each head's K-th largest key by a bitwise binary search (one count reduction per key
   bit, at most 33 for float keys, ~8 when the caller promises small integer scores, as the
   hybrid rank interleave's are; it stops once the bits so far separate the top K), then takes
   every key above it and the lowest-index ties up to K: the head's exact top-K set;
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
ORDER_KEY_BITS = tl.constexpr(32)
UNION_WARPS: int | None = None  # the union kernel's warps (a launch knob); None: by the table's width


@triton.jit
def order_key(x):
    """float32 -> uint32 with the same order, every key >= 0x007FFFFF (-inf's); NaN -> the key of
    the lowest finite float. Dead entries can then be keyed 0, below every score."""
    x = tl.where(x != x, -3.4028234663852886e38, x)  # noqa: PLR0124 (true only for NaN)
    raw = x.to(tl.uint32, bitcast=True)
    return tl.where(raw >= 0x80000000, raw ^ 0xFFFFFFFF, raw | 0x80000000)


@triton.jit
def _search_step(key, threshold, reach, candidate, k):
    """One bit of `top_k_rows`' search: each row takes `candidate` (>= 1, so dead keys never reach
    it) as its threshold where at least k keys reach it; `reach` follows (keys >= the threshold)."""
    count = tl.sum((key >= candidate[:, None]).to(tl.int32), axis=1)
    take = count >= k
    return tl.where(take, candidate, threshold), tl.where(take, count, reach)


@triton.jit
def top_k_rows(key, live, k, BITS: tl.constexpr):
    """(R, BN) bool: the `k` largest keys of each row of `key` (R, BN), ties to the lower index.

    Keys are int64 (live ones in [0, 2^BITS), dead ones -1) or uint32 (dead ones 0); dead
    entries are never taken. A bitwise search for each row's largest t with count(key >= t) >= k,
    from the top bit down: one count reduction per key bit serves every row at once. A search of
    more than EARLY_EXIT_BITS bits stops as soon as every row's prefix so far is reached by
    exactly k keys (those keys are then the row's top k, whatever the lower bits hold): the k-th
    and (k+1)-th largest scores usually part long before the last bit. Rows that ran to the last
    bit take every key above t and the lowest-index live ties up to k.
    """
    threshold = tl.zeros([key.shape[0]], dtype=key.dtype)
    one = tl.full([key.shape[0]], 1, dtype=key.dtype)
    reach = tl.sum(tl.broadcast_to(live, key.shape).to(tl.int32), axis=1)  # live keys >= the threshold so far
    if BITS > EARLY_EXIT_BITS:
        bit = tl.zeros([], tl.int32) + (BITS - 1)
        while (bit >= 0) & (tl.max((reach > k).to(tl.int32), axis=0) > 0):
            threshold, reach = _search_step(key, threshold, reach, threshold | (one << bit.to(key.dtype)), k)
            bit -= 1
    else:  # a few bits: an unrolled search costs less than the test that would end it early
        for bit in tl.static_range(BITS - 1, -1, -1):
            threshold, reach = _search_step(key, threshold, reach, threshold | (one << bit), k)
    exact = (reach == k)[:, None]  # the keys >= threshold are the top k
    above = key > threshold[:, None]
    ties = (key == threshold[:, None]) & live
    room = k - tl.sum(above.to(tl.int32), axis=1)
    tied = above | (ties & (tl.cumsum(ties.to(tl.int32), axis=1) <= room[:, None]))
    return tl.where(exact, key >= threshold[:, None], tied) & live


def cap_search_steps(num_selected: int, group: int, width: int) -> int:
    """Steps of the binary search for a capped union's k (`group_top_k`): k lies in
    [width // G, K - 1] once K's union is too large; 0 where the union is not capped."""
    if width >= group * num_selected:
        return 0
    return (num_selected - 1 - width // group).bit_length()


@triton.jit
def group_top_k(
    key, live, K: tl.constexpr, G: tl.constexpr, LOAD: tl.constexpr, STEPS: tl.constexpr, BITS: tl.constexpr
):
    """(BG, W) bool: each query head's top K (`top_k_rows`) of the same W blocks, or, where their
    union would hold more than LOAD blocks (LOAD < G*K), each head's top k for the largest k whose
    union fits: a binary search of STEPS (`cap_search_steps`) from LOAD // G (whose union always
    fits) to K - 1 (`reference.capped_group_union`). A fixed step count, not a loop on the
    bounds: Triton's compiler failed on that loop where both bounds are constants."""
    chosen = top_k_rows(key, live, K, BITS)
    if LOAD < G * K:  # noqa: SIM102  a compile-time test: uncapped kernels hold no search at all
        if tl.sum(tl.max(chosen.to(tl.int32), axis=0), axis=0) > LOAD:
            low = tl.zeros([], tl.int32) + LOAD // G
            high = tl.zeros([], tl.int32) + (K - 1)
            for _ in tl.static_range(STEPS):  # a step once low == high changes nothing
                middle = (low + high + 1) // 2
                size = tl.sum(tl.max(top_k_rows(key, live, middle, BITS).to(tl.int32), axis=0), axis=0)
                low = tl.where(size <= LOAD, middle, low)
                high = tl.where(size <= LOAD, high, middle - 1)
            chosen = top_k_rows(key, live, low, BITS)
    return chosen


@triton.jit
def selection_keys(
    x,
    n,
    count,
    live,
    score_floor,
    SINK: tl.constexpr,
    WINDOW: tl.constexpr,
    INTEGER_KEYS: tl.constexpr,
    BITS: tl.constexpr,
):
    """int64 keys of scores x (R, W) at block indices n (1 or R, W) of a row with `count` blocks:
    sink and window blocks above every score, -1 where not `live` (see `_select_union_kernel`)."""
    forced = (n < SINK) | (n >= count - WINDOW)
    if INTEGER_KEYS:
        small = tl.where(x >= score_floor, (x - score_floor).to(tl.int64) + 1, 0)
        key = tl.where(forced, (1 << BITS) - 1, small)
    else:
        key = tl.where(forced, FORCED_KEY, order_key(x).to(tl.int64))
    return tl.where(live, key, -1)  # never above a threshold of 0: padding and missing blocks are out


@triton.jit
def write_union(union_ptr, valid_ptr, row_head, member, n, U: tl.constexpr, BLOCK_U: tl.constexpr):
    """Compact the blocks n (W,) whose `member` (W,) int32 is 1, ascending, into union[row_head, :U]
    (0 past their count) and valid[row_head, :U]."""
    position = tl.cumsum(member, axis=0) - 1
    total = tl.sum(member, axis=0)
    out = row_head * U
    u = tl.arange(0, BLOCK_U)
    tl.store(valid_ptr + out + u, (u < total).to(tl.int8), mask=u < U)
    tl.store(union_ptr + out + u, tl.zeros([BLOCK_U], dtype=tl.int64), mask=(u >= total) & (u < U))
    tl.store(union_ptr + out + position, n.to(tl.int64), mask=(member > 0) & (position < U))


@triton.jit
def group_scores(scores_ptr, num_blocks_ptr, b, h, g, n, num_table, stride_sb, stride_sh, G: tl.constexpr):
    """KV head h's query heads' scores (BG, W) at blocks n (W,) of row b, with the row's block count
    and which entries are live (a query head of the group, a block of the table below the count);
    0 where not live. The scores' load does not wait for the count's: the count masks them after."""
    in_table = (g < G)[:, None] & (n < num_table)[None, :]
    x = tl.load(scores_ptr + b * stride_sb + (h * G + g)[:, None] * stride_sh + n[None, :], mask=in_table, other=0.0)
    count = tl.load(num_blocks_ptr + b)
    live = in_table & (n < count)[None, :]
    return tl.where(live, x, 0.0), count, live


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
    STEPS: tl.constexpr,
    INTEGER_KEYS: tl.constexpr,
    BITS: tl.constexpr,
):
    """Grid (B * Hkv,): writes union[b, h, :U] (ascending, 0 past the count) and valid[b, h, :U];
    U < G*K caps the union (`group_top_k`).

    INTEGER_KEYS: scores are -inf or integers >= score_floor, keyed score - score_floor + 1 (0
    below the floor) in BITS bits, the forced key 2^BITS - 1 above them; else float keys.
    """
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    n = tl.arange(0, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    x, count, live = group_scores(scores_ptr, num_blocks_ptr, b, h, g, n, num_table, stride_sb, stride_sh, G)
    key = selection_keys(x, n[None, :], count, live, score_floor, SINK, WINDOW, INTEGER_KEYS, BITS)
    chosen = group_top_k(key, live, K, G, U, STEPS, BITS)
    write_union(union_ptr, valid_ptr, row_head, tl.max(chosen.to(tl.int32), axis=0), n, U, BLOCK_U)


def select_group_union(
    scores: torch.Tensor,
    num_blocks: torch.Tensor,
    num_selected: int,
    sink_blocks: int,
    window_blocks: int,
    num_kv_heads: int,
    score_floor: int | None = None,
    max_loaded: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.select_group_union` in one launch (no host sync). scores (B, Hq, N) fp32.

    score_floor: the caller's promise that every score is -inf or an integer >= it (and < 0):
    the top-K search then runs over the few bits of that range instead of 33.
    max_loaded: the cap on a KV head's union (None: G*K).
    """
    batch, num_q_heads, num_table = scores.shape
    group = num_q_heads // num_kv_heads
    union, valid = union_outputs(scores, num_kv_heads, num_selected, max_loaded)
    if union.numel() == 0:
        return union, valid
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    block_n = triton.next_power_of_2(max(num_table, 16))
    integer_keys, bits = key_bits(score_floor)
    width = union.shape[-1]
    _select_union_kernel[(batch * num_kv_heads,)](
        scores, num_blocks, union, valid.view(torch.int8),
        scores.stride(0), scores.stride(1), num_table, num_kv_heads, float(score_floor or 0),
        K=num_selected, SINK=sink_blocks, WINDOW=window_blocks, G=group,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_N=block_n, U=width,
        BLOCK_U=triton.next_power_of_2(width), STEPS=cap_search_steps(num_selected, group, width),
        INTEGER_KEYS=integer_keys, BITS=bits, num_warps=UNION_WARPS or wide_table_warps(block_n, narrow=4),
    )  # fmt: skip
    return union, valid


def wide_table_warps(block_n: int, narrow: int) -> int:
    """Warps of a kernel with one program per (row, head) over a table of `block_n` (a power of two)
    blocks: `narrow` up to 1,024 blocks, 8 below 4,096, then 16 (the union here, the rank interleave
    of `triton_rank`): from 4,096 blocks up a program holds so many registers at 8 warps that one fits
    an SM, and 16 warps hide its reductions."""
    return narrow if block_n <= 1024 else 8 if block_n < 4096 else 16


def union_outputs(
    scores: torch.Tensor, num_kv_heads: int, num_selected: int, max_loaded: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (B, Hkv, U) union (long) and validity (bool) for (B, Hq, N) scores: U = G*K, or
    `max_loaded` where that is smaller."""
    batch, num_q_heads = scores.shape[:2]
    width = num_q_heads // num_kv_heads * num_selected
    width = width if max_loaded is None else min(width, max_loaded)
    union = torch.empty((batch, num_kv_heads, width), dtype=torch.long, device=scores.device)
    return union, torch.empty((batch, num_kv_heads, width), dtype=torch.bool, device=scores.device)


def key_bits(score_floor: int | None) -> tuple[bool, int]:
    """(INTEGER_KEYS, BITS) of the selection keys: integer scores from `score_floor` up take keys
    0 .. 1 - floor and the forced key above them; without a floor, float keys."""
    if score_floor is None:
        return False, FLOAT_KEY_BITS
    return True, (1 - score_floor + 1).bit_length()
