"""PrefixCache: the Generator's side of prefix reuse (`SparseServeConfig.prefix_caching`).

Three moments of a request's life touch it:
- `adopt`, when its prefill starts: the longest cached chain its prompt starts with goes into its
  fresh cache, and the prefill runs only over the rest, at least two tokens (prefill must compute
  the last one's logits, and one token over a past would run as a sparse decode step, not as the
  dense prefill an unshared request gets);
- `remember`, when its prompt is in (and again when it ends, with its output): its full blocks
  join the index, so the next request over the same text finds them;
- `forget`, when it ends: the entries it adopted may be reclaimed again.
The index holds its blocks only in pool room no request needs: the store calls `reclaim` before
a save would grow or overflow the pool.
"""

from __future__ import annotations

import torch

from ..cache import SparseServeCache
from ..cache.prefix_index import PrefixEntry, PrefixIndex
from ..cache.store import TieredBlockStore

MIN_PREFILL_TOKENS = 2  # left to prefill after a cached prefix (see the module docstring)


class PrefixCache:
    """Prefix reuse for one engine's store.

    Args:
        store: the engine's TieredBlockStore (its `reclaimer` is set to this index's `reclaim`).
        block_size: tokens per block.
    """

    def __init__(self, store: TieredBlockStore, block_size: int) -> None:
        self.index = PrefixIndex(store, block_size)
        self.block_size = block_size
        self._adopted: dict[int, list[PrefixEntry]] = {}  # request id -> the entries its cache took
        self.reused_tokens = 0  # prompt tokens whose prefill a cached prefix saved, summed
        self.lookups = self.hits = 0  # requests that looked, requests that adopted a prefix
        self._looked: set[int] = set()  # the requests counted in `lookups` (one may look again while it waits)
        store.reclaimer = self.index.reclaim

    def adopt(self, request_id: int, prompt: tuple[int, ...], cache: SparseServeCache) -> tuple[int, int]:
        """Put the longest cached prefix of `prompt` that leaves at least two of its tokens into the
        empty `cache`; returns the prompt tokens it covers and the head-blocks it adopted (0, 0
        when nothing matched)."""
        if request_id not in self._looked:
            self._looked.add(request_id)
            self.lookups += 1
        entries = self.index.match(list(prompt[: len(prompt) - MIN_PREFILL_TOKENS]))
        if not entries:
            return 0, 0
        ids = _stacked(entries)
        cache.adopt_prefix(ids)
        self.index.acquire(entries)
        self._adopted[request_id] = entries
        self.hits += 1
        reused = len(entries) * self.block_size
        self.reused_tokens += reused
        return reused, ids.numel()

    def remember(self, tokens: list[int], cache: SparseServeCache) -> None:
        """Index the full blocks `cache` (one row) holds for `tokens`, the tokens whose KV it holds."""
        self.index.insert(tokens, cache.full_block_ids(0))

    def forget(self, request_id: int) -> None:
        """The request ended: the entries it adopted are reclaimable again (once nobody else uses them)."""
        self.index.release(self._adopted.pop(request_id, []))
        self._looked.discard(request_id)

    def totals(self) -> dict[str, int]:
        """What `Generator.metrics()` reports about prefix reuse."""
        return {
            "prefix_lookups": self.lookups,
            "prefix_hits": self.hits,
            "prefix_reused_tokens": self.reused_tokens,
            "prefix_entries": self.index.num_entries,  # block positions cached, each every layer's KV heads
        }


def _stacked(entries: list[PrefixEntry]) -> torch.Tensor:
    """(L, Hkv, m) ids of a chain of entries, oldest block first."""
    return torch.stack([entry.ids for entry in entries], dim=2)
