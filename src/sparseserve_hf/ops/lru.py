"""The HBM block cache's residency and LRU as fixed-shape tensor ops: the spec of the lookup kernels.

The device pool's P slots are split into NP equal partitions of Pp slots; partition p owns slots
[p * Pp, (p + 1) * Pp). The cache gives each (sparse layer, KV head) its own partition, so one
layer's lookup is NP-independent work: one Triton program per partition (`triton_resolve`), and
an LRU over a few thousand slots instead of one over every slot of the pool. A block belongs to
one (layer, KV head), so it is only ever looked up in one partition.

A lookup takes one row of DRAM ids per partition, (H, E) with -1 for unused entries, and decides,
per row:
- duplicates count once; a block's first entry (in row order) is the one that may load it;
- hits come from `block_slot`; their slots are marked used now (`slot_tick = clock`);
- the j-th missing block, in order of first appearance, takes the j-th slot of the partition's
  eviction order ((last use, slot) ascending, free slots first) that this lookup does not use;
- the partition's eviction order is kept sorted without a sort: the slots used now move to its
  back, by slot index; the others keep their relative order;
- with `free_ahead` = R, the lookup then frees least recently used slots it did not use until R
  of the partition's slots are free (or none is left to free). Free slots lead the eviction
  order, so the next lookup's first R misses land in slots known before it starts: their copy
  can begin before the lookup has chosen the victims of the rest (`triton_resolve.claim_`).
Every intermediate has a shape known from the inputs' shapes (no `.item()`, `nonzero`, boolean
indexing): a lookup is a chain of launches a CUDA graph can capture. Masked writes go to a dump
entry at the end of each table instead of being filtered out.

`ReferenceLru` is the plain-Python specification of one partition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import LoadCount, account_loads


@dataclass(frozen=True)
class LruTables:
    """The cache's residency tables (device tensors, updated in place). Each 1-D table has one dump
    entry at its end whose content is meaningless.

    block_slot (C + 1,)   slot holding each DRAM block, -1 when not resident;
    slot_block (P + 1,)   DRAM id held by each slot, -1 when free;
    slot_tick  (P + 1,)   its partition's clock at the slot's last use, -1 when free;
    slot_order (NP, Pp)   each partition's slots (global numbers) in eviction order;
    clock      (NP,)      lookups each partition has seen.
    """

    block_slot: torch.Tensor
    slot_block: torch.Tensor
    slot_tick: torch.Tensor
    slot_order: torch.Tensor
    clock: torch.Tensor

    @property
    def slots_per_partition(self) -> int:
        """Pp, the slots of each partition."""
        return self.slot_order.shape[1]


def empty_tables(num_partitions: int, slots_per_partition: int, num_blocks: int, device: torch.device) -> LruTables:
    """Tables of an empty cache: every slot free, in slot order."""
    num_slots = num_partitions * slots_per_partition
    return LruTables(
        block_slot=torch.full((num_blocks + 1,), -1, dtype=torch.long, device=device),
        slot_block=torch.full((num_slots + 1,), -1, dtype=torch.long, device=device),
        slot_tick=torch.full((num_slots + 1,), -1, dtype=torch.long, device=device),
        slot_order=torch.arange(num_slots, device=device).view(num_partitions, slots_per_partition),
        clock=torch.zeros(num_partitions, dtype=torch.long, device=device),
    )


def eviction_order(slot_tick: torch.Tensor, num_partitions: int) -> torch.Tensor:
    """(NP, Pp) each partition's slots by (last use, slot) ascending, from (P,) ticks (free = -1 first).

    A sort: what `slot_order` must always equal; rebuilt this way only after blocks are forgotten."""
    ticks = slot_tick.view(num_partitions, -1)
    per = ticks.shape[1]
    local = torch.arange(per, device=ticks.device)
    order = (ticks * per + local).argsort(dim=1)  # ticks < 2^40: no overflow in int64
    return order + torch.arange(num_partitions, device=ticks.device)[:, None] * per


def first_copies(ids: torch.Tensor) -> torch.Tensor:
    """(H, E) bool: True at the first entry (in row order) of each id >= 0 of its row."""
    valid = ids >= 0
    key = torch.where(valid, ids, torch.iinfo(torch.long).max)
    ordered, perm = key.sort(dim=1, stable=True)  # a run of equal ids starts with its first entry
    starts = torch.ones_like(valid)
    starts[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    return torch.zeros_like(valid).scatter_(1, perm, starts) & valid


def picked_blocks(
    table: torch.Tensor,
    picked: torch.Tensor,
    valid: torch.Tensor,
    tables: LruTables,
    count: LoadCount | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DRAM ids of picked blocks and the slots already holding them.

    Args:
        table: (B, H, N) each row's DRAM ids; picked, valid: (B, H, U) indices into a row and
            which of them are real.
        count: where to add what the picks read (`reference.account_loads`), or None.
    Returns:
        block_ids: (B, H, U) `table` at `picked`, -1 where not valid.
        resident: (B, H, U) the slot holding each block, -1 for misses and unused entries: what a
            decode may attend before `resolve_` of the same ids runs (which never moves a block it hits).
    """
    if count is not None:
        account_loads(count.totals, valid, count.num_blocks, count.tail_len, count.block_size)
    block_ids = torch.where(valid, torch.gather(table, 2, picked), -1)
    return block_ids, torch.where(block_ids >= 0, tables.block_slot[block_ids.clamp(min=0)], -1)


