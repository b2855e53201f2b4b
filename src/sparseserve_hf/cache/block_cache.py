"""HbmBlockCache: device-memory slots holding recently selected head-blocks, evicted LRU."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops import reference
from . import lru
from .dram_pool import DramPool
from .grow import grown
from .plain import plain_tensors

UNLIMITED_INITIAL_SLOTS = 256


class HbmBlockCache:
    """An LRU cache of DRAM head-blocks in device memory, shared by all layers and requests.

    Residency (block -> slot, slot -> block, slot -> last use), the clock and the hit/miss
    counters are device tensors, and a lookup is a fixed-shape chain of tensor ops (`lru.lookup_`)
    plus one FlashH2D launch: no host sync, so a decode step can run ahead of the host and be
    captured in a CUDA graph. Counters are read (one sync) only by `counts()`.

    Args:
        num_slots: fixed number of slots, or None for an unlimited cache that grows and never
            evicts: it keeps at least as many slots as there are live DRAM blocks, a bound known
            on the host, so no lookup has to count its misses to know whether to grow.
        block_shape: (2, S, D).
        dtype, device: of the slot pool.
        gather_blocks: the backend's block copy (`ops.gather_blocks`), used to load misses from
            the DRAM pool: one FlashH2D launch with the Triton backend (entries of -1 skipped).
    """

    @plain_tensors
    def __init__(
        self,
        num_slots: int | None,
        block_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        gather_blocks: Callable[..., None] = reference.gather_blocks,
    ) -> None:
        self.gather_blocks = gather_blocks
        self.unlimited = num_slots is None
        self.block_shape = block_shape
        self.device = device
        slots = UNLIMITED_INITIAL_SLOTS if num_slots is None else num_slots
        self.pool = torch.zeros((slots, *block_shape), dtype=dtype, device=device)  # (P, 2, S, D)
        # Each table has one dump entry at its end that absorbs masked writes (see `lru`).
        self._slot_block = torch.full((slots + 1,), -1, dtype=torch.long, device=device)
        self._slot_tick = torch.full((slots + 1,), -1, dtype=torch.long, device=device)
        self._block_slot = torch.full((1,), -1, dtype=torch.long, device=device)  # indexed by DRAM id
        self._slot_index = torch.arange(slots, device=device)
        self._slot_order = self._slot_index.clone()  # all free: eviction order is slot order
        self.clock = torch.zeros(1, dtype=torch.long, device=device)
        self._counts = torch.zeros(2, dtype=torch.long, device=device)  # blocks looked up, misses
        self.reallocations = 0  # times the pool or a table was reallocated (see TieredBlockStore.epoch)

    @property
    def num_slots(self) -> int:
        """P, the device pool's slots of one head-block each (it grows only when `num_slots` was None)."""
        return self.pool.shape[0]

    @property
    def slot_block(self) -> torch.Tensor:
        """(P,) DRAM id held by each slot, -1 free (a view: no dump entry)."""
        return self._slot_block[:-1]

    @property
    def slot_tick(self) -> torch.Tensor:
        """(P,) clock of each slot's last use, -1 free."""
        return self._slot_tick[:-1]

    @property
    def block_slot(self) -> torch.Tensor:
        """(C,) slot of each tracked DRAM id, -1 when not resident."""
        return self._block_slot[:-1]

    @property
    def num_resident(self) -> int:
        """Blocks now resident, read back to the host (a sync: not for the decode step)."""
        return int(self.resident_count())

    def resident_count(self) -> torch.Tensor:
        """() long on the device: blocks now resident (no host sync; `num_resident` reads it back)."""
        return (self.slot_block >= 0).sum()

    @plain_tensors
    def track_blocks(self, capacity: int) -> None:
        """Make the block -> slot map cover DRAM ids below `capacity`."""
        if capacity + 1 > self._block_slot.shape[0]:
            self.reallocations += 1
        self._block_slot = _grown_with_dump(self._block_slot, capacity)

    def check_fits(self, num_entries: int) -> None:
        """Raise ValueError when a selection of `num_entries` could need more slots than exist.

        Decided from the selection's shape, not its content (that would need a host sync): a
        lookup never evicts the blocks it uses itself, so every entry may need its own slot.
        """
        if not self.unlimited and num_entries > self.num_slots:
            raise ValueError(
                f"the HBM block cache has {self.num_slots} slots but one layer's selection can need {num_entries}; "
                "raise hbm_cache_bytes or lower token_budget / batch size"
            )

    @plain_tensors
    def lookup(self, block_ids: torch.Tensor, dram: DramPool) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots holding `block_ids` (any shape, -1 = unused; duplicates allowed), loading the misses.

        Launches only (no host sync). Returns (slots, same shape as `block_ids`, -1 where unused;
        number of misses as a (1,) device tensor). The counters `counts()` reads are updated too.
        """
        self.check_fits(block_ids.numel())
        if self.unlimited:
            self._grow(max(dram.num_used, block_ids.numel()))  # host-known bound: never evicts
        tables = self._block_slot, self._slot_block, self._slot_tick, self._slot_order
        result = lru.lookup_(block_ids.to(self.device), *tables, self.clock, self._slot_index)
        try:
            self.gather_blocks(dram.storage, result.load_ids, self.pool, result.load_slots)  # the H2D copy
        except BaseException:
            # The tables already call the misses resident: forget them, or a later lookup would
            # hit slots that never received their blocks.
            lru.invalidate_(result.load_ids, *tables, self._slot_index)
            raise
        self._counts += torch.cat((result.num_unique, result.num_misses))
        return result.slots, result.num_misses

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a lookup reads or writes by address (what a captured decode step holds)."""
        return {
            "hbm_pool": self.pool,
            "slot_block": self._slot_block,
            "slot_tick": self._slot_tick,
            "block_slot": self._block_slot,
            "slot_order": self._slot_order,
            "slot_index": self._slot_index,
            "clock": self.clock,
            "lookup_counts": self._counts,
        }

    @plain_tensors
    def counts(self) -> tuple[int, int]:
        """(blocks looked up, misses) since the last call, then zeroed: the one place that syncs."""
        looked_up, misses = self._counts.tolist()
        self._counts.zero_()  # in place: a captured decode step (CUDA graph) keeps adding into this very tensor
        return looked_up, misses

    @plain_tensors
    def invalidate(self, block_ids: torch.Tensor) -> None:
        """Forget blocks whose DRAM ids are being freed (their ids will be reused)."""
        if block_ids.numel() == 0:
            return
        tables = self._block_slot, self._slot_block, self._slot_tick, self._slot_order
        lru.invalidate_(block_ids.to(self.device).reshape(-1), *tables, self._slot_index)

    def _grow(self, needed: int) -> None:
        if needed <= self.num_slots:
            return
        new = max(2 * self.num_slots, needed)
        pool = grown(self.pool, new)
        slot_block, slot_tick = _grown_with_dump(self._slot_block, new), _grown_with_dump(self._slot_tick, new)
        slot_order = lru.eviction_order(slot_tick[:-1])  # the new slots are free: first
        # Everything allocated before anything is replaced: a failed growth (out of memory) leaves the cache whole.
        self.pool, self._slot_block, self._slot_tick, self._slot_order = pool, slot_block, slot_tick, slot_order
        self._slot_index = torch.arange(new, device=self.device)
        self.reallocations += 1


def _grown_with_dump(table: torch.Tensor, size: int) -> torch.Tensor:
    """A (size + 1,) table: the old real entries, -1 for the new ones and for the dump entry."""
    if size + 1 <= table.shape[0]:
        return table
    out = table.new_full((size + 1,), -1)
    out[: table.shape[0] - 1] = table[:-1]
    return out
