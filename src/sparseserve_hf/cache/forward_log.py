"""ForwardLog: what a SparseServeCache knows about the forward running through it.

HF runs a forward layer by layer: layer i's `cache.update` and attention run before layer
i + 1's. When layer k fails (its update, its commit, its attention), layers 0..k-1 already hold
the new tokens; left so, `get_seq_length` (layer 0) would count tokens the other layers never
stored, and a retry would build positions from it. The log keeps one undo step per layer updated
since layer 0's update, and the attention function runs them all when anything fails.

It also checks, once per forward at layer 0's attention (the first point where the model's own
config is at hand), that the model is the one the cache was built for, and applies the
position limit.

And it is how the attention function finds the cache layer that `Cache.update` just ran. HF calls
`cache.update(k, v, layer_idx)` and then the attention function with the returned tensors, but never
passes the cache to the attention function, and `generate()` rejects extra kwargs.
`SparseServeCache.update` therefore leaves a hand-off in a context variable (`hand_over`); the
attention function takes it (`take`) only if it names the same layer and the very key tensor it
received, so two caches used alternately (or a stale hand-off) can never be confused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PositionLimit:
    """Positions 0 .. `limit` - 1 exist; `limit` None: the model's config names no limit.

    Who applies it: a prompt (several new tokens at once) must lie within it, in the drop-in cache,
    the prefill and the Generator's admission; the Generator ends a request with "length" when its
    next token would have no position; a captured decode graph refuses a step past it. A lone decode
    token of the drop-in may go past it (stock `generate` lets the model decide; the cache warns once).
    """

    limit: int | None

    def __str__(self) -> str:  # as the config field reads (shape differences name it so)
        return str(self.limit)

    @classmethod
    def of(cls, text_config: Any) -> PositionLimit:
        """The limit of a text config (its `max_position_embeddings`, if any)."""
        return cls(getattr(text_config, "max_position_embeddings", None))

    def has(self, position: int) -> bool:
        """True when `position` exists."""
        return self.limit is None or position < self.limit

    def check(self, position: int, what: str) -> None:
        """Raise ValueError naming `what` when `position` (the last it needs) does not exist."""
        if not self.has(position):
            raise ValueError(
                f"{what} needs position {position}, past the model's max_position_embeddings ({self.limit}: "
                f"positions 0..{self.limit - 1})"
            )


@dataclass(frozen=True)
class ModelShape:
    """What a cache is built for and a forward must match: layers, KV heads, head_dim, positions, layer types."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    positions: PositionLimit
    layer_types: tuple[str, ...]

    @classmethod
    def of(cls, text_config: Any, layer_types: list[str]) -> ModelShape:
        """The shape of a text config (`num_hidden_layers`, `num_key_value_heads`, `head_dim`, ...)."""
        heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        return cls(
            num_layers=text_config.num_hidden_layers,
            num_kv_heads=getattr(text_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            positions=PositionLimit.of(text_config),
            layer_types=tuple(layer_types),
        )

    def differences(self, other: ModelShape) -> list[str]:
        """`config_field: mine vs theirs` for every field that differs (named as in the model config)."""
        return [
            f"{field}: {getattr(self, name)} vs {getattr(other, name)}"
            for name, field in CONFIG_FIELDS.items()
            if getattr(self, name) != getattr(other, name)
        ]


CONFIG_FIELDS = {  # ModelShape field -> the model config field it comes from
    "num_layers": "num_hidden_layers",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "positions": "max_position_embeddings",
    "layer_types": "layer_types",
}


class ForwardLog:
    """Undo steps of the current forward and its layer-0 checks (one per SparseServeCache).

    Holds the layers through their undo steps, never the cache (no reference cycle: dropping a
    cache must free its store at once). `shape_of` turns a model config into a `ModelShape`.
    """

    def __init__(self, shape: ModelShape, shape_of: Callable[[Any], ModelShape], config: Any) -> None:
        self.shape = shape
        self._shape_of = shape_of
        self._matched: Any = config  # the last model config found equal to `shape` (an identity fast path)
        self._steps: list[Callable[[], None]] = []
        self._past = self._num_new = 0
        self._warned = False

    def begin(self, past: int, num_new: int) -> None:
        """A forward starts (layer 0's update): `past` positions cached before it, `num_new` arriving."""
        self._steps = []
        self._past, self._num_new = past, num_new

    def record(self, step: Callable[[], None]) -> None:
        """One layer's undo step, run by `undo` (newest first)."""
        self._steps.append(step)

    def clear(self) -> None:
        """Forget the undo steps (the forward is over, or the rows changed in another way)."""
        self._steps = []

    def finish(self, layer_idx: int) -> None:
        """Layer `layer_idx`'s attention succeeded; after the last layer nothing is left to undo."""
        if layer_idx == self.shape.num_layers - 1:
            self._steps = []

    def undo(self) -> None:
        """Take back every layer's update of this forward, newest first.

        A failing step does not stop the others; it is logged, since the caller is already
        raising the error that made it undo.
        """
        steps, self._steps = self._steps, []
        for step in reversed(steps):
            try:
                step()
            except Exception:
                logger.exception("SparseServeCache: undoing a failed forward's update failed; call cache.reset()")

    def check_forward(self, model_config: Any) -> None:
        """At layer 0's attention: refuse another model's forward, and positions past the limit.

        Raises ValueError when `model_config` (the attention module's config) differs from what
        the cache was built for, or when several new tokens (a prompt) would end past
        `max_position_embeddings`. A single new token per row (decode) may go past it, as stock
        `generate` lets it, with one warning: nothing the cache stores is sized by it.
        """
        if model_config is not None and model_config is not self._matched:
            try:
                theirs = self._shape_of(model_config)
            except (AttributeError, TypeError, ValueError) as exc:
                raise ValueError(f"this SparseServeCache cannot read the model's config: {exc}") from exc
            differences = self.shape.differences(theirs)
            if differences:
                raise ValueError(
                    "this SparseServeCache was built for another model config ("
                    + "; ".join(differences)
                    + ", the cache's first): build one per model, SparseServeCache(model.config, ...)"
                )
            self._matched = model_config
        positions, last = self.shape.positions, self._past + self._num_new - 1
        if positions.has(last):
            return
        if self._num_new > 1:  # refused before any work
            positions.check(last, f"a prompt of {self._num_new} tokens over a past of {self._past}")
        if not self._warned:
            self._warned = True
            logger.warning(
                "SparseServeCache: decoding past the model's max_position_embeddings (%d); quality may degrade",
                positions.limit,
            )


@dataclass(frozen=True)
class Handoff:
    """The layer whose `update` returned `key` (None: a dense layer of a SparseServeCache), the
    cache's `ForwardLog` (the attention function checks the forward and undoes it on failure), and
    whether the forward is the cache's static step (`SparseServeCache.static_step`: its decode commits
    only append, and its sparse attention runs inline, as its caller captures or replays it whole)."""

    layer_idx: int
    key: torch.Tensor
    layer: Any
    log: ForwardLog
    static: bool = False


_CURRENT: ContextVar[Handoff | None] = ContextVar("sparseserve_handoff", default=None)


def hand_over(layer_idx: int, key: torch.Tensor, layer: Any, log: ForwardLog, static: bool = False) -> None:
    """Called by `SparseServeCache.update` right before the model calls attention."""
    _CURRENT.set(Handoff(layer_idx, key, layer, log, static))


def take(layer_idx: int, key: torch.Tensor) -> Handoff | None:
    """The hand-off for this attention call, or None when no SparseServeCache produced `key`."""
    handoff = _CURRENT.get()
    if handoff is None or handoff.layer_idx != layer_idx or handoff.key is not key:
        return None
    _CURRENT.set(None)
    return handoff
