"""StoreSlot: where a SparseServeCache and its layers find their one TieredBlockStore."""

from __future__ import annotations

import torch

from ..config import SparseServeConfig
from ..ops import get_ops
from .store import TieredBlockStore


class StoreSlot:
    """Holds the store of one cache; built lazily from the first keys, or given (a shared store).

    Layers reach the store through the slot, never through the cache: a layer holding
    `cache._store_for` made every cache a reference cycle (cache -> layers -> bound method ->
    cache), so a cache's DRAM pool (pinned, possibly tens of GiB) was only released at the next
    cyclic garbage collection, and pinning the next pool could fail meanwhile. The slot refers to
    no cache, so `del cache` frees an unshared pool at once.

    Args:
        config: the cache's SparseServeConfig (the store is built from it).
        store: an existing store to share, or None to build one at the first `get`.
        hbm_partitions: the HBM LRU partitions of a store built here (sparse layers x KV heads).
    """

    __slots__ = ("config", "hbm_partitions", "store")

    def __init__(
        self, config: SparseServeConfig, store: TieredBlockStore | None = None, hbm_partitions: int = 1
    ) -> None:
        self.config = config
        self.store = store
        self.hbm_partitions = store.hbm_partitions if store is not None else hbm_partitions

    def get(self, key_states: torch.Tensor) -> TieredBlockStore:
        """The store, built for `key_states`' (B, Hkv, T, D) head_dim, dtype and device on first use."""
        if self.store is None:
            ops = get_ops(self.config.backend, key_states.device)
            self.store = TieredBlockStore(
                self.config, ops, key_states.shape[-1], key_states.dtype, key_states.device, self.hbm_partitions
            )
        return self.store
