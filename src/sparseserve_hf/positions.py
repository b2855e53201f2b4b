"""The model's position limit (`max_position_embeddings`): read and enforced in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PositionLimit:
    """Positions 0 .. `limit` - 1 exist; `limit` None: the model's config names no limit.

    Who applies it: a prompt (several new tokens at once) must lie within it, in the drop-in cache,
    the prefill and the Generator's admission; the Generator ends a request with "length" when its
    next token would have no position; a captured decode graph refuses a step past it. A lone decode
    token of the drop-in may go past it (stock `generate` lets the model decide; the cache warns once).
    """

    limit: int | None

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
