"""The HBM block-cache lookup in Triton launches: victims and the eviction order one program per
partition, the work over the selection's entries spread wide (see `ops.lru`).

Which slot each miss takes, and the eviction order, are decided by one program that owns the
partition, so programs never touch each other's slots and need no grid-wide synchronisation. The
work over a selection's entries (marking hits, claiming misses, listing them in row order, reading
each entry's slot) runs in programs of `ENTRIES_PER_PROGRAM` entries each, many per partition, one
launch per step that needs all of the one before: one program doing it over a step's thousands of
entries was the lookup's longest part, and it shared its SM with the attention running beside it.
`claim_` (phases 1-2) and `install_` (phases 3-4) split the lookup where its misses are known: the
misses that land in the partition's free slots (the first of the eviction order, which
`free_ahead` keeps free) can be copied while `install_` still chooses the other victims.
`install_(..., reorder=False)` leaves phases 5-6 to a launch of its own, `reorder_`: they decide
nothing this lookup returns, so they can run beside the copy of its misses. The phases:
1. (entry-wide) hits mark their slots used (`atomic_xchg` on the tick: the entry that changed it
   counts the distinct hit); a missing block is claimed by its first entry (`atomic_min` of an
   encoded entry index written into its own `block_slot` entry, which is negative while it misses);
2. (entry-wide) each program counts its claiming entries, then appends their blocks to the load
   list after those of the programs before it (row order); the first take the free slots leading
   the eviction order (the early loads);
3. where misses outnumber the early loads, a scan of the eviction order writes the victims of the
   others (the late loads);
4. the loads are installed (the victims' old blocks forgotten), then (entry-wide, where asked)
   every entry reads its slot;
5. the eviction order is compacted in place (kept slots) and the used slots appended by index;
6. least recently used slots are freed until `free_ahead` are (they lead the order, by index).
Launch boundaries order the phases across programs, CTA barriers inside a partition's program; so
every atomic (phase 1's, the counters') is relaxed: no memory fence per atomic instruction.
Same decisions as `ops.lru.resolve_`, tested against it on random inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .lru import LruTables
from .reference import LOAD_COUNTERS, LoadCount

MAX_TILE = 4096  # slots (and misses) a partition's program holds per pass: a decode step's partition fits one tile
MAX_WARPS = 16  # warps of a program (one per 256 lanes of its tile, at least 4)
MAX_EARLY = 1024  # the most early loads one lookup of a partition may take
ENTRIES_PER_PROGRAM = 256  # entries of one partition's selection per program of the entry-wide phases (1, 2, 4's slots)


@triton.jit
def _mark_kernel(
    ids_ptr, first_partition, block_slot_ptr, slot_tick_ptr, clock_ptr, counts_ptr,
    num_entries, width, stride_row, stride_head, CHUNK: tl.constexpr,
):  # fmt: skip
    """Program (h, c), phase 1 of head h's entries c * CHUNK ... (entry e is ids[e // width, h, e % width]):
    hits stamped with the lookup's clock (the partition's, plus one: `_append_kernel` stores it),
    misses claimed by their first entry (claim = e - E - 2 <= -2), distinct hits counted."""
    head = tl.program_id(0)
    part = (first_partition + head).to(tl.int64)
    clock = tl.load(clock_ptr + part) + 1
    entry = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ids = _entry_ids(ids_ptr, entry, num_entries, width, stride_row, stride_head, head)
    valid = ids >= 0
    slot = tl.load(block_slot_ptr + ids, mask=valid, other=-1, volatile=True)
    hit = valid & (slot >= 0)
    before = tl.atomic_xchg(slot_tick_ptr + slot, clock, mask=hit, sem="relaxed")
    claim_code = entry.to(tl.int64) - num_entries - 2
    tl.atomic_min(block_slot_ptr + ids, claim_code, mask=valid & (slot < 0), sem="relaxed")
    tl.atomic_add(counts_ptr, tl.sum((hit & (before != clock)).to(tl.int64), axis=0), sem="relaxed")


@triton.jit
def _count_kernel(
    ids_ptr, block_slot_ptr, chunk_counts_ptr, num_entries, width, stride_row, stride_head, CHUNK: tl.constexpr
):  # fmt: skip
    """Program (h, c), phase 2's first half after `_mark_kernel`: how many of head h's entries
    c * CHUNK ... claimed their block, into chunk_counts[h, c]."""
    head = tl.program_id(0)
    chunk = tl.program_id(1)
    entry = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = _entry_ids(ids_ptr, entry, num_entries, width, stride_row, stride_head, head)
    claims = _claiming(block_slot_ptr, ids, entry, num_entries)
    tl.store(chunk_counts_ptr + head * tl.num_programs(1) + chunk, tl.sum(claims.to(tl.int32), axis=0))


@triton.jit
def _append_kernel(
    ids_ptr, first_partition, block_slot_ptr, slot_tick_ptr, order_ptr, clock_ptr, counts_ptr, chunk_counts_ptr,
    load_ids_ptr, load_slots_ptr, load_counts_ptr, early_counts_ptr,
    num_entries, per_partition, width, stride_row, stride_head,
    CHUNK: tl.constexpr, CHUNKS: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """Program (h, c), phase 2's second half: the claiming entries of chunk c append their blocks to
    head h's load list (H, E) after those of the chunks before it (row order), and -1 fills the
    list's part of the chunk past its misses. Program (h, 0) also stores the lookup's clock, the
    misses' count and the early loads (the first misses, at most EARLY, take the free slots
    leading the eviction order)."""
    head = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    lists = head.to(tl.int64) * num_entries
    load_ids_ptr += lists
    load_slots_ptr += lists
    before = tl.arange(0, CHUNKS)
    counted = tl.load(chunk_counts_ptr + head * chunks + before, mask=before < chunks, other=0)
    offset = tl.sum(tl.where(before < chunk, counted, 0), axis=0)
    num_misses = tl.sum(counted, axis=0)
    entry = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = _entry_ids(ids_ptr, entry, num_entries, width, stride_row, stride_head, head)
    claims = _claiming(block_slot_ptr, ids, entry, num_entries)
    rank = tl.cumsum(claims.to(tl.int32), axis=0) - 1 + offset
    tl.store(load_ids_ptr + rank, ids, mask=claims)
    rest = (entry < num_entries) & (entry >= num_misses)
    tl.store(load_ids_ptr + entry, -1, mask=rest)
    tl.store(load_slots_ptr + entry, -1, mask=rest)
    if chunk == 0:
        part = (first_partition + head).to(tl.int64)
        tl.store(clock_ptr + part, tl.load(clock_ptr + part) + 1)
        # the early loads: free slots lead the eviction order (a hit never uses one)
        front = tl.arange(0, EARLY)
        in_front = front < per_partition
        slot = tl.load(order_ptr + part * per_partition + front, mask=in_front, other=0)
        free = in_front & (tl.load(slot_tick_ptr + slot, mask=in_front, other=0, volatile=True) < 0)
        early = tl.minimum(tl.sum(free.to(tl.int32), axis=0), num_misses)
        tl.store(load_slots_ptr + front, slot, mask=front < early)
        tl.store(load_counts_ptr + head, num_misses.to(tl.int64))
        tl.store(early_counts_ptr + head, early.to(tl.int64))
        tl.atomic_add(counts_ptr, num_misses.to(tl.int64), sem="relaxed")
        tl.atomic_add(counts_ptr + 1, num_misses.to(tl.int64), sem="relaxed")


@triton.jit
def _claiming(block_slot_ptr, ids, entry, num_entries):
    """Which entries `entry` (holding `ids`) claimed their block in phase 1 (as its first entry)."""
    valid = ids >= 0
    claim = tl.load(block_slot_ptr + ids, mask=valid, other=0, volatile=True)
    return valid & (claim == entry.to(tl.int64) - num_entries - 2)


@triton.jit
def _install_kernel(
    first_partition, block_slot_ptr, slot_block_ptr, slot_tick_ptr, order_ptr, clock_ptr,
    load_ids_ptr, load_slots_ptr, load_counts_ptr, early_counts_ptr, late_ids_ptr, late_slots_ptr, late_counts_ptr,
    num_entries, per_partition, free_ahead,
    BLOCK: tl.constexpr, FREE_BLOCK: tl.constexpr, ORDER: tl.constexpr,
):  # fmt: skip
    """Program h, phases 3-6 after `claim_`'s kernels: the late loads' victims (also listed from 0 in
    `late_*`), the install, and with ORDER the eviction order and the slots freed ahead (else
    `_reorder_kernel` runs those after it). No phase moves a block this lookup uses, so its entries'
    slots (`_slots_kernel`) read the same before and after 5-6."""
    head = tl.program_id(0)
    part = (first_partition + head).to(tl.int64)
    clock = tl.load(clock_ptr + part)
    order_base = order_ptr + part * per_partition
    lists = head.to(tl.int64) * num_entries
    load_ids_ptr += lists
    load_slots_ptr += lists
    late_ids_ptr += lists
    late_slots_ptr += lists
    num_misses = tl.load(load_counts_ptr + head).to(tl.int32)
    early = tl.load(early_counts_ptr + head).to(tl.int32)
    tl.store(late_counts_ptr + head, (num_misses - early).to(tl.int64))
    lanes = tl.arange(0, BLOCK)
    zero = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)

    # 3. victims of the late loads: the first slots of the eviction order not used by this lookup
    # (the early loads' first); with no late loads (the usual step: free slots take every miss) none
    if num_misses > early:
        found = zero
        for start in range(0, per_partition, BLOCK):
            position = start + lanes
            inside = position < per_partition
            slot = tl.load(order_base + position, mask=inside, other=0)
            tick = tl.load(slot_tick_ptr + slot, mask=inside, other=0, volatile=True)
            evictable = inside & (tick < clock)
            rank = tl.cumsum(evictable.to(tl.int32), axis=0) - 1 + found
            late = evictable & (rank >= early) & (rank < num_misses)
            tl.store(load_slots_ptr + rank, slot, mask=late)
            tl.store(late_slots_ptr + rank - early, slot, mask=late)
            tl.store(late_ids_ptr + rank - early, tl.load(load_ids_ptr + rank, mask=late, other=0), mask=late)
            found += tl.sum(evictable.to(tl.int32), axis=0)
        tl.debug_barrier()

    # 4. install the loads (each entry then reads its slot: `_slots_kernel`)
    for start in range(0, num_misses, BLOCK):
        j = start + lanes
        loading = j < num_misses
        block = tl.load(load_ids_ptr + j, mask=loading, other=0, volatile=True)
        slot = tl.load(load_slots_ptr + j, mask=loading, other=0, volatile=True)
        evicted = tl.load(slot_block_ptr + slot, mask=loading, other=-1, volatile=True)
        tl.store(block_slot_ptr + evicted, -1, mask=loading & (evicted >= 0))
        tl.store(slot_block_ptr + slot, block, mask=loading)
        tl.store(slot_tick_ptr + slot, clock, mask=loading)
        tl.store(block_slot_ptr + block, slot, mask=loading)

    if ORDER:
        tl.debug_barrier()
        _keep_order(part, clock, order_base, block_slot_ptr, slot_block_ptr, slot_tick_ptr, per_partition, free_ahead,
                    BLOCK, FREE_BLOCK)  # fmt: skip


@triton.jit
def _slots_kernel(
    ids_ptr, block_slot_ptr, slots_ptr, num_entries, width, stride_row, stride_head, CHUNK: tl.constexpr
):  # fmt: skip
    """Program (h, c), phase 4's second half for head h's entries c * CHUNK ...: each entry's slot
    after the install, -1 where unused, written in the ids' (B, H, U) layout."""
    head = tl.program_id(0)
    entry = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ids = _entry_ids(ids_ptr, entry, num_entries, width, stride_row, stride_head, head)
    valid = ids >= 0
    slot = tl.load(block_slot_ptr + ids, mask=valid, other=-1, volatile=True)
    out = _entry_offset(entry, width, stride_row, stride_head, head)  # the ids' layout, contiguous
    tl.store(slots_ptr + out, tl.where(valid, slot, -1), mask=entry < num_entries)


