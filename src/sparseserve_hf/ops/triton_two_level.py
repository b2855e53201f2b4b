"""Two levels of top-k for few rows over wide block tables: the rank interleave and the group union.

`triton_rank.combine_top_ranks` runs one program per (row, query head) and
`triton_select.select_group_union` one per (row, KV head), each over the row's whole table. With
a batch of one or two rows and a long context that is a few dozen programs, each holding its
rows' keys for the whole table (at 256K tokens, 8,187 blocks) through a search of several
full-width reductions, on a GPU of 132 SMs. Here the table is cut into chunks of CHUNK blocks,
one program per chunk takes the top of its chunk as candidates, and one program per row then
runs the one-level kernel's logic over the candidates only:
- rank interleave: each ranking's top-`depth` within the chunk (their union, ascending, -1
  padded, per chunk), and the chunk's default output (-2 * depth, or -inf); then each ranking's
  top-`depth` list among the candidates, ranked, written at the listed blocks;
- group union: each query head's top-K within the chunk (sink and window forced), and the
  chunk of the row's union bitmap cleared; then each head's top-K among its candidates, marked
  in the bitmap, which is compacted into the union (ascending).
Every block of a top list over the whole table is in its chunk's top list (a block that beats it
in the table beats it in its chunk, ties going to the lower index in both), and candidates
ascend in block index, so both results equal the one-level kernels' entry for entry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_rank, triton_select
from .device_info import sm_count
from .triton_rank import interleave
from .triton_select import (
    ORDER_KEY_BITS,
    cap_search_steps,
    group_scores,
    key_bits,
    order_key,
    selection_keys,
    top_k_rows,
    union_outputs,
    write_union,
)

# Launch knobs: tables at least MIN_TABLE blocks wide (64K tokens of 32-token blocks) select in two
# levels, narrower ones in one (None: always one level). The pieces: CHUNK blocks where one level's
# programs (one per row and head) are fewer than the GPU's SMs (few rows: fewer candidates for the
# second level's one program per row and head), FILLED_CHUNK where they fill it (many rows: more and
# shorter first-level programs, whose serial search is what a wide table's selection waits on).
MIN_TABLE: int | None = 2048
CHUNK = 2048
FILLED_CHUNK = 512
CHUNK_WARPS: int | None = None  # the chunk programs' warps; None: by their width


@triton.jit
def _chunk_lists_kernel(
    first_ptr,
    second_ptr,
    out_ptr,
    cand_ptr,
    num_table,
    DEPTH,
    CHUNK: tl.constexpr,
    SEGMENT: tl.constexpr,
):
    """Grid (B * Hq, chunks), contiguous (B * Hq, N) scores and output: cand[row, c*SEGMENT :
    (c+1)*SEGMENT] = the blocks of chunk c in either ranking's top-DEPTH within it (ascending, -1
    padded); out[row, chunk c] = -2 * DEPTH, or -inf where either score is -inf."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    n = c * CHUNK + tl.arange(0, CHUNK)
    live = n < num_table
    first = tl.load(first_ptr + row * num_table + n, mask=live, other=float("-inf"))
    second = tl.load(second_ptr + row * num_table + n, mask=live, other=float("-inf"))
    which = tl.arange(0, 2)[:, None]
    both = tl.where(which == 0, first[None, :], second[None, :])  # (2, CHUNK)
    key = tl.where(live[None, :], order_key(both), 0)
    listed = tl.max(top_k_rows(key, live[None, :], DEPTH, ORDER_KEY_BITS).to(tl.int32), axis=0)  # (CHUNK,)
    position = tl.cumsum(listed, axis=0) - 1
    total = tl.sum(listed, axis=0)
    segment = cand_ptr + row * (tl.num_programs(1) * SEGMENT) + c * SEGMENT
    tl.store(segment + position, n, mask=listed > 0)
    u = tl.arange(0, SEGMENT)
    tl.store(segment + u, tl.full([SEGMENT], -1, tl.int32), mask=u >= total)
    floor = tl.where((first == float("-inf")) | (second == float("-inf")), float("-inf"), -2.0 * DEPTH)
    tl.store(out_ptr + row * num_table + n, floor, mask=live)


