"""HBM block-cache bookkeeping as fixed-shape tensor ops: no host sync in the decode step.

A decode step looks up one layer's selection (B, Hkv, U) of DRAM ids (-1 = unused entry) in the
LRU block cache. Everything here keeps every intermediate at a shape known from the selection's
shape alone (no `.item()`, `torch.unique`, `nonzero` or boolean indexing), so a lookup is a
chain of asynchronous kernel launches that a CUDA graph can capture:

- duplicates (rows sharing blocks) are found by sorting and comparing neighbours;
- hits and misses come from the block -> slot table;
- victims come from `slot_order`, every slot in eviction order ((last use, slot) ascending):
  the first `n` not used in this lookup, with `n` the selection's size (an upper bound on its
  misses); the first `misses` are used. The lookup then moves the slots it used to the back.
  Keeping the order costs a few passes over P (cumsums, scatters) instead of a top-k over P
  (radix select plus a sort: 225 us of a 342 us lookup at 822K slots on the H200);
- masked writes go to a dump entry at the end of every table instead of being filtered out.

Tables (device tensors, updated in place; P slots, C tracked DRAM ids, each with one extra
dump entry at the end whose content is meaningless):
    block_slot (C + 1,) slot holding each DRAM block, -1 when not resident;
    slot_block (P + 1,) DRAM id held by each slot, -1 when free;
    slot_tick  (P + 1,) clock of each slot's last use, -1 when free;
    slot_order (P,)     every slot once, in eviction order: `eviction_order(slot_tick[:P])`;
    clock      (1,)     lookups so far.

`ReferenceLru` is the plain-Python specification the tensor version is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Lookup:
    """What one lookup decided (all on the tables' device).

    slots: same shape as the selection: the slot holding each entry's block, -1 where unused.
    load_ids, load_slots: (n,) blocks to copy into HBM and their slots, -1 where nothing loads
        (the FlashH2D kernel skips those entries).
    num_unique, num_misses: (1,) long: distinct blocks looked up, and those that missed.
    """

    slots: torch.Tensor
    load_ids: torch.Tensor
    load_slots: torch.Tensor
    num_unique: torch.Tensor
    num_misses: torch.Tensor


def dedupe(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) ids with -1 padding -> (sorted ids (n,), first (n,) bool: the first copy of each id >= 0).

    Sorted as int32 (DRAM ids stay far below 2^31): a radix sort makes half the passes of int64's.
    """
    ordered = ids.to(torch.int32).sort().values.to(ids.dtype)
    first = ordered >= 0
    first[1:] &= ordered[1:] != ordered[:-1]
    return ordered, first


def eviction_order(slot_tick: torch.Tensor) -> torch.Tensor:
    """(P,) slots in eviction order: free first, then least recently used; ties by slot index.

    A sort: what `slot_order` must always equal, rebuilt this way only when the pool grows.
    """
    num_slots = slot_tick.shape[0]
    return (slot_tick * num_slots + torch.arange(num_slots, device=slot_tick.device)).argsort()


def lru_victims(slot_order: torch.Tensor, slot_tick: torch.Tensor, clock: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` slots of `slot_order` not used at `clock`: (count,) long, in eviction order.

    Entries past the number of evictable slots are meaningless (slot 0).
    """
    evictable = slot_tick[slot_order] < clock  # (P,) per position in the order
    rank = evictable.cumsum(0) - 1
    victims = slot_order.new_zeros(count + 1)  # the last entry is the dump for the rest
    victims[torch.where(evictable & (rank < count), rank, count)] = slot_order
    return victims[:count]


def move_slots_(slot_order: torch.Tensor, moved: torch.Tensor, slot_index: torch.Tensor, to_front: bool) -> None:
    """Reorder `slot_order` in place: the slots where `moved` (P,) bool go, by slot index, to its
    front (or back); the other slots keep their relative order. Fixed shapes, no sort."""
    num_slots = slot_order.shape[0]
    num_moved = moved.sum()
    stays = ~moved[slot_order]  # (P,) per position in the order
    stay_position = stays.cumsum(0) - 1
    moved_position = moved.cumsum(0) - 1  # (P,) per slot: slot order among the moved ones
    if to_front:
        stay_position = stay_position + num_moved
    else:
        moved_position = moved_position + (num_slots - num_moved)
    reordered = slot_order.new_empty(num_slots + 1)  # each real entry written exactly once; the dump absorbs the rest
    reordered[torch.where(stays, stay_position, num_slots)] = slot_order
    reordered[torch.where(moved, moved_position, num_slots)] = slot_index
    slot_order.copy_(reordered[:num_slots])


def lookup_(
    block_ids: torch.Tensor,
    block_slot: torch.Tensor,
    slot_block: torch.Tensor,
    slot_tick: torch.Tensor,
    slot_order: torch.Tensor,
    clock: torch.Tensor,
    slot_index: torch.Tensor,
) -> Lookup:
    """Look a selection up, choose victims for its misses and update the tables in place.

    The caller copies `load_ids` -> `load_slots` (before anything reads the slots) and must
    not pass more entries than there are slots (checked from shapes by `HbmBlockCache`).

    Args:
        block_ids: any shape, long DRAM ids, -1 = unused entry; numel() = n <= P.
        block_slot, slot_block, slot_tick, slot_order, clock: the tables (see the module docstring).
        slot_index: (P,) long arange(P).
    """
    num_slots, dump_block = slot_block.shape[0] - 1, block_slot.shape[0] - 1
    count = block_ids.numel()
    clock.add_(1)
    ids, first = dedupe(block_ids.reshape(-1))  # (n,) sorted, first copy of each block
    slots = torch.where(first, block_slot[ids.clamp(min=0)], -1)
    hit, miss = first & (slots >= 0), first & (slots < 0)
    slot_tick[torch.where(hit, slots, num_slots)] = clock  # touch the hits first: they are not victims
    victims = lru_victims(slot_order, slot_tick[:num_slots], clock, count)  # (n,)
    rank = miss.cumsum(0) - 1  # the j-th miss (in id order) takes the j-th victim
    load_slots = torch.where(miss, victims[rank.clamp(min=0)], -1)
    target = torch.where(miss, load_slots, num_slots)  # masked entries write the dump slot
    evicted = slot_block[target]
    # index_fill_, not `[...] = -1`: a Python scalar assigned through an index tensor is copied to
    # the device first, a host sync (caught by the H200 sync-debug test).
    block_slot.index_fill_(0, torch.where(miss & (evicted >= 0), evicted, dump_block), -1)
    slot_block[target] = ids
    slot_tick[target] = clock
    block_slot[torch.where(miss, ids, dump_block)] = load_slots
    move_slots_(slot_order, slot_tick[:num_slots] == clock, slot_index, to_front=False)  # used now: last to go
    flat = block_ids.reshape(-1)
    resolved = torch.where(flat >= 0, block_slot[flat.clamp(min=0)], -1).view_as(block_ids)
    load_ids = torch.where(miss, ids, -1)
    return Lookup(resolved, load_ids, load_slots, first.sum().view(1), miss.sum().view(1))


def invalidate_(
    block_ids: torch.Tensor,
    block_slot: torch.Tensor,
    slot_block: torch.Tensor,
    slot_tick: torch.Tensor,
    slot_order: torch.Tensor,
    slot_index: torch.Tensor,
) -> None:
    """Forget the blocks `block_ids` (n,) (freed DRAM ids, which will be reused); -1 entries ignored.
    Their slots become free: first in `slot_order`, among the free ones by slot index."""
    num_slots, dump_block = slot_block.shape[0] - 1, block_slot.shape[0] - 1
    ids = block_ids.clamp(min=0)
    slots = torch.where(block_ids >= 0, block_slot[ids], -1)
    target = torch.where(slots >= 0, slots, num_slots)
    slot_block.index_fill_(0, target, -1)
    slot_tick.index_fill_(0, target, -1)
    block_slot.index_fill_(0, torch.where(block_ids >= 0, block_ids, dump_block), -1)
    move_slots_(slot_order, slot_tick[:num_slots] < 0, slot_index, to_front=True)


class ReferenceLru:
    """Plain-Python specification of `lookup_` / `invalidate_` (the test oracle).

    Same decisions as the tensor version: duplicates count once, misses in ascending id order
    take the victims in ascending (last use, slot) order among slots not used by this lookup.
    """

    def __init__(self, num_slots: int) -> None:
        self.slot_block = [-1] * num_slots
        self.slot_tick = [-1] * num_slots
        self.block_slot: dict[int, int] = {}
        self.clock = 0

    def lookup(self, block_ids: list[int]) -> tuple[list[int], int, int]:
        """Returns (slot of each entry, -1 where the id is -1; distinct blocks; misses)."""
        self.clock += 1
        unique = sorted({i for i in block_ids if i >= 0})
        misses = [i for i in unique if i not in self.block_slot]
        for block in unique:
            if block in self.block_slot:
                self.slot_tick[self.block_slot[block]] = self.clock
        order = sorted(range(len(self.slot_tick)), key=lambda s: (self.slot_tick[s], s))
        victims = [s for s in order if self.slot_tick[s] < self.clock][: len(misses)]
        assert len(victims) == len(misses), "more misses than evictable slots"
        for block, slot in zip(misses, victims):
            self.block_slot.pop(self.slot_block[slot], None)
            self.slot_block[slot], self.slot_tick[slot] = block, self.clock
            self.block_slot[block] = slot
        return [self.block_slot[i] if i >= 0 else -1 for i in block_ids], len(unique), len(misses)

    def invalidate(self, block_ids: list[int]) -> None:
        """Forget the freed DRAM ids `block_ids` (the spec of `invalidate_`); unknown ids are ignored."""
        for block in block_ids:
            slot = self.block_slot.pop(block, None)
            if slot is not None:
                self.slot_block[slot], self.slot_tick[slot] = -1, -1
