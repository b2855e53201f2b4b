"""TieredBlockStore: the DRAM pool, per-block metadata and the HBM block cache of one cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import SparseServeConfig
from ..layer_graphs import LayerGraphs
from ..numa import device_node
from ..ops import BlockOps, block_copy, reference
from ..ops.flash_d2h import FlashD2HSaver
from ..scoring import SCORERS
from .block_cache import HbmBlockCache
from .block_pool import BlockPool
from .device_blocks import DeviceBlocks
from .grow import grown
from .plain import plain_tensors
from .resident import ResidentBlocks

LOAD_SUMMARY_KEYS = (
    "decode_steps",
    "loaded_tokens_per_kv_head",
    "loaded_tokens_p95_over_heads",
    "loaded_fraction",
    "metadata_bytes_read_per_step",
    "metadata_fraction",
)


@dataclass
class TransferStats:
    """Counters of one SparseServeCache since it was created or reset."""

    hits: int = 0
    misses: int = 0
    blocks_selected: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    dense_read_bytes: int = 0


class TieredBlockStore:
    """Head-blocks of every sparse layer and request: saved to DRAM, scored from device-resident
    metadata, and fetched into the HBM block cache when selected.

    Transfers go through the backend's ops: misses load with `ops.gather_blocks` (FlashH2D with
    Triton), saves with `ops.scatter_blocks` (a UVA scatter with Triton) or, with
    `config.save_path="flash_d2h"`, through a `FlashD2HSaver` (one D2H copy + CPU-thread scatter).
    `config.transfer="copy"` swaps in one `copy_` per block for both. With `config.offload=False`
    the pool itself is on the device and `hbm` is a `ResidentBlocks`: every lookup hits.
    With `config.kv_dtype` an 8-bit float, blocks are quantized as they are saved (`block_scales`
    keeps each one's key and value scales on the device), move and sit in the caches as bytes,
    and are dequantized by the decode kernel (given each entry's scales) and by `read`.

    Args:
        config: the cache's SparseServeConfig (offload, transfer, save_path and kv_dtype are read here).
        ops: the backend op set.
        head_dim, dtype, device: of the model's KV.
        hbm_partitions: LRU partitions of a fixed-size HBM block cache: sparse layers x KV heads
            gives each (layer, KV head) its own (what a cache builds); 1 shares one LRU.
    """

    @plain_tensors
    def __init__(
        self,
        config: SparseServeConfig,
        ops: BlockOps,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        hbm_partitions: int = 1,
    ) -> None:
        _check_store_args(config, ops, head_dim, dtype)
        if not isinstance(hbm_partitions, int) or isinstance(hbm_partitions, bool) or hbm_partitions < 1:
            raise ValueError(f"hbm_partitions must be a positive int, got {hbm_partitions!r}")
        self.hbm_partitions = hbm_partitions
        self.config = config
        self.ops = block_copy.with_copy_transfers(ops) if config.transfer == "copy" else ops
        device = torch.device(device)
        self.dtype = dtype  # the model's KV (what `update` receives and `read` returns)
        self.kv_dtype = reference.kv_storage_dtype(config.kv_dtype, dtype)  # what full blocks are stored in
        self.device = device
        block_shape = (2, config.block_size, head_dim)
        self.dram, self.hbm = self._tiers(block_shape)
        self.block_bytes = self.dram.block_bytes
        # Decode attends the resident blocks while the lookup runs (`fetch_beside`), where the
        # backend splits its attention (`ops.begin_decode`) and an LRU cache sits before the pool.
        self.lookup_beside = config.lookup_beside_attention and config.offload and self.ops.begin_decode is not None
        self._lookup_stream: torch.cuda.Stream | None = None  # made by the first lookup beside attention
        self.saver = FlashD2HSaver(device) if config.save_path == "flash_d2h" else None
        self._save_stream: torch.cuda.Stream | None = None  # made by the first save beside compute
        self._saves_beside: torch.cuda.Event | None = None  # the newest one not yet waited for
        self.scorer = SCORERS[config.metadata]  # what a block's metadata is and how a step scores it
        # whether a decode step keeps its exact per-block numbers for the next step's scorer
        self.feeds_back = self.scorer.uses_feedback(config)
        meta_dtype = self.scorer.stored_dtype(config.metadata_dtype, dtype, torch.device(device))
        self.metadata = torch.zeros(
            (0, config.metadata_vectors, head_dim), dtype=meta_dtype, device=device
        )  # (C, M, D)
        # (C, 2) fp32 key and value scales of each 8-bit DRAM block (`ops.reference.quantize_blocks`);
        # None when blocks keep the model's dtype.
        self.block_scales = None if self.kv_dtype == dtype else torch.ones((0, 2), dtype=torch.float32, device=device)
        self._stats = TransferStats()
        # Per HBM partition (sparse layer x KV head): what decode steps read (`ops.reference.account_loads`),
        # summed on the device; `load_summary` reads it.
        self.load_totals = torch.zeros((hbm_partitions, reference.LOAD_COUNTERS), dtype=torch.long, device=device)
        self._reallocations = 0
        self._track_capacity()
        # A benchmark and test seam, None in normal use: a callable (layer_idx, num_blocks (B,),
        # width U) -> (picked, valid), each (B, Hkv, U), that replaces the blocks each KV head loads
        # after scoring and top-k have run (e.g. a recorded trace of a real model's selections, so
        # a random-weight model shows a real model's locality). Every query head then attends all
        # of its KV head's loaded blocks. It must be CUDA-graph safe (device ops only, no sync).
        # It is part of `graph_state`: a graph captured under another override replays its launches.
        self.selection_override: Callable[[int, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None
        # A seam for blocks held only to be found again (the Generator's prefix cache): called with
        # the blocks a save lacks before the pool grows or refuses, it frees what it can spare.
        self.reclaimer: Callable[[int], int] | None = None
        # Eager decode steps replay each layer's captured attention (None: launched op by op).
        self.layer_graphs = LayerGraphs(self) if _captures_layers(config, self.ops, device) else None

    def _tiers(self, block_shape: tuple[int, int, int]) -> tuple[BlockPool, DeviceBlocks]:
        """The block pool and the device cache in front of it (none needed when the pool is on the device)."""
        config, device = self.config, self.device
        if not config.offload:
            dram = BlockPool(block_shape, self.kv_dtype, config.dram_bytes, pin=False, device=device)
            return dram, ResidentBlocks(dram)
        pin = device.type == "cuda"  # on the GPU's NUMA node, where the host has several
        dram = BlockPool(
            block_shape, self.kv_dtype, config.dram_bytes, pin, numa_node=device_node(device) if pin else None
        )
        num_slots = None if config.hbm_cache_bytes is None else config.hbm_cache_bytes // dram.block_bytes
        hbm = HbmBlockCache(
            num_slots,
            block_shape,
            self.kv_dtype,
            device,
            self.ops.gather_blocks,
            self.hbm_partitions,
            self.ops.resolve_blocks,
            self.ops.claim_blocks,
            self.ops.install_blocks,
            self.ops.reorder_blocks,
        )
        return dram, hbm

    @plain_tensors
    def save(
        self, blocks: torch.Tensor, beside_compute: bool = False, profile: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Save (n, 2, S, D) full blocks to DRAM, record their metadata; returns their ids (n,).
        `profile`: (n, D) each block's query profile, for a scorer that weighs channels by it.

        `beside_compute`: on CUDA with the pool in pinned host memory, the copy runs on a
        high-priority side stream, so the compute launched after it (a prefill's next layer) does
        not wait for PCIe; every later reader of the pool waits for it on the device
        (`wait_for_saves`). A prompt's saves take it; a decode step's stay on the current stream.

        All or nothing: when any step after the allocation fails, the ids go back to the pool
        before the error propagates (no table refers to them yet, so nothing else ever would).
        """
        lacking = blocks.shape[0] - (self.dram.capacity - self.dram.num_used)
        if lacking > 0 and self.reclaimer is not None:  # cached prefixes go before the pool grows
            lacking -= self.reclaimer(lacking)
        if lacking > 0:
            self._drain()  # the pool may be reallocated: no save may still be writing the old one
        ids = self.dram.allocate(blocks.shape[0])
        if ids is None:
            raise ValueError(
                f"dram_bytes={self.config.dram_bytes} is full ({self.dram.capacity} blocks of "
                f"{self.block_bytes} bytes); raise dram_bytes or set it to None to grow"
            )
        try:
            return self._write(blocks, ids, beside_compute, profile)
        except BaseException:
            self._release_unsaved(ids)
            raise

    @plain_tensors  # a prompt under torch.inference_mode: the grown pool must stay usable outside it
    def reserve(self, count: int) -> None:
        """Room for `count` more blocks in DRAM at once (a growable pool; a fixed one is left as it is)."""
        if not self.dram.must_grow_for(count):
            return
        self._drain()  # the pool is reallocated: no save may still be writing the old one
        self.dram.reserve(count)
        self._track_capacity()

    def _write(
        self, blocks: torch.Tensor, ids: torch.Tensor, beside_compute: bool = False, profile: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Copy `blocks` into the allocated DRAM `ids` (n,) and record their metadata (and their
        scales, for 8-bit blocks); returns the ids on the device."""
        self._track_capacity()
        # One host-to-device copy of the ids, not one per use. On CUDA through pinned memory,
        # asynchronously: a copy from pageable memory would wait for all the work queued before it.
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            device_ids = ids.pin_memory().to(self.device, non_blocking=True)
        else:
            device_ids = ids.to(self.device)
        stored = blocks
        if self.block_scales is not None:
            stored, scales = reference.quantize_blocks(blocks, self.kv_dtype)
            self.block_scales[device_ids] = scales
        if self.saver is not None:
            self.saver.save(stored, self.dram.storage, ids)
        elif beside_compute and self._saves_can_go_beside():
            self._scatter_beside(stored, device_ids)
        else:
            # Ordered after any save still running beside: freed ids are handed out again, and the
            # older copy must not land on top of this one.
            self.wait_for_saves()
            self.ops.scatter_blocks(stored, self.dram.storage, device_ids)
        config = self.config
        self.metadata[device_ids] = self.scorer.summarize(self.ops, blocks[:, 0], config, self.metadata.dtype, profile)
        if self.config.offload:  # without offload the blocks never left the device
            self._stats.d2h_bytes += blocks.shape[0] * self.block_bytes
        return device_ids

    def _saves_can_go_beside(self) -> bool:
        """A side-stream save needs CUDA, a host pool (a device pool's copy is no PCIe wait) and no
        capture in progress (a captured step orders its own work)."""
        return self.device.type == "cuda" and self.config.offload and not torch.cuda.is_current_stream_capturing()

    def _scatter_beside(self, blocks: torch.Tensor, device_ids: torch.Tensor) -> None:
        """`ops.scatter_blocks` on the save stream, after what the current stream has queued."""
        if self._save_stream is None:
            self._save_stream = torch.cuda.Stream(self.device, priority=-1)  # its few programs start first
        stream = self._save_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # the blocks are written there
        with torch.cuda.stream(stream):
            self.ops.scatter_blocks(blocks, self.dram.storage, device_ids)
        # The allocator must not hand the blocks' or ids' memory to the current stream while the copy reads it.
        blocks.record_stream(stream)
        device_ids.record_stream(stream)
        self._saves_beside = stream.record_event()

    def wait_for_saves(self) -> None:
        """Order every save before what the current stream runs next: a device-side wait for the
        side-stream saves, a host wait for FlashD2H's CPU threads. Readers of the pool call it first.

        A CUDA graph capture cannot wait on an event recorded outside it, so a capture skips the
        wait: the capturing callers run it before they begin (`prepare_fetch`, the step's warm-up)."""
        if self.saver is not None:
            self.saver.wait()
        if self._saves_beside is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_event(self._saves_beside)
            self._saves_beside = None

    def _release_unsaved(self, ids: torch.Tensor) -> None:
        """Give the ids of a failed save back. A FlashD2H scatter of them may still be queued: it
        must land before the ids can be handed out again, or it would overwrite their next blocks."""
        if self.saver is not None:
            try:
                self.saver.wait()
            except Exception:  # noqa: BLE001, S110  the save's own error is the one to report
                pass
        self.dram.free(ids)

    @plain_tensors
    def save_many(
        self, groups: list[torch.Tensor], profiles: list[torch.Tensor | None] | None = None
    ) -> list[torch.Tensor]:
        """`save` for several (n_i, 2, S, D) groups at once (e.g. one per layer); returns each group's ids.

        One allocation, one id copy, one scatter and one metadata launch for all groups instead of
        one of each per group: the graph-mode decode step saves every layer's full tails this way.
        Ids come out as consecutive `save` calls in the same order would give them. `profiles`: each
        group's (n_i, D) query profiles (as `save`'s), or None.
        """
        joined = None if profiles is None or profiles[0] is None else torch.cat(profiles)
        ids = self.save(torch.cat(groups), profile=joined)
        return list(ids.split([group.shape[0] for group in groups]))

    @plain_tensors
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """(n, 2, S, D) blocks on the device, straight from DRAM (the dense path's past)."""
        self.wait_for_saves()
        ids = ids.reshape(-1).to(self.device)
        out = torch.empty((ids.numel(), *self.dram.block_shape), dtype=self.kv_dtype, device=self.device)
        self.ops.gather_blocks(self.dram.storage, ids, out, torch.arange(ids.numel(), device=self.device))
        self._stats.dense_read_bytes += ids.numel() * self.block_bytes
        if self.block_scales is not None:
            out = reference.dequantize_blocks(out, self.block_scales[ids], self.dtype)
        return out

    @plain_tensors
    def read_tokens(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Full blocks `ids` (Hkv, n) into `out` (2, Hkv, W, D) in token order (W a multiple of S):
        head h's block j lands at out[:, h, j*S : (j+1)*S], its keys in out[0], values in out[1].

        A block is (2, S, D): its keys and its values are each S x D contiguous, and so is their
        place in `out`, so one gather of half-blocks writes them where attention reads them (no
        (n, 2, S, D) copy to permute). 8-bit blocks take `read` (their dequantization) instead.
        """
        num_kv_heads, count = ids.shape
        if count == 0:
            return
        size, head_dim = self.dram.block_shape[1:]
        width = out.shape[2] // size  # blocks of room per head
        if self.block_scales is not None:
            blocks = self.read(ids).view(num_kv_heads, count, 2, size, head_dim)
            out[:, :, : count * size] = blocks.permute(2, 0, 1, 3, 4).reshape(2, num_kv_heads, count * size, head_dim)
            return
        self.wait_for_saves()
        ids = ids.to(self.device)
        heads, blocks = torch.arange(num_kv_heads, device=self.device), torch.arange(count, device=self.device)
        place = heads[:, None] * width + blocks  # (Hkv, n): each block's keys' half-block place in `out`
        # Half-block c of the pool is block c // 2's keys (c even) or values (c odd).
        src = torch.stack((2 * ids, 2 * ids + 1))  # (2, Hkv, n)
        dst = torch.stack((place, place + num_kv_heads * width))  # (2, Hkv, n): values after every head's keys
        halves = self.dram.storage.view(-1, size, head_dim)  # (2C, S, D)
        self.ops.gather_blocks(halves, src.flatten(), out.view(-1, size, head_dim), dst.flatten())
        self._stats.dense_read_bytes += ids.numel() * self.block_bytes

    @plain_tensors
    def fetch(self, block_ids: torch.Tensor, first_partition: int = 0) -> torch.Tensor:
        """HBM slots for a selection (B, Hkv, U) (-1 = unused; rows may share blocks), loading misses.

        KV head h's blocks live in HBM partition `first_partition + h` (a layer's first one).
        Same shape out. Launches only, no host sync (`HbmBlockCache.lookup`); the hit/miss
        counters stay on the device until `stats` is read.
        """
        self.wait_for_saves()
        return self.hbm.lookup(block_ids, self.dram, first_partition)

    @plain_tensors
    def fetch_beside(
        self,
        table: torch.Tensor,
        picked: torch.Tensor,
        valid: torch.Tensor,
        first_partition: int = 0,
        reads: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], torch.Tensor]]:
        """`fetch` of the picked blocks that lets attention start before it ends.

        Args:
            table: (B, Hkv, N) each row's DRAM ids; picked, valid: (B, Hkv, U) the blocks each KV
                head loads, as indices into its row of the table, and which of them are real.
            first_partition: KV head h's blocks live in HBM partition `first_partition + h`.
            reads: the rows' (num_blocks, tail_len), each (B,), to count what the step reads
                (`account`) in the same launch; None counts nothing.
        Returns:
            block_ids: (B, Hkv, U) their DRAM ids, -1 where not valid.
            resident: (B, Hkv, U) the slots of those already in the HBM cache, -1 elsewhere.
            join: makes the current stream wait for the lookup and returns the HBM cache's block ->
                slot table (`lru.LruTables.block_slot`), which then holds every picked block's slot.
                The lookup (LRU update, victims, the copy of the misses) runs on CUDA on a
                high-priority side stream, elsewhere at once. It never evicts a block its selection
                uses, so the resident slots keep their blocks meanwhile.
        Launches only, no host sync. The lookup's trailing upkeep may still run when `join`
        returns: the caller runs `settle()` once it has queued the attention that reads the slots.
        """
        self.wait_for_saves()
        self.hbm.prepare(tuple(picked.shape), self.dram, first_partition)  # may grow the tables: first
        count = None if reads is None else self._load_count(first_partition, picked.shape[1], *reads)
        block_ids, resident = self.ops.picked_blocks(table, picked, valid, self.hbm.tables, count)
        main = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if main is None:
            self.fetch(block_ids, first_partition)
            return block_ids, resident, lambda: self.hbm.tables.block_slot
        if self._lookup_stream is None:
            self._lookup_stream = torch.cuda.Stream(self.device, priority=-1)  # its few programs start first
        side = self._lookup_stream
        side.wait_stream(main)  # the selection is written there
        with torch.cuda.stream(side):
            self.hbm.lookup(block_ids, self.dram, first_partition, settle=False, entry_slots=False)

        def join() -> torch.Tensor:
            main.wait_stream(side)
            return self.hbm.tables.block_slot

        return block_ids, resident, join

    def settle(self) -> None:
        """Order the last `fetch_beside`'s trailing upkeep (the HBM cache's eviction order, where it
        runs beside the copy) before whatever the current stream runs next."""
        self.hbm.settle()

    def scales_of(self, block_ids: torch.Tensor) -> torch.Tensor | None:
        """8-bit blocks: the key and value scales of each entry of `block_ids` (B, Hkv, U), as
        (B, Hkv, U, 2) (-1 entries read block 0's, unused); None where blocks keep the model's dtype."""
        return None if self.block_scales is None else self.block_scales[block_ids.clamp(min=0)]

    def prepare_fetch(self, shape: tuple[int, ...], first_partition: int = 0) -> None:
        """What `fetch` of a (B, Hkv, U) selection does on the host, without the launches: wait for
        asynchronous saves, check and grow the device cache (a captured fetch runs no Python)."""
        self.wait_for_saves()
        self.hbm.prepare(shape, self.dram, first_partition)

    @property
    def epoch(self) -> int:
        """Changes whenever a tensor the decode step reads or writes was reallocated: the DRAM pool
        and the metadata when the pool grows, the HBM slot pool and tables when an unlimited cache
        grows. A CUDA graph captured at another epoch holds stale addresses and must be recaptured."""
        return self._reallocations + self.hbm.reallocations

    def graph_state(self) -> tuple:
        """The epoch, the selection override and the address of every tensor a captured step holds
        (`graph_tensors`): a graph captured at another state points at stale memory, or replays
        another override's launches, and must be captured again."""
        return self.epoch, self.selection_override, tuple(t.data_ptr() for t in self.graph_tensors().values())

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """The store's tensors a captured decode step reads or writes by address."""
        own = {"dram": self.dram.storage, "metadata": self.metadata, "load_totals": self.load_totals}
        if self.block_scales is not None:
            own["block_scales"] = self.block_scales
        return own | self.hbm.graph_tensors()

    @plain_tensors
    def read_stats(self) -> TransferStats:
        """The counters, with the lookups the device has counted since the last read folded in (one
        host sync; the device's counts start again from zero)."""
        looked_up, misses = self.hbm.counts()
        self._stats.blocks_selected += looked_up
        self._stats.misses += misses
        self._stats.hits += looked_up - misses
        self._stats.h2d_bytes += misses * self.block_bytes
        return self._stats

    @plain_tensors
    def reset_stats(self) -> None:
        """Every counter from zero: the host's, the device's lookup counts and the load totals."""
        self.hbm.counts()  # drop what the device counted so far
        self.load_totals.zero_()  # in place: a captured step adds into this very tensor
        self._stats = TransferStats()

    def account(
        self, first_partition: int, valid: torch.Tensor, num_blocks: torch.Tensor, tail_len: torch.Tensor
    ) -> None:
        """Count one layer's decode reads: valid (B, Hkv, U) loaded blocks, num_blocks / tail_len (B,).

        The counters of KV head h are row `first_partition + h` (`cover_load_rows` made them exist)."""
        totals = self.load_totals[first_partition : first_partition + valid.shape[1]]
        self.ops.account_loads(totals, valid, num_blocks, tail_len, self.config.block_size)

    def _load_count(
        self, first_partition: int, heads: int, num_blocks: torch.Tensor, tail_len: torch.Tensor
    ) -> reference.LoadCount:
        """Where KV heads first_partition.. add a step's reads (the rows of `load_totals` `account` adds to)."""
        totals = self.load_totals[first_partition : first_partition + heads]
        return reference.LoadCount(totals, num_blocks, tail_len, self.config.block_size)

    def cover_load_rows(self, rows: int) -> None:
        """Make the load counters hold `rows` (sparse layers x KV heads of a cache sharing this store;
        an unlimited HBM cache has fewer partitions). Called when a cache is built, never in a step,
        so a captured step's counters never move."""
        if rows > self.load_totals.shape[0]:
            self.load_totals = grown(self.load_totals, rows)
            self._reallocations += 1

    @plain_tensors
    def load_summary(self) -> dict[str, float | int]:
        """What the decode steps read since the cache was created or reset (one host sync).

        decode_steps: decode steps of the busiest sparse layer; loaded_tokens_per_kv_head: tokens
        attention read (loaded blocks + tail) per KV head and live row, averaged over steps, sparse
        layers, KV heads and rows; loaded_tokens_p95_over_heads: the 95th percentile over
        (layer, KV head) of that head's own average; loaded_fraction: the tokens read over the
        tokens in the cache, summed over the same; metadata_bytes_read_per_step: metadata scored
        per step (every full block's, all sparse layers); metadata_fraction: that over the dense
        KV bytes of the same tokens.
        """
        totals = self.load_totals.cpu().double()  # (partitions, 5)
        loaded, context, rows, scored, calls = totals.unbind(dim=1)
        steps = int(calls.max()) if calls.numel() else 0
        used = rows > 0
        per_head = loaded[used] / rows[used]
        meta_read = float(scored.sum()) * self.metadata.shape[1] * self.metadata.shape[2] * self.metadata.element_size()
        kv_read = float(context.sum()) * self.block_bytes / self.config.block_size  # K and V of each token
        return {
            "decode_steps": steps,
            "loaded_tokens_per_kv_head": float(loaded.sum() / rows.sum()) if used.any() else 0.0,
            "loaded_tokens_p95_over_heads": float(per_head.quantile(0.95)) if used.any() else 0.0,
            "loaded_fraction": float(loaded.sum() / context.sum()) if context.sum() > 0 else 0.0,
            "metadata_bytes_read_per_step": meta_read / steps if steps else 0.0,
            "metadata_fraction": meta_read / kv_read if kv_read else 0.0,
        }

    @plain_tensors
    def retain(self, ids: torch.Tensor) -> None:
        """One more reference to each block in `ids` (-1 entries ignored)."""
        self.dram.retain(ids[ids >= 0])

    @plain_tensors
    def free(self, ids: torch.Tensor) -> int:
        """Drop one reference to each block in `ids` (-1 ignored); unreferenced blocks leave both
        tiers. Returns how many blocks that released.

        The HBM cache forgets them first: a block id back on the free list while a slot still
        claims it would serve its next owner stale data (forgetting a block that stays is harmless).
        """
        ids = ids[ids >= 0]
        self.hbm.invalidate(self.dram.releasing(ids))
        return int(self.dram.free(ids).numel())

    def block_cache_bytes(self) -> int:
        """Bytes of blocks in device memory: the HBM cache's, or every live block's with offload=False."""
        return self.hbm.num_resident * self.block_bytes

    def dram_bytes(self) -> int:
        """Bytes of live blocks in host DRAM (0 with offload=False: the pool is on the device)."""
        return self.dram.num_used * self.block_bytes if self.config.offload else 0

    def metadata_bytes(self) -> int:
        """Bytes of the device metadata of every live block."""
        return self.dram.num_used * self.metadata[:1].numel() * self.metadata.element_size()

    def _drain(self) -> None:
        """Every save, asynchronous or in flight on the GPU (UVA writes), has reached the pool."""
        self.wait_for_saves()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # it waited for the side stream's saves

    def _track_capacity(self) -> None:
        if self.metadata.shape[0] < self.dram.capacity:  # the pool grew (or was just created)
            self._reallocations += 1
        self.metadata = grown(self.metadata, self.dram.capacity)
        if self.block_scales is not None:
            self.block_scales = grown(self.block_scales, self.dram.capacity, fill=1.0)
        self.hbm.track_blocks(self.dram.capacity)


def _captures_layers(config: SparseServeConfig, ops: BlockOps, device: torch.device) -> bool:
    """Whether a layer's decode attention can be captured: CUDA, kernels that never sync."""
    return (
        config.layer_graphs
        and device.type == "cuda"
        and ops.name in ("triton", "flash")
        and config.transfer == "kernel"
    )


def _check_store_args(config: object, ops: object, head_dim: object, dtype: object) -> None:
    """TypeError / ValueError naming the argument, before anything is allocated."""
    if not isinstance(config, SparseServeConfig):
        raise TypeError(f"config must be a SparseServeConfig, got {type(config).__name__}")
    if not isinstance(ops, BlockOps):
        raise TypeError(f"ops must be a BlockOps (sparseserve_hf.ops.get_ops), got {type(ops).__name__}")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