@triton.jit
def _rank_candidates_kernel(
    first_ptr,
    second_ptr,
    out_ptr,
    cand_ptr,
    scratch_key_ptr,
    scratch_idx_ptr,
    scratch_rank_ptr,
    num_table,
    num_candidates,
    DEPTH,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Grid (B * Hq,): `triton_rank`'s interleave over the row's candidates, written at the listed
    blocks (the rest keep the chunk pass's floor)."""
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK_C)
    n = tl.load(cand_ptr + row * num_candidates + j, mask=j < num_candidates, other=-1)
    live = n >= 0
    first = tl.load(first_ptr + row * num_table + n, mask=live, other=float("-inf"))
    second = tl.load(second_ptr + row * num_table + n, mask=live, other=float("-inf"))
    scratch = row * 2 * BLOCK_K
    out, listed = interleave(
        first, second, live, n, scratch_key_ptr + scratch, scratch_idx_ptr + scratch, scratch_rank_ptr + scratch,
        DEPTH, BLOCK_K,
    )  # fmt: skip
    tl.store(out_ptr + row * num_table + n, out, mask=live & listed)


@triton.jit
def _chunk_candidates_kernel(
    scores_ptr,
    num_blocks_ptr,
    cand_ptr,
    bitmap_ptr,
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
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BITMAP_WIDTH: tl.constexpr,
    INTEGER_KEYS: tl.constexpr,
    BITS: tl.constexpr,
):
    """Grid (B * Hkv, chunks): cand[row_head, g, c*K : (c+1)*K] = head g's top-K block indices in
    chunk c, ascending, -1 past their count; bitmap[row_head, chunk c] = 0."""
    row_head = tl.program_id(0)
    c = tl.program_id(1)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    n = c * CHUNK + tl.arange(0, CHUNK)
    g = tl.arange(0, BLOCK_G)
    x, count, live = group_scores(scores_ptr, num_blocks_ptr, b, h, g, n, num_table, stride_sb, stride_sh, G)
    key = selection_keys(x, n[None, :], count, live, score_floor, SINK, WINDOW, INTEGER_KEYS, BITS)
    chosen = top_k_rows(key, live, K, BITS)  # (BG, CHUNK)
    position = tl.cumsum(chosen.to(tl.int32), axis=1) - 1
    total = tl.sum(chosen.to(tl.int32), axis=1)  # (BG,) <= K
    num_chunks = tl.num_programs(1)
    rows = cand_ptr + (row_head * G + g)[:, None] * (num_chunks * K) + c * K  # (BG, 1) this chunk's segment
    tl.store(rows + position, n[None, :], mask=chosen)
    u = tl.arange(0, BLOCK_K)
    pad = (u[None, :] >= total[:, None]) & (u[None, :] < K) & (g < G)[:, None]
    tl.store(rows + u[None, :], tl.full([BLOCK_G, BLOCK_K], -1, tl.int32), mask=pad)
    tl.store(bitmap_ptr + row_head * BITMAP_WIDTH + n, tl.zeros([CHUNK], tl.int8), mask=n < BITMAP_WIDTH)


@triton.jit
def _union_size(bitmap, n, chosen, m, num_table):
    """Distinct blocks among the candidates n (BG, BC) where `chosen`: marked in the row's bitmap
    (all clear before), counted, and cleared again. Entry j is another block in each head's list,
    so the heads' marks meet in the bitmap, not along an axis."""
    tl.store(bitmap + n, chosen.to(tl.int8), mask=chosen)
    tl.debug_barrier()
    size = tl.sum(tl.load(bitmap + m, mask=m < num_table, other=0).to(tl.int32), axis=0)
    tl.debug_barrier()
    tl.store(bitmap + n, tl.zeros_like(chosen).to(tl.int8), mask=chosen)
    tl.debug_barrier()
    return size


@triton.jit
def _union_of_candidates_kernel(
    scores_ptr,
    num_blocks_ptr,
    cand_ptr,
    bitmap_ptr,
    union_ptr,
    valid_ptr,
    stride_sb,
    stride_sh,
    num_kv_heads,
    num_table,
    num_candidates,
    score_floor,
    K: tl.constexpr,
    SINK: tl.constexpr,
    WINDOW: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BITMAP_WIDTH: tl.constexpr,
    U: tl.constexpr,
    BLOCK_U: tl.constexpr,
    STEPS: tl.constexpr,
    INTEGER_KEYS: tl.constexpr,
    BITS: tl.constexpr,
):
    """Grid (B * Hkv,): each head's top-K among its candidates, their union compacted into
    union[row_head, :U] (ascending, 0 past the count) and valid[row_head, :U]."""
    row_head = tl.program_id(0)
    b = row_head // num_kv_heads
    h = row_head % num_kv_heads
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_C)
    count = tl.load(num_blocks_ptr + b)
    in_list = (g < G)[:, None] & (j < num_candidates)[None, :]
    n = tl.load(cand_ptr + (row_head * G + g)[:, None] * num_candidates + j[None, :], mask=in_list, other=-1)
    live = n >= 0  # (BG, BC)
    x = tl.load(scores_ptr + b * stride_sb + (h * G + g)[:, None] * stride_sh + n, mask=live, other=0.0)
    key = selection_keys(x, n, count, live, score_floor, SINK, WINDOW, INTEGER_KEYS, BITS)
    bitmap = bitmap_ptr + row_head * BITMAP_WIDTH
    m = tl.arange(0, BITMAP_WIDTH)
    chosen = top_k_rows(key, live, K, BITS)
    # The cap (a compile-time test): each head's top k for the largest k whose union fits (`triton_select.group_top_k`).
    if U < G * K:  # noqa: SIM102
        if _union_size(bitmap, n, chosen, m, num_table) > U:
            low = tl.zeros([], tl.int32) + U // G
            high = tl.zeros([], tl.int32) + (K - 1)
            for _ in tl.static_range(STEPS):
                middle = (low + high + 1) // 2
                size = _union_size(bitmap, n, top_k_rows(key, live, middle, BITS), m, num_table)
                low = tl.where(size <= U, middle, low)
                high = tl.where(size <= U, high, middle - 1)
            chosen = top_k_rows(key, live, low, BITS)  # a head's best k lie among its chunks' best K
    tl.store(bitmap + n, tl.full([BLOCK_G, BLOCK_C], 1, tl.int8), mask=chosen)
    tl.debug_barrier()  # the marks of every thread, before any reads the bitmap
    member = tl.load(bitmap + m, mask=m < num_table, other=0).to(tl.int32)
    write_union(union_ptr, valid_ptr, row_head, member, m, U, BLOCK_U)