def resolve_(
    selection: torch.Tensor, first_partition: int, tables: LruTables, counts: torch.Tensor, free_ahead: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Look a selection up, choose victims for its misses, update the tables.

    Head h's entries form one row, in (row, entry) order: E = B * U entries, partition
    `first_partition + h`. The caller copies `load_ids` -> `load_slots` before anything reads
    the slots, and passes no row of more entries than a partition has slots (a lookup never
    evicts what it uses).

    Args:
        selection: (B, H, U) long DRAM ids, -1 = unused.
        first_partition: the partition of head 0.
        tables: the cache's tables.
        counts: (2,) long, += (distinct blocks looked up, misses).
        free_ahead: R, the free slots each looked-up partition keeps for the next lookup (see above).
    Returns:
        slots: (B, H, U) the slot of each entry's block, -1 where unused.
        load_ids, load_slots: (H, E) per head its misses' DRAM ids and slots, first (in order of
            first appearance), -1 after them.
        load_counts: (H,) long, the misses of each head (the live prefix of its load lists).
    """
    batch, heads, width = selection.shape
    ids = selection.transpose(0, 1).reshape(heads, batch * width)  # (H, E)
    partitions = torch.arange(first_partition, first_partition + heads, device=ids.device)
    num_rows, num_entries = heads, batch * width
    dump_block, dump_slot = tables.block_slot.shape[0] - 1, tables.slot_block.shape[0] - 1
    clock = tables.clock[partitions] + 1  # (H,)
    tables.clock[partitions] = clock
    now = clock[:, None]  # (H, 1)
    valid = ids >= 0
    safe_ids = torch.where(valid, ids, dump_block)
    slots = tables.block_slot[safe_ids]  # (H, E), -1 or a slot
    resident = valid & (slots >= 0)
    first = first_copies(ids)
    hit, miss = first & resident, first & ~resident
    tables.slot_tick[torch.where(resident, slots, dump_slot)] = now.expand(num_rows, num_entries)
    num_misses = miss.sum(1)  # (H,)

    order = tables.slot_order[partitions]  # (H, Pp)
    evictable = tables.slot_tick[order] < now
    victim_rank = evictable.cumsum(1) - 1
    load_slots = ids.new_full((num_rows, num_entries + 1), -1)  # the last column is the dump
    load_slots.scatter_(
        1, torch.where(evictable & (victim_rank < num_misses[:, None]), victim_rank, num_entries), order
    )
    miss_rank = miss.cumsum(1) - 1
    load_ids = ids.new_full((num_rows, num_entries + 1), -1)
    load_ids.scatter_(1, torch.where(miss, miss_rank, num_entries), ids)
    load_slots, load_ids = load_slots[:, :num_entries].contiguous(), load_ids[:, :num_entries].contiguous()

    loading = load_ids >= 0
    target = torch.where(loading, load_slots, dump_slot)
    evicted = tables.slot_block[target]
    # index_fill_, not `[...] = -1`: a Python scalar assigned through an index tensor is copied to
    # the device first, a host sync.
    tables.block_slot.index_fill_(0, torch.where(loading & (evicted >= 0), evicted, dump_block).flatten(), -1)
    tables.slot_block[target] = load_ids
    tables.slot_tick[target] = now.expand(num_rows, num_entries)
    tables.block_slot[torch.where(loading, load_ids, dump_block)] = load_slots
    resolved = torch.where(valid, tables.block_slot[safe_ids], -1).view(heads, batch, width).transpose(0, 1)

    _move_used_to_back_(tables, partitions, order, now)
    if free_ahead > 0:
        _free_ahead_(tables, partitions, now, free_ahead)
    missed = num_misses.sum()
    counts += torch.stack((hit.sum() + missed, missed))
    return resolved.contiguous(), load_ids, load_slots, num_misses


def _move_used_to_back_(tables: LruTables, partitions: torch.Tensor, order: torch.Tensor, now: torch.Tensor) -> None:
    """Reorder each row's partition: slots used at `now` go to the back by slot index, the rest keep their order."""
    num_rows, per = order.shape
    stays = tables.slot_tick[order] != now  # (H, Pp) per position in the order
    own_slots = partitions[:, None] * per + torch.arange(per, device=order.device)  # (H, Pp) by slot index
    moved = tables.slot_tick[own_slots] == now
    moved_position = moved.cumsum(1) - 1 + (per - moved.sum(1, keepdim=True))
    reordered = order.new_empty((num_rows, per + 1))  # each real entry written exactly once; the dump absorbs the rest
    reordered.scatter_(1, torch.where(stays, stays.cumsum(1) - 1, per), order)
    reordered.scatter_(1, torch.where(moved, moved_position, per), own_slots)
    tables.slot_order[partitions] = reordered[:, :per]


