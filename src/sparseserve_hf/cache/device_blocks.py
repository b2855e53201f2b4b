"""DeviceBlocks: what the store reads blocks through on the device, whichever tier holds them."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .block_pool import BlockPool


@runtime_checkable
class DeviceBlocks(Protocol):
    """The device side of the block store: `HbmBlockCache` (an LRU cache of DRAM blocks, with
    offload) or `ResidentBlocks` (the pool itself, without). Decode attention reads `pool` at the
    slots `lookup` returns; the store grows, checks and counts through the rest.

    Attributes:
        unlimited: the tier grows instead of evicting (so no lookup can outgrow it).
        reallocations: times its pool or tables moved (a captured step must be captured again).
    """

    unlimited: bool
    reallocations: int

    @property
    def pool(self) -> torch.Tensor:
        """(P, 2, S, D) the device blocks attention reads by slot."""
        ...

    @property
    def num_slots(self) -> int:
        """P, the pool's slots."""
        ...

    @property
    def num_resident(self) -> int:
        """Blocks now resident (may sync: not for the decode step)."""
        ...

    def track_blocks(self, capacity: int) -> None:
        """Cover DRAM ids below `capacity`."""
        ...

    def check_fits(self, entries_per_partition: int) -> None:
        """Raise ValueError when a selection this wide could need more slots than a partition has."""
        ...

    def prepare(self, shape: tuple[int, ...], dram: BlockPool, first_partition: int = 0) -> None:
        """The host side of a lookup of a (B, H, U) selection, decided from its shape."""
        ...

    def lookup(
        self, block_ids: torch.Tensor, dram: BlockPool, first_partition: int = 0, settle: bool = True
    ) -> torch.Tensor:
        """The slots holding `block_ids`, loading what misses; `settle=False` leaves `settle()` to the caller."""
        ...

    def settle(self) -> None:
        """Order the last lookup's trailing upkeep before what the current stream runs next."""
        ...

    def invalidate(self, block_ids: torch.Tensor) -> None:
        """Forget blocks whose DRAM ids are being freed."""
        ...

    def counts(self) -> tuple[int, int]:
        """(blocks looked up, misses) since the last call, then zeroed."""
        ...

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a lookup reads or writes by address."""
        ...
