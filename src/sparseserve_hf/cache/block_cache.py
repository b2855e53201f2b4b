"""HbmBlockCache: device-memory slots holding recently selected head-blocks, evicted LRU."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops import reference
from .dram_pool import DramPool
from .grow import grown

UNLIMITED_INITIAL_SLOTS = 256


class HbmBlockCache:
    """An LRU cache of DRAM head-blocks in device memory, shared by all layers and requests.

    Residency is kept as tensors on the device (block -> slot, slot -> block, slot -> last use)
    so that lookups and victim choice are tensor ops.

    Args:
        num_slots: fixed number of slots, or None for an unlimited cache that grows and never
            evicts.
        block_shape: (2, S, D).
        dtype, device: of the slot pool.
        gather_blocks: the backend's block copy (`ops.gather_blocks`), used to load misses from
            the DRAM pool: one FlashH2D launch with the Triton backend.
    """

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
        self.slot_block = torch.full((slots,), -1, dtype=torch.long, device=device)
        self.slot_tick = torch.full((slots,), -1, dtype=torch.long, device=device)
        self.block_slot = torch.full((0,), -1, dtype=torch.long, device=device)  # indexed by DRAM id
        self.tick = 0

    @property
    def num_slots(self) -> int:
        return self.pool.shape[0]

    @property
    def num_resident(self) -> int:
        return int((self.slot_block >= 0).sum())

    def track_blocks(self, capacity: int) -> None:
        """Make the block -> slot map cover DRAM ids below `capacity`."""
        self.block_slot = grown(self.block_slot, capacity, fill=-1)

    def lookup(self, block_ids: torch.Tensor, dram: DramPool) -> tuple[torch.Tensor, int]:
        """Slots holding `block_ids` (U,) unique DRAM ids, loading the misses from `dram`.

        Returns (slots (U,), number of misses). Slots used in this lookup are never chosen as
        victims for its own misses, so the caller must not ask for more blocks than slots.
        """
        self.tick += 1
        slots = self.block_slot[block_ids]
        missing = slots < 0
        self.slot_tick[slots[~missing]] = self.tick
        miss_ids = block_ids[missing]
        num_misses = miss_ids.numel()
        if num_misses:
            victims = self._victims(num_misses)
            self._load(miss_ids, victims, dram)
            slots = slots.masked_scatter(missing, victims)
        return slots, num_misses

    def invalidate(self, block_ids: torch.Tensor) -> None:
        """Forget blocks whose DRAM ids are being freed (their ids will be reused)."""
        if block_ids.numel() == 0:
            return
        block_ids = block_ids.to(self.device)
        slots = self.block_slot[block_ids]
        slots = slots[slots >= 0]
        self.slot_block[slots] = -1
        self.slot_tick[slots] = -1
        self.block_slot[block_ids] = -1

    def _victims(self, count: int) -> torch.Tensor:
        evictable = self.slot_tick < self.tick
        if self.unlimited and int((self.slot_block < 0).sum()) < count:
            self._grow(self.num_resident + count)
            evictable = self.slot_tick < self.tick
        if int(evictable.sum()) < count:
            raise ValueError(
                f"the HBM block cache has {self.num_slots} slots but one layer's selection needs "
                f"{count} more than it can free; raise hbm_cache_bytes or lower token_budget / batch size"
            )
        # Free slots carry tick -1, so they go first; then least recently used.
        ranked = torch.where(evictable, self.slot_tick, torch.iinfo(torch.long).max)
        return ranked.topk(count, largest=False).indices

    def _load(self, block_ids: torch.Tensor, slots: torch.Tensor, dram: DramPool) -> None:
        evicted = self.slot_block[slots]
        self.block_slot[evicted[evicted >= 0]] = -1
        self.gather_blocks(dram.storage, block_ids, self.pool, slots)  # the H2D copy
        self.slot_block[slots] = block_ids
        self.slot_tick[slots] = self.tick
        self.block_slot[block_ids] = slots

    def _grow(self, needed: int) -> None:
        new = max(2 * self.num_slots, needed)
        self.pool = grown(self.pool, new)
        self.slot_block = grown(self.slot_block, new, fill=-1)
        self.slot_tick = grown(self.slot_tick, new, fill=-1)