def _free_ahead_(tables: LruTables, partitions: torch.Tensor, now: torch.Tensor, free_ahead: int) -> None:
    """Free, in eviction order, the slots not used at `now` until `free_ahead` of each partition's
    slots are free; the freed slots join the free ones at the front of the order, by slot index."""
    dump_block, dump_slot = tables.block_slot.shape[0] - 1, tables.slot_block.shape[0] - 1
    order = tables.slot_order[partitions]  # (H, Pp)
    ticks = tables.slot_tick[order]
    free = ticks < 0
    idle = ~free & (ticks < now)  # used before this lookup: in eviction order, oldest first
    wanted = (free_ahead - free.sum(1, keepdim=True)).clamp(min=0)
    freeing = idle & (idle.cumsum(1) <= wanted)
    target = torch.where(freeing, order, dump_slot).flatten()
    held = torch.where(freeing.flatten(), tables.slot_block[target], -1)  # the dump's content is meaningless
    tables.block_slot.index_fill_(0, torch.where(held >= 0, held, dump_block), -1)
    tables.slot_block.index_fill_(0, target, -1)
    tables.slot_tick.index_fill_(0, target, -1)
    per = order.shape[1]
    local = torch.arange(per, device=order.device)
    own_slots = partitions[:, None] * per + local  # (H, Pp) by slot index
    tables.slot_order[partitions] = own_slots.gather(1, (tables.slot_tick[own_slots] * per + local).argsort(dim=1))


def forget_(block_ids: torch.Tensor, tables: LruTables) -> None:
    """Forget the blocks `block_ids` (n,) (freed DRAM ids, which will be reused); -1 entries ignored.

    Their slots become free, so each partition's eviction order is rebuilt (a sort: blocks are
    freed when requests end, not in the decode step)."""
    dump_block, dump_slot = tables.block_slot.shape[0] - 1, tables.slot_block.shape[0] - 1
    known = block_ids >= 0
    slots = torch.where(known, tables.block_slot[block_ids.clamp(min=0)], -1)
    target = torch.where(slots >= 0, slots, dump_slot)
    tables.slot_block.index_fill_(0, target, -1)
    tables.slot_tick.index_fill_(0, target, -1)
    tables.block_slot.index_fill_(0, torch.where(known, block_ids, dump_block), -1)
    tables.slot_order.copy_(eviction_order(tables.slot_tick[:-1], tables.slot_order.shape[0]))


class ReferenceLru:
    """Plain-Python specification of one partition of `resolve_` / `forget_` (the test oracle).

    Args:
        slots: the partition's slot numbers.
        free_ahead: the free slots each lookup leaves (`resolve_`'s `free_ahead`).
    """

    def __init__(self, slots: range, free_ahead: int = 0) -> None:
        self.slots = list(slots)
        self.free_ahead = free_ahead
        self.slot_block = {s: -1 for s in self.slots}
        self.slot_tick = {s: -1 for s in self.slots}
        self.block_slot: dict[int, int] = {}
        self.clock = 0

    def lookup(self, block_ids: list[int]) -> tuple[list[int], list[tuple[int, int]], int]:
        """Returns (slot of each entry, -1 where the id is -1; the loads (id, slot) in order; distinct blocks)."""
        self.clock += 1
        unique = list(dict.fromkeys(i for i in block_ids if i >= 0))  # first appearance order
        misses = [i for i in unique if i not in self.block_slot]
        for block in unique:
            if block in self.block_slot:
                self.slot_tick[self.block_slot[block]] = self.clock
        order = sorted(self.slots, key=lambda s: (self.slot_tick[s], s))
        victims = [s for s in order if self.slot_tick[s] < self.clock][: len(misses)]
        assert len(victims) == len(misses), "more misses than evictable slots"
        for block, slot in zip(misses, victims):
            self.block_slot.pop(self.slot_block[slot], None)
            self.slot_block[slot], self.slot_tick[slot] = block, self.clock
            self.block_slot[block] = slot
        slots = [self.block_slot[i] if i >= 0 else -1 for i in block_ids]
        free = sum(self.slot_tick[s] == -1 for s in self.slots)
        idle = [s for s in self.eviction_order() if -1 < self.slot_tick[s] < self.clock]
        self.forget([self.slot_block[s] for s in idle[: max(0, self.free_ahead - free)]])
        return slots, list(zip(misses, victims)), len(unique)

    def forget(self, block_ids: list[int]) -> None:
        """Forget the freed DRAM ids `block_ids` (the spec of `forget_`); unknown ids are ignored."""
        for block in block_ids:
            slot = self.block_slot.pop(block, None)
            if slot is not None:
                self.slot_block[slot], self.slot_tick[slot] = -1, -1

    def eviction_order(self) -> list[int]:
        """The partition's slots by (last use, slot): what the tensor `slot_order` row must equal."""
        return sorted(self.slots, key=lambda s: (self.slot_tick[s], s))