@triton.jit
def _reorder_kernel(
    first_partition, block_slot_ptr, slot_block_ptr, slot_tick_ptr, order_ptr, clock_ptr, per_partition, free_ahead,
    BLOCK: tl.constexpr, FREE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Program h, phases 5-6 of partition `first_partition + h` after `_install_kernel` without them."""
    part = (first_partition + tl.program_id(0)).to(tl.int64)
    clock = tl.load(clock_ptr + part)
    _keep_order(part, clock, order_ptr + part * per_partition, block_slot_ptr, slot_block_ptr, slot_tick_ptr,
                per_partition, free_ahead, BLOCK, FREE_BLOCK)  # fmt: skip


@triton.jit
def _keep_order(
    part, clock, order_base, block_slot_ptr, slot_block_ptr, slot_tick_ptr, per_partition, free_ahead,
    BLOCK: tl.constexpr, FREE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Phases 5-6 of one partition: the eviction order after a lookup whose used slots carry `clock`."""
    lanes = tl.arange(0, BLOCK)
    zero = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
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

    # 6. free ahead: the order's oldest used slots until free_ahead are free, then the free ones by index
    if FREE_BLOCK > 0:
        tl.debug_barrier()
        front = tl.arange(0, FREE_BLOCK)
        in_front = front < tl.minimum(free_ahead, per_partition)
        slot = tl.load(order_base + front, mask=in_front, other=0, volatile=True)
        tick = tl.load(slot_tick_ptr + slot, mask=in_front, other=0, volatile=True)
        free = in_front & (tick < 0)
        idle = in_front & (tick >= 0) & (tick < clock)
        wanted = free_ahead - tl.sum(free.to(tl.int32), axis=0)
        freeing = idle & (tl.cumsum(idle.to(tl.int32), axis=0) <= wanted)
        held = tl.load(slot_block_ptr + slot, mask=freeing, other=-1, volatile=True)
        tl.store(block_slot_ptr + held, -1, mask=freeing & (held >= 0))
        tl.store(slot_block_ptr + slot, -1, mask=freeing)
        tl.store(slot_tick_ptr + slot, -1, mask=freeing)
        now_free = free | freeing  # a prefix of the order: free slots lead it, the oldest used follow
        by_index = tl.sort(tl.where(now_free, slot, per_partition * (part + 1)))
        tl.store(order_base + front, by_index, mask=now_free)


@triton.jit
def _entry_ids(ids_ptr, entry, num_entries, width, stride_row, stride_head, head):
    """Head `head`'s entries `entry` of the (B, H, width) ids (contiguous in the last dim); -1 past the end."""
    offset = _entry_offset(entry, width, stride_row, stride_head, head)
    return tl.load(ids_ptr + offset, mask=entry < num_entries, other=-1)


@triton.jit
def _entry_offset(entry, width, stride_row, stride_head, head):
    """Where head `head`'s entry `entry` (row entry // width, column entry % width) sits in (B, H, width)."""
    return (entry // width) * stride_row + head * stride_head + entry % width


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
    if COUNT:  # loaded before any store, which the compiler would not let a later load pass
        blocks = tl.load(num_blocks_ptr + b).to(tl.int64)
        tail = tl.load(tail_len_ptr + b).to(tl.int64)
    index = tl.load(picked_ptr + entry, mask=inside, other=0)
    real = inside & (tl.load(valid_ptr + entry, mask=inside, other=0) != 0)
    ids = tl.load(table_ptr + b.to(tl.int64) * stride_tb + h * stride_th + index, mask=real, other=-1)
    ids = tl.where(real, ids, -1)
    slot = tl.load(block_slot_ptr + ids, mask=ids >= 0, other=-1)
    tl.store(ids_ptr + entry, ids, mask=inside)
    tl.store(resident_ptr + entry, slot, mask=inside)
    if COUNT:
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


class Claims(NamedTuple):
    """What `claim_` decided: (H, E) load lists, their lengths (H,) and the early loads' (H,) (the
    first of each list, whose slots are already written: free ones, known before `install_`)."""

    load_ids: torch.Tensor
    load_slots: torch.Tensor
    load_counts: torch.Tensor
    early_counts: torch.Tensor


class Installed(NamedTuple):
    """What `install_` decided: every entry's slot (B, H, U) (None where not asked for) and the late
    loads (those after the early ones, listed from 0: (H, E) ids and slots, (H,) lengths)."""

    slots: torch.Tensor | None
    late_ids: torch.Tensor
    late_slots: torch.Tensor
    late_counts: torch.Tensor


def _launch_shape(per: int, max_tile: int) -> tuple[int, int]:
    """(tile width, warps) of a lookup's programs that own a partition of `per` slots."""
    block = min(max_tile, triton.next_power_of_2(max(per, 16)))
    return block, max(4, min(MAX_WARPS, block // 256))


def _entry_grid(heads: int, num_entries: int) -> tuple[tuple[int, int], int, int]:
    """(grid, entries per program, warps) of an entry-wide phase: (H, programs per head)."""
    chunk = min(ENTRIES_PER_PROGRAM, triton.next_power_of_2(max(num_entries, 16)))
    return (heads, max(1, triton.cdiv(num_entries, chunk))), chunk, max(1, min(4, chunk // 64))


def claim_(
    ids: torch.Tensor,
    first_partition: int,
    tables: LruTables,
    counts: torch.Tensor,
    *,
    max_early: int = MAX_EARLY,
) -> Claims:
    """Phases 1-2 of `ops.lru.resolve_` for a (B, H, U) selection whose head h uses partition
    `first_partition + h`: hits marked used, misses listed, the early loads' slots written.
    `install_` of the same ids must follow before any other lookup of these partitions."""
    batch, heads, width = ids.shape
    num_entries = batch * width
    load_ids = ids.new_empty((heads, num_entries))
    load_slots = ids.new_empty((heads, num_entries))
    load_counts, early_counts = ids.new_empty((heads,)), ids.new_empty((heads,))
    per = tables.slots_per_partition
    grid, chunk, warps = _entry_grid(heads, num_entries)
    entry_args = (num_entries, width, heads * width, width)
    _mark_kernel[grid](
        ids, first_partition, tables.block_slot, tables.slot_tick, tables.clock, counts, *entry_args,
        CHUNK=chunk, num_warps=warps,
    )  # fmt: skip
    chunk_counts = torch.empty(grid, dtype=torch.int32, device=ids.device)
    _count_kernel[grid](ids, tables.block_slot, chunk_counts, *entry_args, CHUNK=chunk, num_warps=warps)
    _append_kernel[grid](
        ids, first_partition, tables.block_slot, tables.slot_tick, tables.slot_order, tables.clock, counts,
        chunk_counts, load_ids, load_slots, load_counts, early_counts, num_entries, per, width, heads * width, width,
        CHUNK=chunk, CHUNKS=triton.next_power_of_2(grid[1]),
        EARLY=triton.next_power_of_2(max(1, min(max_early, per, num_entries))), num_warps=warps,
    )  # fmt: skip
    return Claims(load_ids, load_slots, load_counts, early_counts)


def install_(
    ids: torch.Tensor,
    first_partition: int,
    tables: LruTables,
    claims: Claims,
    free_ahead: int = 0,
    *,
    reorder: bool = True,
    entry_slots: bool = True,
    max_tile: int = MAX_TILE,
) -> Installed:
    """Phases 3-6 of `ops.lru.resolve_` after `claim_` of the same (B, H, U) ids: victims, install,
    each entry's slot, the eviction order and `free_ahead` (`ops.lru.resolve_`'s). `reorder=False`
    stops after each entry's slot: the slots and the late loads are final, and `reorder_` with the
    same `free_ahead` must follow before any other lookup, `picked_blocks` or `ops.lru.forget_`
    touches these partitions. `entry_slots=False` leaves each entry's slot to whoever reads it
    (`tables.block_slot` at its id, from then on): a launch fewer."""
    batch, heads, width = ids.shape
    num_entries = batch * width
    per = tables.slots_per_partition
    late_ids, late_slots = torch.empty_like(claims.load_ids), torch.empty_like(claims.load_slots)
    late_counts = torch.empty_like(claims.load_counts)
    block, warps = _launch_shape(per, max_tile)
    _install_kernel[(heads,)](
        first_partition, tables.block_slot, tables.slot_block, tables.slot_tick, tables.slot_order, tables.clock,
        *claims, late_ids, late_slots, late_counts, num_entries, per, free_ahead,
        BLOCK=block, FREE_BLOCK=_free_block(free_ahead, per), ORDER=reorder, num_warps=warps,
    )  # fmt: skip
    slots = None
    if entry_slots:
        slots = torch.empty_like(ids)
        grid, chunk, chunk_warps = _entry_grid(heads, num_entries)
        _slots_kernel[grid](
            ids, tables.block_slot, slots, num_entries, width, heads * width, width, CHUNK=chunk, num_warps=chunk_warps
        )  # fmt: skip
    return Installed(slots, late_ids, late_slots, late_counts)


def reorder_(
    first_partition: int, heads: int, tables: LruTables, free_ahead: int = 0, *, max_tile: int = MAX_TILE
) -> None:
    """Phases 5-6 of `ops.lru.resolve_` for partitions `first_partition` .. `+ heads - 1`, after
    `install_(..., reorder=False)` of their lookup: the eviction order (the slots that lookup used
    move to its back) and `free_ahead` slots freed. Nothing the lookup returned changes, so this
    can run beside the copy of its misses and the attention that reads them."""
    per = tables.slots_per_partition
    block, warps = _launch_shape(per, max_tile)
    _reorder_kernel[(heads,)](
        first_partition, tables.block_slot, tables.slot_block, tables.slot_tick, tables.slot_order, tables.clock,
        per, free_ahead, BLOCK=block, FREE_BLOCK=_free_block(free_ahead, per), num_warps=warps,
    )  # fmt: skip


def _free_block(free_ahead: int, per: int) -> int:
    """The tile of phase 6 (a power of two holding `free_ahead` slots), 0 where nothing is freed ahead."""
    return triton.next_power_of_2(min(free_ahead, per)) if free_ahead > 0 else 0


def resolve_(
    ids: torch.Tensor,
    first_partition: int,
    tables: LruTables,
    counts: torch.Tensor,
    free_ahead: int = 0,
    *,
    max_tile: int = MAX_TILE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ops.lru.resolve_` for a (B, H, U) selection whose head h uses partition `first_partition + h`:
    `claim_` then `install_`. Returns slots (B, H, U), the load lists (H, B * U) and their lengths
    (H,) (see `ops.lru.resolve_`). `max_tile`: the widest tile (a power of two) one program holds."""
    ids = ids.contiguous()
    claims = claim_(ids, first_partition, tables, counts)
    installed = install_(ids, first_partition, tables, claims, free_ahead, max_tile=max_tile)
    return installed.slots, claims.load_ids, claims.load_slots, claims.load_counts
