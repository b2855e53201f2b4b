"""Request: one prompt's state inside the Generator (tokens, text, cache, prefill job, stop checks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache import SparseServeCache
from ..cache.forward_log import PositionLimit
from .outputs import RequestOutput
from .params import SamplingParams
from .prefill import PrefillJob

WAITING, PREFILLING, RUNNING = "waiting", "prefilling", "running"


@dataclass(eq=False)
class Request:
    """A request in flight.

    Attributes:
        request_id: its id.
        prompt: prompt token ids.
        params: its SamplingParams.
        generator: its random stream (None when greedy).
        prompt_index: position in the list given to `stream`/`generate`, else None.
        dram_blocks: DRAM head-blocks reserved for its whole life (prompt + max_new_tokens).
        prefill_bytes: its exact prefill working set (HBM bytes).
        state: "waiting", "prefilling" or "running" (prefilled: decoding or sitting out).
        cache: its own one-row cache while it is not a row of the Generator's batch cache.
        job: its prefill job while prefilling.
        output: generated ids so far.
        decode_steps: decode steps it has taken part in.
        working_set_blocks: its latest working-set estimate in head-blocks.
    """

    request_id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    generator: torch.Generator | None
    prompt_index: int | None
    dram_blocks: int
    prefill_bytes: int
    state: str = WAITING
    cache: SparseServeCache | None = None
    job: PrefillJob | None = None
    output: list[int] = field(default_factory=list)
    decode_steps: int = 0
    working_set_blocks: int = 0
    _text: str = ""  # text released so far (never past a possible stop-string start)
    _final_text: str | None = None

    @property
    def position(self) -> int:
        """Position of the newest token (the one the next decode step feeds)."""
        return len(self.prompt) + len(self.output) - 1

    def add_token(self, token: int, eos_ids: frozenset[int], tokenizer: Any, positions: PositionLimit) -> str | None:
        """Append a generated token. Returns the finish reason it causes ("stop", "length") or None."""
        self.output.append(token)
        if tokenizer is not None:
            self._detokenize(tokenizer)
        if token in self.params.stop_token_ids or (token in eos_ids and not self.params.ignore_eos):
            return "stop"
        if self._final_text is not None:
            return "stop"
        if len(self.output) >= self.params.max_new_tokens:
            return "length"
        if not positions.has(self.position + 1):
            return "length"  # no position left for the next token
        return None

    def text_delta(self, tokenizer: Any, finished: bool) -> str | None:
        """Text not handed out yet: all of it once finished, else what no stop string can take back."""
        if tokenizer is None:
            return None
        full = self.final_text(tokenizer) if finished else self._releasable(tokenizer)
        delta = full[len(self._text) :]
        self._text = full
        return delta

    def final_text(self, tokenizer: Any) -> str | None:
        """The request's text: decoded output, cut before the first stop string."""
        if tokenizer is None:
            return None
        if self._final_text is None:
            return tokenizer.decode(self.output, skip_special_tokens=True)
        return self._final_text

    def to_output(self, tokenizer: Any, reason: str, error: str | None = None) -> RequestOutput:
        """The RequestOutput of this request finishing with `reason`."""
        return RequestOutput(
            self.request_id, self.prompt, tuple(self.output), self.final_text(tokenizer), reason, error
        )

    def _detokenize(self, tokenizer: Any) -> None:
        if not self.params.stop or self._final_text is not None:
            return
        full = tokenizer.decode(self.output, skip_special_tokens=True)
        hits = [i for i in (full.find(s) for s in self.params.stop) if i >= 0]
        if hits:
            self._final_text = full[: min(hits)]

    def _releasable(self, tokenizer: Any) -> str:
        full = tokenizer.decode(self.output, skip_special_tokens=True)
        hold = max((len(s) for s in self.params.stop), default=1) - 1  # a stop string may be forming
        end = len(full) - hold
        while end > 0 and full[end - 1] == "\ufffd":  # an incomplete multi-byte character
            end -= 1
        return full[: max(end, len(self._text))]
