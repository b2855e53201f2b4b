"""SamplingParams: how one request samples and when it stops (validated at construction)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Per-request decoding options.

    Attributes:
        max_new_tokens: most tokens to generate (>= 1).
        temperature: 0 = greedy (argmax); > 0 divides the logits before sampling.
        top_k: keep the k most likely tokens before sampling; 0 = off.
        top_p: keep the smallest set of tokens whose probability reaches p (nucleus); 1 = off.
        seed: seeds this request's own `torch.Generator`, so its samples do not depend on the
            other requests in the batch; None = a fresh random seed.
        stop: strings that end generation when they appear in the text (needs a tokenizer);
            the returned text stops before the first of them, `token_ids` keep the tokens that
            produced it.
        stop_token_ids: extra token ids that end generation (kept in `token_ids`).
        ignore_eos: keep generating past the model's EOS token.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a tuple of non-negative ints, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
