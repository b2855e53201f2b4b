"""How the attention function finds the cache layer that `Cache.update` just ran.

HF calls `cache.update(k, v, layer_idx)` and then the attention function with the returned
tensors, but never passes the cache to the attention function, and `generate()` rejects extra
kwargs. `SparseServeCache.update` therefore leaves a hand-off in a context variable; the
attention function takes it only if it names the same layer and the very key tensor it
received, so two caches used alternately (or a stale hand-off) can never be confused.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Handoff:
    """The layer whose `update` returned `key` (None: a dense layer of a SparseServeCache), and
    the cache's `ForwardLog` (the attention function checks the forward and undoes it on failure)."""

    layer_idx: int
    key: torch.Tensor
    layer: Any
    log: Any


_CURRENT: ContextVar[Handoff | None] = ContextVar("sparseserve_handoff", default=None)


def hand_over(layer_idx: int, key: torch.Tensor, layer: Any, log: Any) -> None:
    """Called by `SparseServeCache.update` right before the model calls attention."""
    _CURRENT.set(Handoff(layer_idx, key, layer, log))


def take(layer_idx: int, key: torch.Tensor) -> Handoff | None:
    """The hand-off for this attention call, or None when no SparseServeCache produced `key`."""
    handoff = _CURRENT.get()
    if handoff is None or handoff.layer_idx != layer_idx or handoff.key is not key:
        return None
    _CURRENT.set(None)
    return handoff
