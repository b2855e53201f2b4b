"""HbmBlockCache: device-memory slots holding recently selected head-blocks, evicted LRU per partition."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch

from ..ops import lru, reference
from .block_pool import BlockPool
from .grow import grown
from .plain import plain_tensors

UNLIMITED_INITIAL_SLOTS = 256
# A split lookup's partitions keep this many slots free (at most an eighth of their slots): the next
# lookup's first misses land there, so their copy starts before the other victims are chosen.
FREE_AHEAD = 128
SPLIT_LOOKUP = True  # split the lookup where the op set can (an ablation knob)
# A split lookup keeps its eviction order (install's phases 5-6) in a launch of its own that runs
# beside the copy of the late misses, where the op set has one; `settle` joins it (an ablation knob).
REORDER_BESIDE = True


def rows_that_fit(num_slots: int, partitions: int, entries_per_row: int) -> int:
    """Rows one lookup can serve when each of a row's `entries_per_row` selected blocks per partition
    may need its own slot (a lookup never evicts the blocks it uses itself)."""
    return (num_slots // partitions) // entries_per_row


class HbmBlockCache:
    """An LRU cache of DRAM head-blocks in device memory, for all requests.

    The slots are split into `partitions` equal LRU partitions (`ops.lru`); the store gives each
    (sparse layer, KV head) its own, so a layer's lookup is one independent program per KV head
    with the Triton backend (`ops.triton_resolve`). Residency, the clocks and the hit/miss
    counters are device tensors, and a lookup is that resolve plus FlashH2D launches: no host
    sync, so a decode step can run ahead of the host and be captured in a CUDA graph. Counters
    are read (one sync) only by `counts()`. With `claim` and `install` the lookup is split where
    its misses are known: the copy of those that land in free slots runs while `install` picks
    the other victims (on a second CUDA stream), and each partition keeps `FREE_AHEAD` slots free.

    Args:
        num_slots: fixed number of slots (`num_slots // partitions` per partition; the rest are
            not used), or None for an unlimited cache that grows and never evicts: one partition
            that keeps at least as many slots as there are live DRAM blocks, a bound known on the
            host, so no lookup has to count its misses to know whether to grow.
        block_shape: (2, S, D).
        dtype, device: of the slot pool.
        gather_blocks: the backend's block copy (`ops.gather_blocks`), used to load misses from
            the DRAM pool: one FlashH2D launch with the Triton backend (entries of -1 skipped).
        partitions: NP, how many LRU partitions (ignored when unlimited).
        resolve: the backend's lookup (`ops.resolve_blocks`); an unlimited cache always uses the
            tensor one (its single partition spans the whole pool).
        claim, install: the same lookup in two halves (`ops.claim_blocks`, `ops.install_blocks`),
            or None: `resolve` whole (an unlimited cache never splits).
        reorder: the split lookup's eviction-order upkeep as a launch of its own
            (`ops.reorder_blocks`), or None: `install` does it.
    """

    @plain_tensors
    def __init__(
        self,
        num_slots: int | None,
        block_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        gather_blocks: Callable[..., None] = reference.gather_blocks,
        partitions: int = 1,
        resolve: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = lru.resolve_,
        claim: Callable[..., tuple[torch.Tensor, ...]] | None = None,
        install: Callable[..., tuple[torch.Tensor, ...]] | None = None,
        reorder: Callable[..., None] | None = None,
    ) -> None:
        self.gather_blocks = gather_blocks
        self.unlimited = num_slots is None
        self.resolve = lru.resolve_ if self.unlimited else resolve
        splits = SPLIT_LOOKUP and not self.unlimited and claim is not None and install is not None
        self.split = (claim, install) if splits else None
        self.reorder = reorder if splits and REORDER_BESIDE else None
        self._install_stream: torch.cuda.Stream | None = None  # made by the first split lookup on CUDA
        self._unsettled = False  # a reorder runs on the install stream that no stream has waited for
        self.block_shape = block_shape
        self.device = device
        self.num_partitions = 1 if self.unlimited else partitions
        per = UNLIMITED_INITIAL_SLOTS if num_slots is None else num_slots // partitions
        if per < 1:
            raise ValueError(
                f"hbm_cache_bytes holds {num_slots} head-blocks, fewer than the {partitions} (sparse layer, KV head) "
                "partitions of the HBM block cache; raise hbm_cache_bytes"
            )
        self.free_ahead = min(FREE_AHEAD, per // 8) if self.split else 0
        self.pool = torch.zeros((self.num_partitions * per, *block_shape), dtype=dtype, device=device)  # (P, 2, S, D)
        self.tables = lru.empty_tables(self.num_partitions, per, 0, device)
        self._counts = torch.zeros(2, dtype=torch.long, device=device)  # blocks looked up, misses
        self.reallocations = 0  # times the pool or a table was reallocated (see TieredBlockStore.epoch)

    @property
    def num_slots(self) -> int:
        """P, the device pool's slots of one head-block each (it grows only when `num_slots` was None)."""
        return self.pool.shape[0]

    @property
    def slots_per_partition(self) -> int:
        """Pp, the slots of each LRU partition (P = NP x Pp)."""
        return self.tables.slots_per_partition

    @property
    def slot_block(self) -> torch.Tensor:
        """(P,) DRAM id held by each slot, -1 free (a view: no dump entry)."""
        return self.tables.slot_block[:-1]

    @property
    def slot_tick(self) -> torch.Tensor:
        """(P,) its partition's clock at each slot's last use, -1 free."""
        return self.tables.slot_tick[:-1]

    @property
    def block_slot(self) -> torch.Tensor:
        """(C,) slot of each tracked DRAM id, -1 when not resident."""
        return self.tables.block_slot[:-1]

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
        if capacity + 1 > self.tables.block_slot.shape[0]:
            self.reallocations += 1
            self._set_tables(block_slot=_grown_with_dump(self.tables.block_slot, capacity))

    def check_fits(self, entries_per_partition: int) -> None:
        """Raise ValueError when a selection of `entries_per_partition` could need more slots than a partition has.

        Decided from the selection's shape, not its content (that would need a host sync): a
        lookup never evicts the blocks it uses itself, so every entry may need its own slot.
        """
        if not self.unlimited and entries_per_partition > self.slots_per_partition:
            raise ValueError(
                f"the HBM block cache has {self.slots_per_partition} slots per (layer, KV head) but one layer's "
                f"selection can need {entries_per_partition}; raise hbm_cache_bytes or lower token_budget / batch size"
            )

    @plain_tensors
    def lookup(
        self,
        block_ids: torch.Tensor,
        dram: BlockPool,
        first_partition: int = 0,
        settle: bool = True,
        entry_slots: bool = True,
    ) -> torch.Tensor | None:
        """Slots holding `block_ids` (B, H, U) (-1 = unused; duplicates allowed), loading the misses.

        KV head h's blocks live in partition `first_partition + h` (all in the one partition of a
        cache built with one). Launches only (no host sync). Returns the slots, (B, H, U), -1
        where unused; the counters `counts()` reads are updated too. `settle=False`: the eviction
        order's upkeep may still run on a side stream after the copy is done (see `reorder`);
        the caller runs `settle()` on its stream once it has queued what reads the slots.
        `entry_slots=False` returns None where that saves a launch: `tables.block_slot` then maps
        every block looked up to its slot, for a reader that needs only a few (the misses).
        """
        if block_ids.dim() != 3:
            raise ValueError(f"block_ids must be (B, H, U), got shape {tuple(block_ids.shape)}")
        self.prepare(tuple(block_ids.shape), dram, first_partition)
        selection = block_ids.to(self.device)
        if self.num_partitions == 1:
            selection, first_partition = selection.reshape(1, 1, -1), 0
        if self.split is not None:
            slots = self._split_lookup(selection, dram, first_partition, entry_slots)
            if settle:
                self.settle()
            return None if slots is None else slots.view(block_ids.shape)
        slots, load_ids, load_slots, load_counts = self.resolve(selection, first_partition, self.tables, self._counts)
        try:
            self.gather_blocks(dram.storage, load_ids, self.pool, load_slots, load_counts)  # the H2D copy
        except BaseException:
            # The tables already call the misses resident: forget them, or a later lookup would
            # hit slots that never received their blocks.
            lru.forget_(load_ids.view(-1), self.tables)
            raise
        return slots.view(block_ids.shape)

    def _split_lookup(
        self, selection: torch.Tensor, dram: BlockPool, first_partition: int, entry_slots: bool
    ) -> torch.Tensor | None:
        """`lookup` in two halves: the claims, then the copy of the early loads beside the install
        (on the install stream, on CUDA), then the late loads' copy, beside the eviction order's
        upkeep where `reorder` runs it. Returns the slots (None without `entry_slots`)."""
        claim, install = self.split
        selection = selection.contiguous()
        self.settle()  # the last lookup's upkeep, where its caller has not waited for it
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        claims = claim(selection, first_partition, self.tables, self._counts)
        try:
            with self._install_side(after=current):
                installed = install(
                    selection, first_partition, self.tables, claims, self.free_ahead,
                    reorder=self.reorder is None, entry_slots=entry_slots,
                )  # fmt: skip
            self.gather_blocks(dram.storage, claims.load_ids, self.pool, claims.load_slots, claims.early_counts)
            if current is not None:
                current.wait_stream(self._install_stream)
            if self.reorder is not None:  # after the event the late copy waits on: beside that copy
                with self._install_side():
                    self.reorder(first_partition, selection.shape[1], self.tables, self.free_ahead)
                self._unsettled = current is not None
            self.gather_blocks(dram.storage, installed.late_ids, self.pool, installed.late_slots, installed.late_counts)
        except BaseException:
            self.settle()  # a queued reorder rewrites the entries `forget_` rewrites
            lru.forget_(claims.load_ids.view(-1), self.tables)  # as in `lookup`
            raise
        return installed.slots

    def _install_side(self, after: torch.cuda.Stream | None = None) -> contextlib.AbstractContextManager:
        """The install stream's context on CUDA (made at first use; ordered after `after`'s work
        when given), no stream elsewhere: there the split lookup's launches run in turn."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._install_stream is None:
            self._install_stream = torch.cuda.Stream(self.device, priority=-1)
        if after is not None:
            self._install_stream.wait_stream(after)
        return torch.cuda.stream(self._install_stream)

    def settle(self) -> None:
        """Order the last lookup's upkeep before whatever the current stream runs next (a no-op
        where none runs beside): after a `lookup(..., settle=False)`, once its readers are queued."""
        if self._unsettled:
            torch.cuda.current_stream(self.device).wait_stream(self._install_stream)
            self._unsettled = False

    def prepare(self, shape: tuple[int, ...], dram: BlockPool, first_partition: int = 0) -> None:
        """The host side of a lookup of a (B, H, U) selection, decided from its shape: refuse one
        that names missing partitions or may not fit, grow an unlimited cache to hold every live
        block (a host-known bound: it never evicts). `lookup` runs it; a replayed capture of a
        lookup runs no Python, so its caller runs this first."""
        batch, heads, width = shape
        if self.num_partitions > 1 and first_partition + heads > self.num_partitions:
            raise ValueError(
                f"partitions {first_partition}..{first_partition + heads - 1} do not exist: "
                f"the cache has {self.num_partitions}"
            )
        self.check_fits(batch * width if self.num_partitions > 1 else batch * heads * width)
        if self.unlimited:
            self._grow(max(dram.num_used, batch * heads * width))

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors a lookup reads or writes by address (what a captured decode step holds)."""
        tables = {f"lru.{name}": t for name, t in vars(self.tables).items()}
        return {"hbm_pool": self.pool, "lookup_counts": self._counts} | tables

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
        self.settle()
        lru.forget_(block_ids.to(self.device).reshape(-1), self.tables)

    def _grow(self, needed: int) -> None:
        """Grow the unlimited cache's one partition to at least `needed` slots."""
        if needed <= self.num_slots:
            return
        new = max(2 * self.num_slots, needed)
        pool = grown(self.pool, new)
        slot_block = _grown_with_dump(self.tables.slot_block, new)
        slot_tick = _grown_with_dump(self.tables.slot_tick, new)
        slot_order = lru.eviction_order(slot_tick[:-1], 1)  # the new slots are free: first
        # Everything allocated before anything is replaced: a failed growth (out of memory) leaves the cache whole.
        self.pool = pool
        self._set_tables(slot_block=slot_block, slot_tick=slot_tick, slot_order=slot_order)
        self.reallocations += 1

    def _set_tables(self, **replaced: torch.Tensor) -> None:
        self.tables = dataclasses.replace(self.tables, **replaced)


def _grown_with_dump(table: torch.Tensor, size: int) -> torch.Tensor:
    """A (size + 1,) table: the old real entries, -1 for the new ones and for the dump entry."""
    if size + 1 <= table.shape[0]:
        return table
    out = table.new_full((size + 1,), -1)
    out[: table.shape[0] - 1] = table[:-1]
    return out
