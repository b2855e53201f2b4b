"""ResidentBlocks: the block cache of the no-offload ablation, where every block already lives on the device."""

from __future__ import annotations

import torch

from .block_pool import BlockPool
from .plain import plain_tensors


class ResidentBlocks:
    """Stands in for `HbmBlockCache` when `offload=False`: the block pool itself is in device memory.

    A block's slot is its pool id and `pool` is the pool's storage, so sparse attention reads
    blocks exactly as it reads HBM cache slots; every lookup hits, nothing is loaded and nothing
    is evicted. Distinct blocks looked up are still counted (on the device, no host sync), so
    `stats()` reports the same `blocks_selected` as with offload and a hit rate of 1.0.

    Args:
        dram: the pool (allocated on the model's device).
    """

    unlimited = True
    reallocations = 0  # the pool is the DRAM pool's storage: its growth is the store's to count

    @plain_tensors
    def __init__(self, dram: BlockPool) -> None:
        self.dram = dram
        self._looked_up = torch.zeros(1, dtype=torch.long, device=dram.device)

    @property
    def pool(self) -> torch.Tensor:
        """(C, 2, S, D) the pool's storage: read through every call, since the pool may grow."""
        return self.dram.storage

    @property
    def num_slots(self) -> int:
        """Slots = the pool's capacity: with offload=False every pool block is its own slot."""
        return self.dram.capacity

    @property
    def num_resident(self) -> int:
        """Blocks in use in the pool, all of them resident (offload=False)."""
        return self.dram.num_used

    def track_blocks(self, capacity: int) -> None:
        """Nothing to track: a block's slot is its id."""

    def check_fits(self, entries_per_partition: int) -> None:
        """Always fits: nothing is loaded."""

    def prepare(self, shape: tuple[int, ...], dram: BlockPool, first_partition: int = 0) -> None:
        """Nothing to do on the host before a lookup: every block is resident."""

    def invalidate(self, block_ids: torch.Tensor) -> None:
        """Nothing to forget: freed ids are the pool's business."""

    @plain_tensors
    def lookup(
        self, block_ids: torch.Tensor, dram: BlockPool, first_partition: int = 0, settle: bool = True
    ) -> torch.Tensor:
        """Slots of `block_ids` (any shape, -1 = unused): the ids themselves (nothing misses)."""
        ordered = block_ids.reshape(-1).sort().values
        distinct = ordered >= 0
        distinct[1:] &= ordered[1:] != ordered[:-1]  # first copy of each id: rows may share blocks
        self._looked_up += distinct.sum()
        return block_ids

    def settle(self) -> None:
        """Nothing runs after a lookup."""

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a lookup reads or writes by address (what a captured decode step holds)."""
        return {"hbm_pool": self.pool, "lookup_counts": self._looked_up}

    @plain_tensors
    def counts(self) -> tuple[int, int]:
        """(distinct blocks looked up, misses = 0) since the last call, then zeroed."""
        looked_up = int(self._looked_up)
        self._looked_up.zero_()
        return looked_up, 0
