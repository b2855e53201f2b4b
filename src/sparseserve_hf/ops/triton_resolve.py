"""The HBM block-cache lookup in one Triton launch: one program per partition (see `ops.lru`).

Each program owns one partition's slots and the blocks looked up in it, so programs never
touch each other's entries and need no grid-wide synchronisation. Inside a program the phases
are separated by CTA barriers:
1. hits mark their slots used (`atomic_xchg` on the tick: the entry that changed it counts the
   distinct hit); a missing block is claimed by its first entry (`atomic_min` of an encoded
   entry index written into its own `block_slot` entry, which is negative while it misses);
2. the claiming entries, in row order, append their blocks to the load list;
3. a scan of the partition's eviction order writes the first evictable slots beside them;
4. the loads are installed (the victims' old blocks forgotten), every entry reads its slot;
5. the eviction order is compacted in place (kept slots) and the used slots appended by index.
Only this program touches its partition's entries, and the CTA barriers order its global reads
and writes, so the atomics are relaxed and CTA-scoped: no memory fence per atomic instruction.
Same decisions as `ops.lru.resolve_`, tested against it on random inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lru import LruTables
from .reference import LOAD_COUNTERS, LoadCount

MAX_TILE = 4096  # entries (and slots) one program holds per pass: a decode step's lookup fits one tile
MAX_WARPS = 16  # warps of a program (one per 256 lanes of its tile, at least 4)


@triton.jit
def _resolve_kernel(
    ids_ptr,
    first_partition,
    block_slot_ptr,
    slot_block_ptr,
    slot_tick_ptr,
    order_ptr,
    clock_ptr,
    counts_ptr,
    slots_ptr,
    load_ids_ptr,
    load_slots_ptr,
    load_counts_ptr,
    num_entries,
    per_partition,
    width,
    stride_row,
    stride_head,
    BLOCK: tl.constexpr,
    ONE_TILE: tl.constexpr,
):
    """Program h resolves head h's entries: entry e is ids[e // width, h, e % width].

    ONE_TILE: the entries and the partition's slots each fit one BLOCK-wide tile (a decode step's
    lookup), so every value a later phase needs stays in registers instead of being read again.
    """
    head = tl.program_id(0)
    part = (first_partition + head).to(tl.int64)
    clock = tl.load(clock_ptr + part) + 1
    tl.store(clock_ptr + part, clock)
    order_base = order_ptr + part * per_partition
    lists = head.to(tl.int64) * num_entries
    if ONE_TILE:
        distinct_hits, num_misses = _resolve_one_tile(
            ids_ptr, block_slot_ptr, slot_block_ptr, slot_tick_ptr, order_base, slots_ptr,
            load_ids_ptr + lists, load_slots_ptr + lists, clock, part, head,
            num_entries, per_partition, width, stride_row, stride_head, BLOCK,
        )  # fmt: skip
    else:
        distinct_hits, num_misses = _resolve_tiled(
            ids_ptr, block_slot_ptr, slot_block_ptr, slot_tick_ptr, order_base, slots_ptr,
            load_ids_ptr + lists, load_slots_ptr + lists, clock, part, head,
            num_entries, per_partition, width, stride_row, stride_head, BLOCK,
        )  # fmt: skip
    tl.store(load_counts_ptr + head, num_misses.to(tl.int64))
    tl.atomic_add(counts_ptr, (distinct_hits + num_misses).to(tl.int64), sem="relaxed")
    tl.atomic_add(counts_ptr + 1, num_misses.to(tl.int64), sem="relaxed")


@triton.jit
def _resolve_one_tile(
    ids_ptr,
    block_slot_ptr,
    slot_block_ptr,
    slot_tick_ptr,
    order_base,
    slots_ptr,
    load_ids_ptr,
    load_slots_ptr,
    clock,
    part,
    head,
    num_entries,
    per_partition,
    width,
    stride_row,
    stride_head,
    BLOCK: tl.constexpr,
):
    """The five phases over one tile of entries and one of slots; returns (distinct hits, misses).

    Hits keep the slot read in phase 1 (a slot this lookup uses is never a victim), the eviction
    order and its ticks read in phase 3 serve phase 5 (only the victims' ticks change between),
    so only the misses' slots and the partition's ticks are read a second time."""
    lanes = tl.arange(0, BLOCK)
    inside = lanes < num_entries
    ids = _entry_ids(ids_ptr, lanes, num_entries, width, stride_row, stride_head, head)
    valid = ids >= 0
    in_partition = lanes < per_partition
    order = tl.load(order_base + lanes, mask=in_partition, other=0)  # written only in phase 5
    # 1. hits touch their slots; misses are claimed by their first entry (claim = e - E - 2 <= -2)
    slot = tl.load(block_slot_ptr + ids, mask=valid, other=-1, volatile=True)
    hit = valid & (slot >= 0)
    missing = valid & (slot < 0)
    before = tl.atomic_xchg(slot_tick_ptr + slot, clock, mask=hit, sem="relaxed", scope="cta")
    distinct_hits = tl.sum((hit & (before != clock)).to(tl.int32), axis=0)
    claim_code = lanes.to(tl.int64) - num_entries - 2
    tl.atomic_min(block_slot_ptr + ids, claim_code, mask=missing, sem="relaxed", scope="cta")
    tl.debug_barrier()

    # 2. the claiming entries append their blocks, in row order
    claim = tl.load(block_slot_ptr + ids, mask=missing, other=0, volatile=True)
    loads = missing & (claim == claim_code)
    rank = tl.cumsum(loads.to(tl.int32), axis=0) - 1
    num_misses = tl.sum(loads.to(tl.int32), axis=0)
    tl.store(load_ids_ptr + rank, ids, mask=loads)
    rest = inside & (lanes >= num_misses)
    tl.store(load_ids_ptr + lanes, -1, mask=rest)
    tl.store(load_slots_ptr + lanes, -1, mask=rest)

    # 3. victims: the first slots of the eviction order not used by this lookup
    tick = tl.load(slot_tick_ptr + order, mask=in_partition, other=0, volatile=True)
    evictable = in_partition & (tick < clock)
    victim_rank = tl.cumsum(evictable.to(tl.int32), axis=0) - 1
    victim = evictable & (victim_rank < num_misses)
    tl.store(load_slots_ptr + victim_rank, order, mask=victim)
    tl.debug_barrier()

    # 4. install the loads, then the misses read their slots (hits keep theirs)
    loading = lanes < num_misses
    block = tl.load(load_ids_ptr + lanes, mask=loading, other=0, volatile=True)
    target = tl.load(load_slots_ptr + lanes, mask=loading, other=0, volatile=True)
    evicted = tl.load(slot_block_ptr + target, mask=loading, other=-1, volatile=True)
    tl.store(block_slot_ptr + evicted, -1, mask=loading & (evicted >= 0))
    tl.store(slot_block_ptr + target, block, mask=loading)
    tl.store(slot_tick_ptr + target, clock, mask=loading)
    tl.store(block_slot_ptr + block, target, mask=loading)
    tl.debug_barrier()
    slot = tl.where(missing, tl.load(block_slot_ptr + ids, mask=missing, other=-1, volatile=True), slot)
    out = (lanes // width) * stride_row + head * stride_head + lanes % width  # the ids' layout, contiguous
    tl.store(slots_ptr + out, tl.where(valid, slot, -1), mask=inside)

    # 5. the eviction order: kept slots compacted in place (every lane read it above), used slots by index
    stays = in_partition & (tick != clock) & ~victim
    kept_rank = tl.cumsum(stays.to(tl.int32), axis=0) - 1
    kept = tl.sum(stays.to(tl.int32), axis=0)
    tl.store(order_base + kept_rank, order, mask=stays)
    used = tl.load(slot_tick_ptr + part * per_partition + lanes, mask=in_partition, other=0, volatile=True)
    moved = in_partition & (used == clock)
    moved_rank = tl.cumsum(moved.to(tl.int32), axis=0) - 1 + kept
    tl.store(order_base + moved_rank, part * per_partition + lanes, mask=moved)
    return distinct_hits, num_misses


@triton.jit
def _resolve_tiled(
    ids_ptr,
    block_slot_ptr,
    slot_block_ptr,
    slot_tick_ptr,
    order_base,
    slots_ptr,
    load_ids_ptr,
    load_slots_ptr,
    clock,
    part,
    head,
    num_entries,
    per_partition,
    width,
    stride_row,
    stride_head,
    BLOCK: tl.constexpr,
):
    """The five phases in BLOCK-wide tiles, for any sizes; returns (distinct hits, misses)."""
    lanes = tl.arange(0, BLOCK)
    zero = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)

    # 1. hits touch their slots; misses are claimed by their first entry (claim = e - E - 2 <= -2)
    distinct_hits = zero
    for start in range(0, num_entries, BLOCK):
        entry = start + lanes
        ids = _entry_ids(ids_ptr, entry, num_entries, width, stride_row, stride_head, head)
        valid = ids >= 0
        slot = tl.load(block_slot_ptr + ids, mask=valid, other=-1, volatile=True)
        hit = valid & (slot >= 0)
        before = tl.atomic_xchg(slot_tick_ptr + slot, clock, mask=hit, sem="relaxed", scope="cta")
        distinct_hits += tl.sum((hit & (before != clock)).to(tl.int32), axis=0)
        claim_code = entry.to(tl.int64) - num_entries - 2
        tl.atomic_min(block_slot_ptr + ids, claim_code, mask=valid & (slot < 0), sem="relaxed", scope="cta")
    tl.debug_barrier()

    # 2. the claiming entries append their blocks, in row order
    num_misses = zero
    for start in range(0, num_entries, BLOCK):
        entry = start + lanes
        ids = _entry_ids(ids_ptr, entry, num_entries, width, stride_row, stride_head, head)
        valid = ids >= 0
        claim = tl.load(block_slot_ptr + ids, mask=valid, other=0, volatile=True)
        loads = valid & (claim == entry.to(tl.int64) - num_entries - 2)
        rank = tl.cumsum(loads.to(tl.int32), axis=0) - 1 + num_misses
        tl.store(load_ids_ptr + rank, ids, mask=loads)
        num_misses += tl.sum(loads.to(tl.int32), axis=0)
    for start in range(0, num_entries, BLOCK):
        entry = start + lanes
        rest = (entry < num_entries) & (entry >= num_misses)
        tl.store(load_ids_ptr + entry, -1, mask=rest)
        tl.store(load_slots_ptr + entry, -1, mask=rest)

    # 3. victims: the first slots of the eviction order not used by this lookup
    found = zero
    for start in range(0, per_partition, BLOCK):
        position = start + lanes
        inside = position < per_partition
        slot = tl.load(order_base + position, mask=inside, other=0)
        tick = tl.load(slot_tick_ptr + slot, mask=inside, other=0, volatile=True)
        evictable = inside & (tick < clock)
        rank = tl.cumsum(evictable.to(tl.int32), axis=0) - 1 + found
        tl.store(load_slots_ptr + rank, slot, mask=evictable & (rank < num_misses))
        found += tl.sum(evictable.to(tl.int32), axis=0)
    tl.debug_barrier()

    # 4. install the loads, then every entry reads its slot
    for start in range(0, num_entries, BLOCK):
        j = start + lanes
        loading = j < num_misses
        block = tl.load(load_ids_ptr + j, mask=loading, other=0, volatile=True)
        slot = tl.load(load_slots_ptr + j, mask=loading, other=0, volatile=True)
        evicted = tl.load(slot_block_ptr + slot, mask=loading, other=-1, volatile=True)
        tl.store(block_slot_ptr + evicted, -1, mask=loading & (evicted >= 0))
        tl.store(slot_block_ptr + slot, block, mask=loading)
        tl.store(slot_tick_ptr + slot, clock, mask=loading)
        tl.store(block_slot_ptr + block, slot, mask=loading)
    tl.debug_barrier()
    for start in range(0, num_entries, BLOCK):
        entry = start + lanes
        inside = entry < num_entries
        ids = _entry_ids(ids_ptr, entry, num_entries, width, stride_row, stride_head, head)
        valid = ids >= 0
        slot = tl.load(block_slot_ptr + ids, mask=valid, other=-1, volatile=True)
        out = (entry // width) * stride_row + head * stride_head + entry % width  # the ids' layout, contiguous
        tl.store(slots_ptr + out, tl.where(valid, slot, -1), mask=inside)

    # 5. the eviction order: kept slots compacted in place (writes land at or before what was read)
    kept = zero
    for start in range(0, per_partition, BLOCK):
        position = start + lanes
        inside = position < per_partition
        slot = tl.load(order_base + position, mask=inside, other=0, volatile=True)
        tick = tl.load(slot_tick_ptr + slot, mask=inside, other=0, volatile=True)
        stays = inside & (tick != clock)
        rank = tl.cumsum(stays.to(tl.int32), axis=0) - 1 + kept
        tl.debug_barrier()  # every lane has read this chunk before any overwrites it
        tl.store(order_base + rank, slot, mask=stays)
        kept += tl.sum(stays.to(tl.int32), axis=0)
    tl.debug_barrier()
    for start in range(0, per_partition, BLOCK):
        local = start + lanes
        inside = local < per_partition
        slot = part * per_partition + local
        tick = tl.load(slot_tick_ptr + slot, mask=inside, other=0, volatile=True)
        moved = inside & (tick == clock)
        rank = tl.cumsum(moved.to(tl.int32), axis=0) - 1 + kept
        tl.store(order_base + rank, slot, mask=moved)
        kept += tl.sum(moved.to(tl.int32), axis=0)

    return distinct_hits, num_misses


@triton.jit
def _entry_ids(ids_ptr, entry, num_entries, width, stride_row, stride_head, head):
    """Head `head`'s entries `entry` of the (B, H, width) ids (contiguous in the last dim); -1 past the end."""
    inside = entry < num_entries
    offset = (entry // width) * stride_row + head * stride_head + entry % width
    return tl.load(ids_ptr + offset, mask=inside, other=-1)


@triton.jit
def _picked_kernel(
    table_ptr, picked_ptr, valid_ptr, block_slot_ptr, ids_ptr, resident_ptr,
    totals_ptr, num_blocks_ptr, tail_len_ptr,
    heads, width, stride_tb, stride_th, stride_totals, block_size,
    BLOCK_U: tl.constexpr, COUNT: tl.constexpr,
):  # fmt: skip
    """Grid (B * H,): program (b, h) writes its row of the contiguous (B, H, U) outputs: each
    entry's id from the table, its resident slot. COUNT: adds the row's reads to totals[h]
    (`reference.account_loads`; integer atomics, so the sums are exact in any order)."""
    row_head = tl.program_id(0)
    b, h = row_head // heads, row_head % heads
    u = tl.arange(0, BLOCK_U)
    entry = row_head.to(tl.int64) * width + u
    inside = u < width
    index = tl.load(picked_ptr + entry, mask=inside, other=0)
    real = inside & (tl.load(valid_ptr + entry, mask=inside, other=0) != 0)
    ids = tl.load(table_ptr + b.to(tl.int64) * stride_tb + h * stride_th + index, mask=real, other=-1)
    ids = tl.where(real, ids, -1)
    slot = tl.load(block_slot_ptr + ids, mask=ids >= 0, other=-1)
    tl.store(ids_ptr + entry, ids, mask=inside)
    tl.store(resident_ptr + entry, slot, mask=inside)
    if COUNT:
        blocks = tl.load(num_blocks_ptr + b).to(tl.int64)
        tail = tl.load(tail_len_ptr + b).to(tl.int64)
        tokens = blocks * block_size + tail
        live = (tokens > 0).to(tl.int64)
        picks = tl.sum(real.to(tl.int64), axis=0)
        counters = totals_ptr + h * stride_totals
        tl.atomic_add(counters + 0, (picks * block_size + tail) * live, sem="relaxed")
        tl.atomic_add(counters + 1, tokens * live, sem="relaxed")
        tl.atomic_add(counters + 2, live, sem="relaxed")
        tl.atomic_add(counters + 3, blocks * live, sem="relaxed")
        tl.atomic_add(counters + 4, (b == 0).to(tl.int64), sem="relaxed")  # the calls: once per head


def picked_blocks(
    table: torch.Tensor,
    picked: torch.Tensor,
    valid: torch.Tensor,
    tables: LruTables,
    count: LoadCount | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.lru.picked_blocks` in one launch (instead of six, and the accounting's). table (B, H, N)
    with a contiguous last dim; count's totals with contiguous rows."""
    assert table.stride(-1) == 1 and picked.shape == valid.shape
    batch, heads, width = picked.shape
    picked, valid = picked.contiguous(), valid.contiguous()
    block_ids = torch.empty(picked.shape, dtype=table.dtype, device=picked.device)
    resident = torch.empty(picked.shape, dtype=tables.block_slot.dtype, device=picked.device)
    if batch * heads == 0:
        return block_ids, resident
    counting = count is not None
    totals = count.totals if counting else resident
    assert not counting or (totals.shape == (heads, LOAD_COUNTERS) and totals.stride(1) == 1)
    _picked_kernel[(batch * heads,)](
        table, picked, valid.view(torch.int8), tables.block_slot, block_ids, resident,
        totals, count.num_blocks.contiguous() if counting else resident,
        count.tail_len.contiguous() if counting else resident,
        heads, width, table.stride(0), table.stride(1), totals.stride(0), count.block_size if counting else 0,
        BLOCK_U=triton.next_power_of_2(max(width, 16)), COUNT=counting,
    )  # fmt: skip
    return block_ids, resident


def resolve_(
    ids: torch.Tensor,
    first_partition: int,
    tables: LruTables,
    counts: torch.Tensor,
    *,
    one_tile: bool = True,
    max_tile: int = MAX_TILE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ops.lru.resolve_` for a (B, H, U) selection whose head h uses partition `first_partition + h`.

    Returns slots (B, H, U), the load lists (H, B * U) and their lengths (H,) (see `ops.lru.resolve_`).
    `one_tile`: take the one-tile kernel wherever it fits; False forces the tiled one (the tests
    compare both with the spec). `max_tile`: the widest tile (a power of two) one program holds.
    """
    batch, heads, width = ids.shape
    ids = ids.contiguous()
    num_entries = batch * width
    per = tables.slots_per_partition
    slots = torch.empty_like(ids)
    load_ids = ids.new_empty((heads, num_entries))
    load_slots = ids.new_empty((heads, num_entries))
    load_counts = ids.new_empty((heads,))
    block = min(max_tile, triton.next_power_of_2(max(num_entries, per, 16)))
    fits = num_entries <= block and per <= block
    _resolve_kernel[(heads,)](
        ids, first_partition, tables.block_slot, tables.slot_block, tables.slot_tick, tables.slot_order, tables.clock,
        counts, slots, load_ids, load_slots, load_counts, num_entries, per, width, heads * width, width,
        BLOCK=block, ONE_TILE=fits and one_tile, num_warps=max(4, min(MAX_WARPS, block // 256)),
    )  # fmt: skip
    return slots, load_ids, load_slots, load_counts