def combine_top_ranks(first: torch.Tensor, second: torch.Tensor, depth: int) -> torch.Tensor:
    """The op (`reference.combine_by_rank` with a depth): two levels where `two_level_chunk` gives a
    chunk, else `triton_rank`'s one program per (row, query head)."""
    chunk = two_level_chunk(first.numel() // max(first.shape[-1], 1), first.shape[-1], first.device)
    if chunk is not None:
        return combine_top_ranks_chunked(first, second, depth, chunk=chunk)
    return triton_rank.combine_top_ranks(first, second, depth)


def two_level_chunk(programs: int, num_table: int, device: torch.device) -> int | None:
    """The chunk width a selection of `programs` one-level programs over `num_table`-block tables takes
    in two levels, or None for one level: tables of at least MIN_TABLE blocks take CHUNK where the
    programs are fewer than the GPU's SMs (on CPU, the interpreter's: any number), else FILLED_CHUNK;
    a chunk that would hold the whole table leaves one level (its one chunk would be one level's work
    and a second pass)."""
    if MIN_TABLE is None or num_table < MIN_TABLE:
        return None
    chunk = CHUNK if programs < _multiprocessors(device) else FILLED_CHUNK
    return chunk if chunk < num_table else None


def _multiprocessors(device: torch.device) -> int | float:
    """SMs of a CUDA device; no limit elsewhere."""
    return sm_count(device) if device.type == "cuda" else float("inf")


def combine_top_ranks_chunked(
    first: torch.Tensor, second: torch.Tensor, depth: int, *, chunk: int = CHUNK
) -> torch.Tensor:
    """`triton_rank.combine_top_ranks` in two launches over `chunk`-block pieces of the table (a
    power of two, >= 16); the same arguments, the same result."""
    _check_chunk(chunk)
    depth = min(depth, first.shape[-1])
    rows, num_table = first.numel() // max(first.shape[-1], 1), first.shape[-1]
    if rows == 0 or num_table == 0 or depth == 0:
        return triton_rank.combine_top_ranks(first, second, depth)
    first, second = first.contiguous(), second.contiguous()
    out = torch.empty(first.shape, dtype=torch.float32, device=first.device)
    num_chunks = triton.cdiv(num_table, chunk)
    segment = triton.next_power_of_2(2 * depth)
    cand = torch.empty((rows, num_chunks * segment), dtype=torch.int32, device=first.device)
    _chunk_lists_kernel[(rows, num_chunks)](
        first, second, out, cand, num_table, depth, CHUNK=chunk, SEGMENT=segment,
        num_warps=CHUNK_WARPS or (2 if chunk <= 1024 else 8)
    )  # fmt: skip
    block_k = triton.next_power_of_2(depth)
    scratch_key = torch.empty((rows, 2 * block_k), dtype=torch.int32, device=first.device)
    scratch_idx, scratch_rank = torch.empty_like(scratch_key), torch.empty_like(scratch_key)
    num_candidates = cand.shape[1]
    block_c = triton.next_power_of_2(num_candidates)
    _rank_candidates_kernel[(rows,)](
        first, second, out, cand, scratch_key, scratch_idx, scratch_rank, num_table, num_candidates, depth,
        BLOCK_C=block_c, BLOCK_K=block_k, num_warps=2 if block_c <= 1024 else 8,
    )  # fmt: skip
    return out


def _check_chunk(chunk: int) -> None:
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")


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
    """The op (`reference.select_group_union`): two levels where `two_level_chunk` gives a chunk, else
    `triton_select`'s one program per (row, KV head)."""
    args = (scores, num_blocks, num_selected, sink_blocks, window_blocks, num_kv_heads, score_floor, max_loaded)
    chunk = two_level_chunk(scores.shape[0] * num_kv_heads, scores.shape[-1], scores.device)
    if chunk is not None:
        return select_group_union_chunked(*args, chunk=chunk)
    return triton_select.select_group_union(*args)


def select_group_union_chunked(
    scores: torch.Tensor,
    num_blocks: torch.Tensor,
    num_selected: int,
    sink_blocks: int,
    window_blocks: int,
    num_kv_heads: int,
    score_floor: int | None = None,
    max_loaded: int | None = None,
    *,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`triton_select.select_group_union` in two launches over `chunk`-block pieces of the table
    (a power of two, >= 16); the same arguments, the same result."""
    _check_chunk(chunk)
    batch, num_q_heads, num_table = scores.shape
    group = num_q_heads // num_kv_heads
    union, valid = union_outputs(scores, num_kv_heads, num_selected, max_loaded)
    if union.numel() == 0:
        return union, valid
    width = union.shape[-1]
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    num_chunks = triton.cdiv(num_table, chunk)
    num_candidates = num_chunks * num_selected
    rows = batch * num_kv_heads
    cand = torch.empty((rows, group, num_candidates), dtype=torch.int32, device=scores.device)
    bitmap_width = triton.next_power_of_2(max(num_table, 16))
    bitmap = torch.empty((rows, bitmap_width), dtype=torch.int8, device=scores.device)
    integer_keys, bits = key_bits(score_floor)
    shared = dict(
        K=num_selected, SINK=sink_blocks, WINDOW=window_blocks, G=group, BLOCK_G=triton.next_power_of_2(group),
        BITMAP_WIDTH=bitmap_width, INTEGER_KEYS=integer_keys, BITS=bits,
    )  # fmt: skip
    _chunk_candidates_kernel[(rows, num_chunks)](
        scores, num_blocks, cand, bitmap, scores.stride(0), scores.stride(1), num_table, num_kv_heads,
        float(score_floor or 0), CHUNK=chunk, BLOCK_K=triton.next_power_of_2(num_selected), **shared,
        num_warps=CHUNK_WARPS or (4 if chunk <= 1024 else 8),
    )  # fmt: skip
    _union_of_candidates_kernel[(rows,)](
        scores, num_blocks, cand, bitmap, union, valid.view(torch.int8), scores.stride(0), scores.stride(1),
        num_kv_heads, num_table, num_candidates, float(score_floor or 0), BLOCK_C=triton.next_power_of_2(num_candidates),
        U=width, BLOCK_U=triton.next_power_of_2(width), STEPS=cap_search_steps(num_selected, group, width), **shared, num_warps=4 if num_candidates <= 1024 else 8,
    )  # fmt: skip
    return union, valid
