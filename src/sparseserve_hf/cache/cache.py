"""SparseServeCache: a transformers Cache whose attention layers keep KV in DRAM head-blocks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ..config import SparseServeConfig
from ..host_memory import check_host_bytes
from ..ops import resolve_backend
from ..scoring import SELECTIONS
from .block_cache import rows_that_fit
from .forward_log import ForwardLog, ModelShape, hand_over
from .grow import geometric_size
from .layer import SparseServeLayer
from .plain import plain_tensors
from .store import LOAD_SUMMARY_KEYS, TieredBlockStore
from .store_slot import StoreSlot

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


class SparseServeCache(Cache):
    """Tiered KV cache for stock `model.generate(..., past_key_values=cache)`.

    Full-attention layers become `SparseServeLayer`s: every full block goes to host DRAM, the
    device keeps per-block metadata, each row's partial tail block and an LRU cache of selected
    blocks of at most `config.hbm_cache_bytes`. Sliding-window layers (Gemma-3) keep their
    window on the device as in `DynamicCache`; layers in `config.dense_layers` stay dense.

    Args:
        model_config: the model's `PretrainedConfig` (a multimodal config's text config is used),
            or the `PreTrainedModel` itself (its `.config` is taken; on CUDA its decode steps
            then replay as CUDA graphs of the whole model, see `generate_graphs` in the
            config). The cache refuses, at layer 0 of a forward and before anything changes, a
            model of another shape (layer count, KV heads, head_dim, layer types,
            max_position_embeddings).
        config: the SparseServeConfig (defaults when None).
        store: a `TieredBlockStore` to share with other caches (the batching Generator gives every
            request's cache the engine's one store, so `hbm_cache_bytes` bounds the whole engine);
            None creates one at the first `update`. Its config must equal `config`.

    Raises:
        TypeError: `model_config`, `config` or `store` of the wrong type.
        ValueError: a config the cache cannot serve (see `_check_sizes`), `dram_bytes` beyond the
            host's available memory.
        NotImplementedError: an unsupported architecture or backend.

    Example:
        >>> cache = SparseServeCache(model.config, SparseServeConfig(token_budget=1024))
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
        >>> cache.stats()["hit_rate"]
    """

    def __init__(
        self, model_config: Any, config: SparseServeConfig | None = None, store: TieredBlockStore | None = None
    ) -> None:
        self.model_config = _text_config(model_config)
        if config is not None and not isinstance(config, SparseServeConfig):
            raise TypeError(f"config must be a SparseServeConfig or None, got {type(config).__name__}")
        if store is not None and not isinstance(store, TieredBlockStore):
            raise TypeError(f"store must be a TieredBlockStore or None, got {type(store).__name__}")
        self.config = config if config is not None else SparseServeConfig()
        if store is not None and store.config != self.config:
            raise ValueError("a shared TieredBlockStore must have been built with this cache's SparseServeConfig")
        model_type = getattr(self.model_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"SparseServeCache supports model types {SUPPORTED_MODEL_TYPES}, not {model_type!r}"
            )
        resolve_backend(self.config.backend, None)  # fail now, not inside the first forward
        self.shape = _model_shape(self.model_config)
        layer_types = list(self.shape.layer_types)
        bad = [i for i in self.config.dense_layers if i >= len(layer_types)]
        if bad:
            raise ValueError(f"dense_layers {bad} are out of range for a model of {len(layer_types)} layers")
        sparse = sparse_layer_indices(self.shape, self.config)
        self.kv_heads = _stored_heads(self.shape.num_kv_heads, store, sparse)  # a rank's share under TP
        partitions = _partition_count(self.kv_heads, sparse)
        self._check_sizes(store, partitions)
        self._slot = StoreSlot(self.config, store, partitions)  # refers to no cache (no cycle)
        if store is not None:
            store.cover_load_rows(partitions)
        super().__init__(layers=[self._make_layer(i, kind, sparse) for i, kind in enumerate(layer_types)])
        self._owns_store = store is None  # a shared store's counters belong to its owner
        self._log = ForwardLog(self.shape, _model_shape, self.model_config)
        self._vacant: set[int] = set()  # rows that hold nothing between rows that do (`take_rows`)
        self._static = False  # inside `static_step`: the hand-offs tell the attention function so
        if store is not None or not _may_be_sharded(self.shape.num_kv_heads):  # else the first keys tell
            self._check_hbm_cache(batch=1, itemsize=_dtype_itemsize(getattr(self.model_config, "dtype", None)))
        self.generate_graphs = None  # the route of `model.generate`'s decode steps (`generate_graphs`)
        if isinstance(model_config, torch.nn.Module) and self.config.generate_graphs:
            from ..generate_graphs import route_generate  # the layer above the cache: it drives the model

            route_generate(model_config, self)

    # ---- construction ----------------------------------------------------------------------

    def _make_layer(self, layer_idx: int, kind: str, sparse: list[int]) -> Any:
        if kind == "sliding_attention":
            return DynamicSlidingWindowLayer(sliding_window=self.model_config.sliding_window)
        if kind != "full_attention":
            raise NotImplementedError(f"layer {layer_idx} has attention type {kind!r}, which is not supported")
        if layer_idx not in sparse:
            return DynamicLayer()
        first_partition = sparse.index(layer_idx) * self.kv_heads  # its KV heads' HBM partitions
        return SparseServeLayer(layer_idx, self.config, self._slot.get, first_partition)

    @property
    def store(self) -> TieredBlockStore | None:
        """The TieredBlockStore of this cache (None until the first `update` when none was given)."""
        return self._slot.store

    def _check_sizes(self, store: TieredBlockStore | None, partitions: int) -> None:
        """Refuse a store or pool that cannot serve this model: a shared store of another head_dim,
        a `dram_bytes` below one head-block or beyond the host's available memory (checked now,
        before the pool is allocated at the first update: a pinned pool past the host's memory
        would otherwise end in the kernel's OOM killer)."""
        head_dim = self.shape.head_dim
        if store is not None and store.dram.block_shape[-1] != head_dim:
            raise ValueError(
                f"the shared store holds head-blocks of head_dim {store.dram.block_shape[-1]}, this model's is {head_dim}"
            )
        if store is not None and store.hbm_partitions not in (1, partitions):
            raise ValueError(
                f"the shared store's HBM cache has {store.hbm_partitions} partitions; this model needs 1 or "
                f"{partitions} (sparse layers x KV heads)"
            )
        dram_bytes = self.config.dram_bytes
        if store is not None or dram_bytes is None:
            return
        itemsize = self._stored_itemsize(_dtype_itemsize(getattr(self.model_config, "dtype", None)))
        block_bytes = 2 * self.config.block_size * head_dim * itemsize
        if dram_bytes < block_bytes:
            raise ValueError(f"dram_bytes={dram_bytes} holds no head-block of {block_bytes} bytes")
        if self.config.offload:
            check_host_bytes(dram_bytes, f"dram_bytes={dram_bytes}", "lower dram_bytes")

    def _stored_itemsize(self, model_itemsize: int) -> int:
        """Bytes per value of a stored block: `kv_dtype`'s, or the model's where it is "auto"."""
        return model_itemsize if self.config.kv_dtype == "auto" else getattr(torch, self.config.kv_dtype).itemsize

    def _check_hbm_cache(self, batch: int, itemsize: int) -> None:
        if self.config.hbm_cache_bytes is None:
            return
        block_bytes = 2 * self.config.block_size * self.shape.head_dim * self._stored_itemsize(itemsize)
        slots = self.config.hbm_cache_bytes // block_bytes
        partitions = self._slot.hbm_partitions
        per_head = selected_blocks_per_kv_head(self.model_config, self.config)
        if rows_that_fit(slots, partitions, per_head) < batch:
            needed = batch * per_head * partitions
            raise ValueError(
                f"hbm_cache_bytes={self.config.hbm_cache_bytes} holds {slots} head-blocks of {block_bytes} bytes, "
                f"{slots // partitions} for each of the {partitions} (sparse layer, KV head) pairs, but one layer's "
                f"selection for {batch} request(s) needs up to {batch * per_head} per KV head; "
                f"raise hbm_cache_bytes to at least {needed * block_bytes} or lower token_budget"
            )

    # ---- HF Cache contract -------------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate, store (or stage) the new K/V, and hand the layer to the attention function.

        Bad input is refused before any layer changes: at layer 0 for the forward as a whole; at
        a later layer (keys of another shape) after undoing the layers this forward updated.
        """
        if layer_idx == 0:  # nothing to undo yet: the log still holds the last forward until `begin`
            self._begin_forward(key_states, value_states)
        try:
            if layer_idx != 0:
                self._check_layer_keys(key_states, value_states, layer_idx)
            self._log.record(self._undo_step(layer_idx))
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            self._log.undo()
            raise
        layer = self.layers[layer_idx]
        hand_over(layer_idx, keys, layer if isinstance(layer, SparseServeLayer) else None, self._log, self._static)
        return keys, values

    def _begin_forward(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Layer 0's part: the checks of the forward as a whole, before any layer changes. Before the
        first keys the cache sizes itself to them (`_adopt_rank_heads`); a prompt reserves DRAM."""
        past = self.get_seq_length()
        if past == 0:
            self._adopt_rank_heads(key_states)
        self._check_layer_keys(key_states, value_states, 0)
        self._check_new_tokens(key_states, past)
        if key_states.shape[-2] > 1:
            self._reserve_blocks(key_states)
        self._log.begin(past, key_states.shape[-2])

    def _adopt_rank_heads(self, key_states: torch.Tensor) -> None:
        """Under tensor parallelism (transformers' `tp_plan`) a rank's attention sees only its share
        of the model's KV heads. Nothing is sized before the first keys arrive, so a cache whose
        first keys carry one rank's share sizes itself to it: the heads it checks and stores, one
        HBM partition per (sparse layer, local KV head), each layer's first partition. Selection
        is per local KV head, so ranks never exchange anything about blocks."""
        if self.store is not None or not isinstance(key_states, torch.Tensor):
            return
        given = key_states.shape[1] if key_states.dim() == 4 else self.kv_heads
        if given == self.kv_heads or not _is_rank_share(self.shape.num_kv_heads, given):
            return  # the same heads, or a mismatch `_check_layer_keys` reports
        self.kv_heads = given
        sparse = sparse_layer_indices(self.shape, self.config)
        self._slot.hbm_partitions = _partition_count(given, sparse)
        for index, layer in enumerate(self.layers):
            if isinstance(layer, SparseServeLayer):
                layer.first_partition = sparse.index(index) * given

    def _reserve_blocks(self, key_states: torch.Tensor) -> None:
        """Before a prompt's first layer: room in a growable DRAM pool for every block the prompt
        fills in every sparse layer (an upper bound) and an eighth more for the decode after it, so
        the pool grows (and is pinned) once per prompt instead of doubling layer after layer.
        Only a prompt (several new tokens) reserves: a decode step's block is the eighth's."""
        batch, _, num_new, _ = key_states.shape
        if self.config.dram_bytes is not None:
            return
        sparse = sum(isinstance(layer, SparseServeLayer) for layer in self.layers)
        if sparse:
            blocks_per_row = num_new // self.config.block_size + 1
            blocks = batch * blocks_per_row * self.kv_heads * sparse
            self._slot.get(key_states).reserve(blocks + blocks // 8)  # and room for decode to go on

    def _check_new_tokens(self, key_states: torch.Tensor, past: int) -> None:
        """Reject bad input at the first layer, before any layer has changed.

        The position limit is applied at layer 0's attention instead (`ForwardLog.check_forward`),
        after the model there is known to be the one this cache was built for; the keys' shape
        is checked for every layer in `update`.
        """
        if self.store is not None and (key_states.dtype, key_states.device) != (self.store.dtype, self.store.device):
            raise ValueError(
                f"this SparseServeCache holds {self.store.dtype} on {self.store.device}, got keys in "
                f"{key_states.dtype} on {key_states.device}; use one cache per model dtype/device"
            )
        if past == 0:
            self._check_hbm_cache(batch=key_states.shape[0], itemsize=key_states.dtype.itemsize)

    def _check_layer_keys(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """Keys and values of one layer must be (B, Hkv, T, D) of this cache's model, for a layer it has."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise ValueError(
                f"layer_idx {layer_idx!r} is out of range: this SparseServeCache was built for a model of "
                f"{len(self.layers)} layers"
            )
        if not isinstance(key_states, torch.Tensor) or not isinstance(value_states, torch.Tensor):
            raise TypeError("key_states and value_states must be tensors")
        expected = (self.kv_heads, self.shape.head_dim)
        if key_states.dim() != 4 or (key_states.shape[1], key_states.shape[3]) != expected:
            raise ValueError(
                f"this SparseServeCache was built for {expected[0]} KV heads of head_dim {expected[1]} "
                f"(B, Hkv, T, D keys), got keys of shape {tuple(key_states.shape)} at layer {layer_idx}; "
                "build one cache per model, SparseServeCache(model.config, ...)"
            )
        if value_states.shape != key_states.shape or value_states.dtype != key_states.dtype:
            raise ValueError(
                f"values {tuple(value_states.shape)} {value_states.dtype} do not match keys "
                f"{tuple(key_states.shape)} {key_states.dtype} at layer {layer_idx}"
            )

    def _undo_step(self, layer_idx: int) -> Callable[[], None]:
        """How to take back the update about to run on layer `layer_idx` (see `ForwardLog`)."""
        layer = self.layers[layer_idx]
        if isinstance(layer, SparseServeLayer):
            return layer.undo_update
        if not layer.is_initialized:
            return lambda: _emptied(layer)  # the update creates the layer's tensors: back to empty
        if type(layer) is DynamicLayer:  # it only appends: cutting back to the old length undoes it
            length = layer.get_seq_length()
            return lambda: _cut_dense(layer, length)
        # A sliding-window layer drops its oldest tokens, so a cut cannot undo it; it replaces its
        # keys and values (torch.cat) without writing into them, so these references (at most a
        # window's worth, let go when the forward ends) are its state before the update.
        before = dict(vars(layer))
        return lambda: _restore(layer, before)

    @plain_tensors
    def reset(self) -> None:
        """Free every block and forget all rows; the pools stay allocated for reuse.

        Every layer is reset even when one fails (its error is raised after the others ran), so
        one bad layer cannot keep the other layers' blocks in use.
        """
        self._log.clear()
        self._vacant = set()
        failure: BaseException | None = None
        for layer in self.layers:
            try:
                layer.reset() if isinstance(layer, SparseServeLayer) else _emptied(layer)
            except Exception as exc:  # noqa: BLE001  raised below, once every layer had its turn
                failure = failure or exc
        if self.store is not None and self._owns_store:
            self.store.reset_stats()
        if failure is not None:
            raise failure

    # ---- a shared prompt prefix (the batching Generator's prefix cache) -------------------------

    def adopt_prefix(self, ids: torch.Tensor) -> None:
        """Make this empty cache one row holding the full blocks `ids` (L, Hkv, m) of every layer,
        already in its store (a prompt prefix another request computed; see `cache.prefix_index`):
        m * block_size positions, each block one reference more. All or nothing.

        Raises:
            ValueError: the cache is not empty, has no store yet, has a layer that is not sparse,
                or `ids` is not (num_layers, kv_heads, m).
        """
        store = self.store
        if store is None or self.get_seq_length() != 0:
            raise ValueError("adopt_prefix needs an empty cache built over a store (SparseServeCache(..., store=...))")
        if any(not isinstance(layer, SparseServeLayer) for layer in self.layers):
            raise ValueError("adopt_prefix needs every layer sparse (no dense_layers, no sliding-window layers)")
        if ids.dim() != 3 or tuple(ids.shape[:2]) != (len(self.layers), self.kv_heads):
            raise ValueError(
                f"prefix ids must be (num_layers={len(self.layers)}, kv_heads={self.kv_heads}, m), got {tuple(ids.shape)}"
            )
        like = torch.empty((1, self.kv_heads, 0, self.shape.head_dim), dtype=store.dtype, device=store.device)
        try:
            for layer, layer_ids in zip(self.layers, ids):
                layer.adopt_blocks(layer_ids, like)
        except BaseException:
            self.reset()  # the layers that adopted give their references back
            raise

    def full_block_ids(self, row: int = 0) -> torch.Tensor:
        """(L, Hkv, n) DRAM ids of `row`'s full blocks in every layer (all sparse), oldest first; n is
        the fewest any layer holds (they agree between forwards). Host tensor."""
        layers = self._sparse_layers()
        count = int(torch.stack([layer.num_blocks[row] for layer in layers]).min())  # one sync
        return torch.stack([layer.block_ids[row, :, :count] for layer in layers]).cpu()

    # ---- moving rows between caches that share a store (the batching Generator) ---------------

    def append_rows(self, other: SparseServeCache) -> None:
        """Move every row of `other` after this cache's rows; `other` is left empty.

        Both caches must share one store (see `store` above). Block references move with the
        rows, so no block is copied or freed. Every layer is checked before any row moves.
        """
        self._check_movable("append_rows", other)
        self._check_no_vacancies("append_rows")
        pairs = list(zip(self._sparse_layers(), other._sparse_layers()))
        for mine, theirs in pairs:
            mine.check_can_append(theirs)
        self._log.clear()
        other._log.clear()
        for mine, theirs in pairs:
            mine.append_rows(theirs)

    def pop_rows(self, rows: list[int]) -> SparseServeCache:
        """Move `rows` (in that order) into a new cache over the same store and return it.

        The remaining rows keep their order. Freeing a request is `cache.pop_rows([i]).reset()`.
        """
        layers = self._sparse_layers()
        self._check_movable("pop_rows")
        if not isinstance(rows, (list, tuple)):
            raise TypeError(f"rows must be a list of row indices, got {type(rows).__name__}")
        rows = list(rows)
        self._check_no_vacancies("pop_rows")
        for layer in layers:
            if layer.is_initialized and rows:
                layer.check_rows(rows)
        self._log.clear()
        moved = SparseServeCache(self.model_config, self.config, store=self.store)
        for mine, theirs in zip(layers, moved._sparse_layers()):
            mine.pop_rows(rows, into=theirs)
        _positions_to_longest_rows(layers + moved._sparse_layers())
        return moved

    # ---- slots: rows that keep their place (the batching Generator's batch cache) ----------------

    @property
    def num_rows(self) -> int:
        """Rows of the cache, vacant slots included (0 before the first forward)."""
        layer = self._sparse_layers()[0]
        return layer.tail.shape[0] if layer.is_initialized else 0

    @property
    def vacant_slots(self) -> list[int]:
        """The rows that hold nothing between rows that do, left by `take_rows`; `place_rows` fills them."""
        return sorted(self._vacant)

    def place_rows(self, other: SparseServeCache, slots: list[int], max_rows: int | None = None) -> None:
        """Move every row of `other` into `slots` of this cache (its row i into slots[i]); `other` is left empty.

        Each slot is vacant or past the last row. The cache grows to `geometric_size` of the rows
        it needs (1, 2, 3, 4, 6, 8, 12, ...: one captured decode step per size), at most
        `max_rows` or the rows it needs: the new rows are vacant. A decode step runs over every
        row; a vacant one stores, selects and loads nothing and counts in no statistic. The rows
        already here stay in their slots, in the same tensors unless the cache grows (more rows,
        a wider block table): a captured step over them stays valid. Block references move with
        the rows. Everything is checked before any row moves.
        """
        self._check_movable("place_rows", other)
        mine, theirs = self._sparse_layers(), other._sparse_layers()
        if not theirs[0].is_initialized:
            return
        count, have = theirs[0].tail.shape[0], self.num_rows
        _check_slots(slots, count)
        taken = [slot for slot in slots if slot < have and slot not in self._vacant]
        if taken:
            raise ValueError(f"place_rows: slots {taken} hold rows; vacant slots are {self.vacant_slots}")
        needed = max(have, max(slots) + 1)
        rows = geometric_size(needed) if max_rows is None else max(needed, min(geometric_size(needed), max_rows))
        for layer, row_layer in zip(mine, theirs):
            layer.check_can_append(row_layer)
        self._log.clear()
        other._log.clear()
        at = torch.tensor(slots, dtype=torch.long, device=theirs[0].device)  # one copy for every layer
        for layer, row_layer in zip(mine, theirs):
            layer.place_rows(row_layer, at, rows)
        self._vacant = (self._vacant | set(range(have, rows))) - set(slots)

    def take_rows(self, slots: list[int]) -> SparseServeCache:
        """Move the rows in `slots` (in that order) into a new cache over the same store and return
        it; those slots become vacant. The other rows stay in their slots, in the same tensors
        unless the cache shrinks: it drops its last rows once a smaller `geometric_size` holds
        every row that holds something. Freeing a request is `cache.take_rows([slot]).reset()`.
        """
        self._check_movable("take_rows")
        layers = self._sparse_layers()
        have = self.num_rows
        _check_slots(slots)
        empty = [slot for slot in slots if slot >= have or slot in self._vacant]
        if empty:
            raise ValueError(
                f"take_rows: slots {empty} hold no row (the cache has {have} rows, vacant {self.vacant_slots})"
            )
        vacant = self._vacant | set(slots)
        used = max((row for row in range(have) if row not in vacant), default=-1) + 1
        rows = 0 if used == 0 else min(have, geometric_size(used))
        self._log.clear()
        moved = SparseServeCache(self.model_config, self.config, store=self.store)
        at = torch.tensor(slots, dtype=torch.long, device=layers[0].device)  # one copy for every layer
        for layer, row_layer in zip(layers, moved._sparse_layers()):
            layer.take_rows(at, into=row_layer, rows=rows)
        self._vacant = {row for row in vacant if row < rows}
        _positions_to_longest_rows(layers + moved._sparse_layers())
        return moved

    def _check_movable(self, verb: str, other: SparseServeCache | None = None) -> None:
        """Raise unless rows can move between this cache and `other` (one without vacant slots), or
        out of this cache when `other` is None."""
        if other is None:
            if self.store is None:
                raise ValueError(f"{verb} needs a cache built with a store (SparseServeCache(..., store=...))")
            return
        if not isinstance(other, SparseServeCache):
            raise TypeError(f"{verb} takes a SparseServeCache, got {type(other).__name__}")
        if other.store is not self.store:
            raise ValueError(f"{verb} needs two caches over one shared TieredBlockStore")
        if other.shape != self.shape:
            raise ValueError(
                f"{verb} needs caches of one model shape: {'; '.join(self.shape.differences(other.shape))}"
            )
        if other._vacant:
            raise ValueError(f"{verb}: the rows to move have vacant slots {other.vacant_slots}")

    def _check_no_vacancies(self, verb: str) -> None:
        """append_rows and pop_rows renumber rows: not over vacant slots (use place_rows / take_rows)."""
        if self._vacant:
            raise ValueError(
                f"{verb} renumbers rows, but the cache has vacant slots {self.vacant_slots}: use place_rows / take_rows"
            )

    # ---- graph-mode decode (graph.StaticDecoder) ---------------------------------------------

    @contextlib.contextmanager
    def static_step(self) -> Iterator[None]:
        """Inside, a decode forward is the static step (`graph.StaticDecoder`): the caller rolled
        every full tail first (`roll_full_tails`) and feeds one real token per row, so each layer's
        commit only appends it, at fixed shapes and with no host decision (a CUDA graph may capture it).
        Each layer's hand-off says so to the attention function (`forward_log.Handoff.static`)."""
        outer, self._static = self._static, True
        try:
            yield
        finally:
            self._static = outer

    @plain_tensors
    def roll_full_tails(self, rows: list[int], table_width: int | None = None) -> None:
        """Save the full tail blocks of `rows` of every layer to DRAM and empty those tails.

        What a decode step does on its own when a row's tail is full, done before the step and for
        all layers in one `TieredBlockStore.save_many` (one allocation, copy, scatter and metadata
        launch), so the step itself has no host decision left and can be captured in a CUDA graph.
        `table_width`: the table width the rows need afterwards, known on the caller's host; None
        reads it from the device (one sync per layer).
        """
        layers = self._sparse_layers()
        if not rows or not layers[0].is_initialized:
            return
        layers[0].check_rows(list(rows))
        _check_table_width(table_width)
        full_rows = torch.tensor(rows, device=layers[0].device)
        widths = [layer.reserve_table(table_width) for layer in layers]  # before the save: linking cannot fail
        tails, profiles = zip(*(layer.full_tails(full_rows) for layer in layers))
        saved = self.store.save_many(list(tails), list(profiles))
        self._log.clear()
        for done, (layer, ids, width) in enumerate(zip(layers, saved, widths)):
            try:
                layer.link_saved_tails(full_rows, ids, width)
            except BaseException:
                for unlinked in saved[done:]:  # linked layers are whole (their tails rolled); the rest let go
                    self.store.free(unlinked)
                raise

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """Every cache tensor a captured decode step reads or writes by address (names: "store.x", "layer3.x").

        A CUDA graph replays with the addresses it was captured with: if any of these moves, the
        graph must be recaptured (`graph.StaticDecoder` compares them before every replay).
        """
        out = {f"store.{name}": t for name, t in self.store.graph_tensors().items()}
        for i, layer in enumerate(self._sparse_layers()):
            out |= {f"layer{i}.{name}": t for name, t in layer.graph_tensors().items()}
        return out

    def _sparse_layers(self) -> list[SparseServeLayer]:
        if not all(isinstance(layer, SparseServeLayer) for layer in self.layers):
            raise NotImplementedError(
                "moving rows between caches needs every layer to be a SparseServeLayer "
                "(no dense_layers, no sliding-window layers)"
            )
        return self.layers

    # ---- reporting -----------------------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        """Memory and transfer counters.

        Keys: hbm_bytes (block cache + metadata + tail blocks + dense layers' KV on the device),
        its parts hbm_block_cache_bytes, hbm_metadata_bytes, hbm_tail_bytes, hbm_dense_layer_bytes;
        dram_bytes (host blocks in use); hits, misses, hit_rate (over blocks looked up in the HBM
        cache); h2d_bytes (== misses x head-block bytes); d2h_bytes (blocks saved to DRAM);
        with offload=False every live block counts in hbm_block_cache_bytes, none in dram_bytes,
        and every lookup hits (no h2d_bytes, no d2h_bytes);
        blocks_selected (unique head-blocks selected, summed over layers and steps);
        dense_read_bytes (blocks read back for dense prefill over a past); and what a budget
        costs (`TieredBlockStore.load_summary`): decode_steps, loaded_tokens_per_kv_head,
        loaded_tokens_p95_over_heads, loaded_fraction, metadata_bytes_read_per_step,
        metadata_fraction (all 0 before a sparse decode step).
        """
        store = self.store
        block_cache = store.block_cache_bytes() if store else 0
        metadata = store.metadata_bytes() if store else 0
        tails = sum(_nbytes(layer.tail) for layer in self.layers if isinstance(layer, SparseServeLayer))
        dense = sum(
            _nbytes(layer.keys) + _nbytes(layer.values)
            for layer in self.layers
            if not isinstance(layer, SparseServeLayer)
        )
        counters = store.read_stats() if store else None
        hits = counters.hits if counters else 0
        misses = counters.misses if counters else 0
        return {
            "hbm_bytes": block_cache + metadata + tails + dense,
            "hbm_block_cache_bytes": block_cache,
            "hbm_metadata_bytes": metadata,
            "hbm_tail_bytes": tails,
            "hbm_dense_layer_bytes": dense,
            "dram_bytes": store.dram_bytes() if store else 0,
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "h2d_bytes": counters.h2d_bytes if counters else 0,
            "d2h_bytes": counters.d2h_bytes if counters else 0,
            "blocks_selected": counters.blocks_selected if counters else 0,
            "dense_read_bytes": counters.dense_read_bytes if counters else 0,
        } | (store.load_summary() if store else dict.fromkeys(LOAD_SUMMARY_KEYS, 0))


def attention_layer_types(text_config: Any) -> list[str]:
    """Each decoder layer's attention type ("full_attention" / "sliding_attention"), as transformers decides it.

    A config's `layer_types` wins (Gemma-3; Qwen2/3 configs derive theirs from `use_sliding_window`
    and `max_window_layers`, so `use_sliding_window=False` gives full layers). Without it,
    transformers makes every layer sliding when `sliding_window` is set: Mistral's forward then
    builds a sliding-window mask and its attention passes the window on, and `DynamicCache(config=...)`
    keeps sliding layers (cache_utils `get_layer_types_and_kwargs`). A Qwen-style config that lacks
    `layer_types` follows the rule its own config class would have applied.
    """
    num_layers = text_config.num_hidden_layers
    types = getattr(text_config, "layer_types", None)
    if types is not None:
        return list(types)[:num_layers]
    window = getattr(text_config, "sliding_window", None)
    if window is None or getattr(text_config, "use_sliding_window", True) is False:
        return ["full_attention"] * num_layers
    first_sliding = getattr(text_config, "max_window_layers", None) or 0  # Qwen: layers below it stay full
    return ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]


def sparse_layer_indices(shape: ModelShape, config: SparseServeConfig) -> list[int]:
    """The layers a SparseServeCache serves sparsely: full-attention layers outside `dense_layers`."""
    return [i for i, kind in enumerate(shape.layer_types) if kind == "full_attention" and i not in config.dense_layers]


def hbm_partitions(model_config: Any, config: SparseServeConfig, kv_heads: int | None = None) -> int:
    """LRU partitions of the HBM block cache a SparseServeCache builds: one per (sparse layer, KV head);
    `kv_heads`: the KV heads a rank holds under tensor parallelism (None: the model's)."""
    shape = _model_shape(model_config)
    return _partition_count(kv_heads or shape.num_kv_heads, sparse_layer_indices(shape, config))


def _partition_count(kv_heads: int, sparse_layers: list[int]) -> int:
    """One LRU partition per (sparse layer, KV head); at least one."""
    return max(1, len(sparse_layers) * kv_heads)


def _stored_heads(model_heads: int, store: TieredBlockStore | None, sparse_layers: list[int]) -> int:
    """KV heads per layer a cache stores: the model's, or one rank's share of them when it shares a
    store built for that share (a tensor-parallel Generator: one partition per local KV head)."""
    if store is None or not sparse_layers or store.hbm_partitions % len(sparse_layers):
        return model_heads
    heads = store.hbm_partitions // len(sparse_layers)
    return heads if _is_rank_share(model_heads, heads) else model_heads


def _may_be_sharded(model_heads: int) -> bool:
    """True where the first keys may carry one rank's share of the heads (a torch.distributed world
    of several processes): the HBM cache's fit is then checked once they have arrived."""
    dist = torch.distributed
    return model_heads > 1 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _is_rank_share(model_heads: int, given: int) -> bool:
    """True when `given` of the model's `model_heads` KV heads is one rank's share: a torch.distributed
    world whose size the split divides (transformers' tensor parallel splits heads evenly)."""
    if given <= 0 or given >= model_heads or model_heads % given:
        return False
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() % (model_heads // given) == 0


def selected_blocks_per_kv_head(model_config: Any, config: SparseServeConfig) -> int:
    """Head-blocks one layer can select per KV head for one request (the union over a KV group)."""
    group = model_config.get_text_config().num_attention_heads // _model_shape(model_config).num_kv_heads
    return SELECTIONS[config.selection].pick_width(config, group)


def _text_config(model_config: Any) -> PretrainedConfig:
    """The text config of a model config or model; TypeError naming the argument for anything else."""
    if isinstance(model_config, PreTrainedModel):
        model_config = model_config.config
    if not isinstance(model_config, PretrainedConfig):
        raise TypeError(
            "model_config must be the model's PretrainedConfig (model.config) or the PreTrainedModel, "
            f"got {type(model_config).__name__}"
        )
    return model_config.get_text_config()


def _model_shape(model_config: Any) -> ModelShape:
    """What a cache is built for: `ModelShape` of a model config's text config."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    for name in ("num_hidden_layers", "num_attention_heads"):
        value = getattr(text, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"the model config's {name} must be a positive int, got {value!r}")
    try:
        return ModelShape.of(text, attention_layer_types(text))
    except AttributeError as exc:
        raise ValueError(f"the model config lacks a field the cache needs: {exc}") from exc


def _positions_to_longest_rows(layers: list[SparseServeLayer]) -> None:
    """After rows moved: each layer holding rows counts its longest row's tokens (rows that moved hold
    no padding), read back once for all of them."""
    holding = [layer for layer in layers if layer.is_initialized]
    if holding:
        longest = torch.stack([layer.row_lengths().max() for layer in holding]).tolist()
        for layer, length in zip(holding, longest):
            layer.num_positions = length


def _check_slots(slots: object, count: int | None = None) -> None:
    """Raise unless `slots` is a list of distinct non-negative int rows (`count` of them when given)."""
    if not isinstance(slots, (list, tuple)):
        raise TypeError(f"slots must be a list of row indices, got {type(slots).__name__}")
    count = len(slots) if count is None else count
    if (
        len(slots) != count
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in slots)
        or len(set(slots)) != len(slots)
    ):
        raise ValueError(f"slots {slots!r} are not {count} distinct non-negative int row indices")


def _check_table_width(table_width: object) -> None:
    if table_width is not None and (
        not isinstance(table_width, int) or isinstance(table_width, bool) or table_width <= 0
    ):
        raise ValueError(f"table_width must be a positive int or None, got {table_width!r}")


def _emptied(layer: Any) -> None:
    """Reset a dense or sliding-window layer to uninitialized, its tensors dropped.

    transformers 5.17's `DynamicLayer.reset` only zeroes them, keeping their length (so
    `get_seq_length` and the device bytes would survive a reset); later versions drop them.
    """
    layer.reset()
    layer.keys = layer.values = None
    layer.is_initialized = False


def _cut_dense(layer: DynamicLayer, length: int) -> None:
    """Cut a DynamicLayer back to its first `length` positions (what it held before an update)."""
    if layer.is_initialized and layer.get_seq_length() > length:
        layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


def _restore(layer: Any, before: dict[str, Any]) -> None:
    """Put back a layer's attributes as they were (references taken before an update)."""
    vars(layer).clear()
    vars(layer).update(before)


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _dtype_itemsize(dtype: Any) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 2
