"""SparseServeCache: a transformers Cache whose attention layers keep KV in DRAM head-blocks."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ..config import SparseServeConfig
from ..ops import resolve_backend
from . import handoff
from .layer import SparseServeLayer
from .store import TieredBlockStore
from .store_slot import StoreSlot

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


class SparseServeCache(Cache):
    """Tiered KV cache for stock `model.generate(..., past_key_values=cache)`.

    Full-attention layers become `SparseServeLayer`s: every full block goes to host DRAM, the
    device keeps per-block metadata, each row's partial tail block and an LRU cache of selected
    blocks of at most `config.hbm_cache_bytes`. Sliding-window layers (Gemma-3) keep their
    window on the device as in `DynamicCache`; layers in `config.dense_layers` stay dense.

    Args:
        model_config: the model's `PretrainedConfig` (a multimodal config's text config is used).
        config: the SparseServeConfig (defaults when None).
        store: a `TieredBlockStore` to share with other caches (the batching Generator gives every
            request's cache the engine's one store, so `hbm_cache_bytes` bounds the whole engine);
            None creates one at the first `update`. Its config must equal `config`.

    Example:
        >>> cache = SparseServeCache(model.config, SparseServeConfig(token_budget=1024))
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
        >>> cache.stats()["hit_rate"]
    """

    def __init__(
        self, model_config: Any, config: SparseServeConfig | None = None, store: TieredBlockStore | None = None
    ) -> None:
        self.config = config if config is not None else SparseServeConfig()
        if store is not None and store.config != self.config:
            raise ValueError("a shared TieredBlockStore must have been built with this cache's SparseServeConfig")
        self.model_config = model_config.get_text_config()
        model_type = getattr(self.model_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"SparseServeCache supports model types {SUPPORTED_MODEL_TYPES}, not {model_type!r}"
            )
        resolve_backend(self.config.backend, None)  # fail now, not inside the first forward
        layer_types = self._layer_types()
        bad = [i for i in self.config.dense_layers if i >= len(layer_types)]
        if bad:
            raise ValueError(f"dense_layers {bad} are out of range for a model of {len(layer_types)} layers")
        self._slot = StoreSlot(self.config, store)  # shared with the layers; refers to no cache (no cycle)
        super().__init__(layers=[self._make_layer(i, kind) for i, kind in enumerate(layer_types)])
        self._owns_store = store is None  # a shared store's counters belong to its owner
        self._check_hbm_cache(batch=1, itemsize=_dtype_itemsize(getattr(self.model_config, "dtype", None)))

    # ---- construction ----------------------------------------------------------------------

    def _layer_types(self) -> list[str]:
        return attention_layer_types(self.model_config)

    def _make_layer(self, layer_idx: int, kind: str) -> Any:
        if kind == "sliding_attention":
            return DynamicSlidingWindowLayer(sliding_window=self.model_config.sliding_window)
        if kind != "full_attention":
            raise NotImplementedError(f"layer {layer_idx} has attention type {kind!r}, which is not supported")
        if layer_idx in self.config.dense_layers:
            return DynamicLayer()
        return SparseServeLayer(layer_idx, self.config, self._slot.get)

    @property
    def store(self) -> TieredBlockStore | None:
        """The TieredBlockStore of this cache (None until the first `update` when none was given)."""
        return self._slot.store

    def _selection_blocks_per_request(self) -> int:
        """Head-blocks one layer can select for one request (the union over a KV group)."""
        heads = self.model_config.num_attention_heads
        if self.config.selection == "kv_head":
            heads = getattr(self.model_config, "num_key_value_heads", None) or heads
        return heads * self.config.selected_full_blocks

    def _check_hbm_cache(self, batch: int, itemsize: int) -> None:
        if self.config.hbm_cache_bytes is None:
            return
        head_dim = getattr(self.model_config, "head_dim", None) or (
            self.model_config.hidden_size // self.model_config.num_attention_heads
        )
        block_bytes = 2 * self.config.block_size * head_dim * itemsize
        slots = self.config.hbm_cache_bytes // block_bytes
        needed = batch * self._selection_blocks_per_request()
        if slots < needed:
            raise ValueError(
                f"hbm_cache_bytes={self.config.hbm_cache_bytes} holds {slots} head-blocks of {block_bytes} bytes, "
                f"but one layer's selection for {batch} request(s) needs up to {needed}; "
                f"raise hbm_cache_bytes to at least {needed * block_bytes} or lower token_budget"
            )

    # ---- HF Cache contract -------------------------------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate, store (or stage) the new K/V, and hand the layer to the attention function."""
        if layer_idx == 0:
            self._check_new_tokens(key_states)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        handoff.hand_over(layer_idx, keys, layer if isinstance(layer, SparseServeLayer) else None)
        return keys, values

    def _check_new_tokens(self, key_states: torch.Tensor) -> None:
        """Reject bad input at the first layer, before any layer has changed."""
        past = self.get_seq_length()
        limit = getattr(self.model_config, "max_position_embeddings", None)
        if limit is not None and past + key_states.shape[-2] > limit:
            raise ValueError(
                f"{past + key_states.shape[-2]} positions exceed the model's max_position_embeddings ({limit})"
            )
        if self.store is not None and (key_states.dtype, key_states.device) != (self.store.dtype, self.store.device):
            raise ValueError(
                f"this SparseServeCache holds {self.store.dtype} on {self.store.device}, got keys in "
                f"{key_states.dtype} on {key_states.device}; use one cache per model dtype/device"
            )
        if past == 0:
            self._check_hbm_cache(batch=key_states.shape[0], itemsize=key_states.dtype.itemsize)

    def reset(self) -> None:
        """Free every block and forget all rows; the pools stay allocated for reuse."""
        super().reset()
        if self.store is not None and self._owns_store:
            self.store.stats = type(self.store.stats)()

    # ---- moving rows between caches that share a store (the batching Generator) ---------------

    def append_rows(self, other: SparseServeCache) -> None:
        """Move every row of `other` after this cache's rows; `other` is left empty.

        Both caches must share one store (see `store` above). Block references move with the
        rows, so no block is copied or freed.
        """
        if other.store is not self.store:
            raise ValueError("append_rows needs two caches over one shared TieredBlockStore")
        for mine, theirs in zip(self._sparse_layers(), other._sparse_layers()):
            mine.append_rows(theirs)

    def pop_rows(self, rows: list[int]) -> SparseServeCache:
        """Move `rows` (in that order) into a new cache over the same store and return it.

        The remaining rows keep their order. Freeing a request is `cache.pop_rows([i]).reset()`.
        """
        layers = self._sparse_layers()
        if self.store is None:
            raise ValueError("pop_rows needs a cache built with a store (SparseServeCache(..., store=...))")
        moved = SparseServeCache(self.model_config, self.config, store=self.store)
        for mine, theirs in zip(layers, moved._sparse_layers()):
            mine.pop_rows(rows, into=theirs)
        return moved

    # ---- graph-mode decode (graph.DecodeGraphRunner) ---------------------------------------------

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
        full_rows = torch.tensor(rows, device=layers[0].device)
        saved = self.store.save_many([layer.full_tails(full_rows) for layer in layers])
        for layer, ids in zip(layers, saved):
            layer.link_saved_tails(full_rows, ids, table_width)

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """Every cache tensor a captured decode step reads or writes by address (names: "store.x", "layer3.x").

        A CUDA graph replays with the addresses it was captured with: if any of these moves, the
        graph must be recaptured (`graph.DecodeGraphRunner` compares them before every replay).
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
        dense_read_bytes (blocks read back for dense prefill over a past).
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
        counters = store.stats if store else None
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
        }


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


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _dtype_itemsize(dtype: Any) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 2
