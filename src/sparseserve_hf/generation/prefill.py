"""Prefill of one request's prompt, a bounded amount of work per Generator iteration.

Three modes (`SparseServeConfig.prefill_mode`):
- "layer_segmented" (SparseServe's layer-segmented prefill): a segment of decoder layers per
  iteration over the whole prompt. Each layer writes its KV to the cache once; a SparseServeCache
  saves it to DRAM blocks and drops it from the device before the next layer runs, so prefill
  needs device memory for one layer's KV, not the model's. The hidden states wait on the device
  between iterations. A layer whose prompt exceeds `max_inject_tokens` is split into chunks:
  chunk 2 of layer i attends to chunk 1's KV through the cache, and layer i+1 starts only when
  layer i has seen the whole prompt.
  A paced iteration (`advance(..., split_to_budget=True)`) splits a layer that would not fit its
  budget the same way, into chunks of at least PACED_MIN_CHUNK_TOKENS, so that one layer of a long
  prompt does not hold up the decoding rows beside it.
- "chunked" (the usual chunked prefill, an ablation baseline): chunks of the prompt, each through
  all layers; later chunks read every earlier chunk's KV back, in every layer.
- "full": the whole prompt through all layers in one iteration, like `model(ids)`.

Work is counted in token-layers (tokens x layers run), the unit of `max_inject_tokens` in every
mode, so that switching the mode alone compares equal work per iteration (the paper's setup:
maxInjectToken = chunk size x num_layers).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from ..config import PREFILL_MODES, SparseServeConfig
from .stack import DecoderStack

__all__ = ["BudgetedPrefill", "DecoderStack", "PrefillJob"]

# The smallest chunk a paced layer is split into. Each chunk after the first reads its layer's earlier
# chunks back through the cache (from DRAM with a SparseServeCache), so the smaller the chunks the more
# of a layer crosses PCIe: at 4,096 tokens a 32K prompt's layer reads back 3.5x its own KV.
PACED_MIN_CHUNK_TOKENS = 4096


@dataclass
class PrefillJob:
    """One request's prompt being prefilled; `BudgetedPrefill` keeps its progress here.

    Attributes:
        input_ids: (1, T) prompt ids (on the model's device).
        cache: the request's own cache; the prompt goes in after `past_length` positions (0 fresh).
        num_layers: decoder layers of the model.
        chunks: token ranges [s, e) one unit of work covers: the whole prompt in one range unless
            it exceeds the per-iteration cap (layer_segmented, chunked), or, layer_segmented, a
            paced iteration's budget when the layer started.
        next_layer: layer_segmented: the layer the next unit runs (num_layers once done).
        next_chunk_start: first prompt token the next unit runs (within `next_layer` for
            layer_segmented; through all layers for chunked).
        hidden: layer_segmented: (1, T, H), rows before `next_chunk_start` are the output of
            `next_layer`, the others its input. None before the first unit and once done.
        last_hidden: (1, 1, H) last prompt token after the final layer, once done.
        token_layers_done: work done so far.
        done: every layer has seen every prompt token.
    """

    input_ids: torch.Tensor
    cache: Cache
    num_layers: int
    past_length: int = 0
    chunks: list[tuple[int, int]] = field(default_factory=list)
    next_layer: int = 0
    next_chunk_start: int = 0
    hidden: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None
    token_layers_done: int = 0
    done: bool = False

    @property
    def num_tokens(self) -> int:
        """Prompt tokens of the job, T of its (1, T) input ids."""
        return self.input_ids.shape[1]

    @property
    def total_token_layers(self) -> int:
        """Work of the whole prefill in token-layers (`max_inject_tokens` units): T x layers."""
        return self.num_tokens * self.num_layers

    @property
    def remaining_token_layers(self) -> int:
        """Token-layers still to run before the prompt's first token can be sampled."""
        return self.total_token_layers - self.token_layers_done


@dataclass(frozen=True)
class _Unit:
    """Layers [start, stop) over prompt tokens [begin, end): what one `run_layers` call does.
    `chunks`: where the unit starts a layer, that layer's chunks (layer_segmented), else None."""

    start: int
    stop: int
    begin: int
    end: int
    chunks: list[tuple[int, int]] | None = None

    @property
    def cost(self) -> int:
        return (self.stop - self.start) * (self.end - self.begin)


class BudgetedPrefill:
    """Runs `PrefillJob`s a budget of token-layers at a time (see the module docstring for modes).

    Args:
        stack: the model's `DecoderStack`.
        mode: "layer_segmented", "chunked" or "full".
        max_inject_tokens: most token-layers one unit of work may take (None = no cap). It sets
            how prompts are chunked: layer_segmented splits a layer of T > max_inject_tokens
            tokens into chunks of at most max_inject_tokens; chunked runs chunks of at most
            max_inject_tokens // num_layers tokens through all layers; full ignores it.

    Example:
        >>> prefill = BudgetedPrefill(DecoderStack(model), "layer_segmented", max_inject_tokens=8192)
        >>> job = prefill.start(prompt_ids, SparseServeCache(model.config, config))
        >>> while not job.done:
        ...     prefill.advance(job, 8192)          # one Generator iteration's prefill share
        >>> first_token = prefill.logits(job).argmax(-1)
    """

    def __init__(self, stack: DecoderStack, mode: str, max_inject_tokens: int | None) -> None:
        if mode not in PREFILL_MODES:
            raise ValueError(f"prefill mode must be one of {PREFILL_MODES}, got {mode!r}")
        if max_inject_tokens is not None and (
            not isinstance(max_inject_tokens, int) or isinstance(max_inject_tokens, bool) or max_inject_tokens <= 0
        ):
            raise ValueError(f"max_inject_tokens must be a positive int or None, got {max_inject_tokens!r}")
        if mode == "chunked" and max_inject_tokens is not None and max_inject_tokens < stack.num_layers:
            raise ValueError(
                f"chunked prefill runs each chunk through all {stack.num_layers} layers: max_inject_tokens "
                f"({max_inject_tokens} token-layers) must be at least num_layers"
            )
        self.stack = stack
        self.mode = mode
        self.max_inject_tokens = max_inject_tokens

    @classmethod
    def from_config(cls, stack: DecoderStack, config: SparseServeConfig) -> BudgetedPrefill:
        """The prefill `config.prefill_mode` and `config.max_inject_tokens` describe."""
        return cls(stack, config.prefill_mode, config.max_inject_tokens)

    # ---- public API ------------------------------------------------------------------------

    def start(self, input_ids: torch.Tensor, cache: Cache) -> PrefillJob:
        """A job for one prompt, (T,) or (1, T) ids, into `cache`. Runs nothing yet."""
        input_ids = self._check_prompt(input_ids, cache)
        past = cache.get_seq_length()
        job = PrefillJob(input_ids.to(self.stack.device), cache, self.stack.num_layers, past_length=past)
        job.chunks = _split(job.num_tokens, self._chunk_cap(job.num_tokens))
        return job

    @torch.no_grad()
    def advance(
        self,
        job: PrefillJob,
        token_layer_budget: int | None,
        split_to_budget: bool = False,
        at_least_one_unit: bool = True,
    ) -> int:
        """Run as much of `job` as `token_layer_budget` token-layers allow; returns the work done.

        Work goes in whole units (a layer segment over the prompt or over one chunk of it; a
        chunk through all layers; the whole prompt in "full" mode). At least one unit runs per
        call, even one costing more than the budget, so that every call makes progress
        (`at_least_one_unit=False`: only units that fit). None = no budget: finish the job.
        split_to_budget: layer_segmented, a budget that paces the iteration (`target_tbt_ms`): a
        layer that starts now and costs more than what is left of the budget is split into chunks
        that fit it, none smaller than PACED_MIN_CHUNK_TOKENS (the layer keeps that split to its end).
        """
        if token_layer_budget is not None and (
            not isinstance(token_layer_budget, int) or isinstance(token_layer_budget, bool) or token_layer_budget <= 0
        ):
            raise ValueError(f"token_layer_budget must be a positive int or None, got {token_layer_budget!r}")
        used = 0
        while not job.done:
            left = None if token_layer_budget is None else token_layer_budget - used
            unit = self._next_unit(job, left, split_to_budget)
            if (used or not at_least_one_unit) and left is not None and unit.cost > left:
                break
            self._run(job, unit)
            used += unit.cost
        return used

    def logits(self, job: PrefillJob) -> torch.Tensor:
        """(1, V) logits of the last prompt token, once `job.done`."""
        if not job.done:
            raise ValueError(
                f"prefill is not finished: {job.remaining_token_layers} of {job.total_token_layers} "
                "token-layers left; call advance() until job.done"
            )
        with torch.no_grad():
            return self.stack.logits(job.last_hidden)[:, -1]

    # ---- planning ---------------------------------------------------------------------------

    def _chunk_cap(self, num_tokens: int) -> int:
        if self.max_inject_tokens is None or self.mode == "full":
            return num_tokens
        if self.mode == "chunked":
            return self.max_inject_tokens // self.stack.num_layers
        return self.max_inject_tokens

    def _next_unit(self, job: PrefillJob, budget_left: int | None, split_to_budget: bool = False) -> _Unit:
        """The next unit of work (job not done); whole layers are merged up to `budget_left`."""
        num_layers, num_tokens = self.stack.num_layers, job.num_tokens
        if self.mode != "layer_segmented":
            begin, end = next((s, e) for s, e in job.chunks if s == job.next_chunk_start)
            return _Unit(0, num_layers, begin, end)
        start, starts_layer = job.next_layer, None
        if job.next_chunk_start == 0:  # a layer starts: its chunks
            cap = self._chunk_cap(num_tokens)
            if split_to_budget and budget_left is not None:
                cap = min(cap, max(budget_left, PACED_MIN_CHUNK_TOKENS))
            starts_layer = _split(num_tokens, cap)
        chunks = starts_layer or job.chunks
        begin, end = next((s, e) for s, e in chunks if s == job.next_chunk_start)
        if len(chunks) > 1:  # a split layer: one chunk of one layer
            return _Unit(start, start + 1, begin, end, starts_layer)
        layers = num_layers - start if budget_left is None else max(budget_left // num_tokens, 1)
        return _Unit(start, min(start + layers, num_layers), 0, num_tokens, starts_layer)

    # ---- execution --------------------------------------------------------------------------

    def _run(self, job: PrefillJob, unit: _Unit) -> None:
        if unit.chunks is not None:
            job.chunks = unit.chunks
        if self.mode == "layer_segmented":
            self._run_segment(job, unit)
        else:
            self._run_through(job, unit)
        job.token_layers_done += unit.cost

    def _run_through(self, job: PrefillJob, unit: _Unit) -> None:
        """chunked / full: prompt tokens [begin, end) through every layer."""
        hidden = self.stack.embed(job.input_ids[:, unit.begin : unit.end])
        out = self.stack.run_layers(
            hidden, 0, unit.stop, cache=job.cache, position_ids=self._positions(job, unit)
        )  # (1, t, H)
        job.next_chunk_start = unit.end
        if unit.end == job.num_tokens:
            self._finish(job, out)

    def _run_segment(self, job: PrefillJob, unit: _Unit) -> None:
        """layer_segmented: layers [start, stop) over prompt tokens [begin, end), in place in job.hidden."""
        if job.hidden is None:
            self._park(job, self.stack.embed(job.input_ids), slice(None))
        rows = slice(unit.begin, unit.end)
        hidden = job.hidden[:, rows]
        out = self.stack.run_layers(
            hidden, unit.start, unit.stop, cache=job.cache, position_ids=self._positions(job, unit)
        )  # (1, t, H)
        if unit.end < job.num_tokens:
            self._park(job, out, rows)
            job.next_chunk_start = unit.end
            return
        job.next_layer, job.next_chunk_start = unit.stop, 0
        if job.next_layer == self.stack.num_layers:
            self._finish(job, out)
        else:
            self._park(job, out, rows)

    def _park(self, job: PrefillJob, hidden: torch.Tensor, rows: slice) -> None:
        """Keep hidden rows on the device until the next unit."""
        if job.hidden is None or hidden.shape[1] == job.num_tokens:
            job.hidden = hidden  # the whole prompt: replace, never hold two (T, H) copies
        else:
            job.hidden[:, rows] = hidden

    def _finish(self, job: PrefillJob, out: torch.Tensor) -> None:
        job.last_hidden = out[:, -1:].clone()  # (1, 1, H); clone so the full (1, t, H) can go
        job.hidden = None
        job.next_layer, job.next_chunk_start = self.stack.num_layers, job.num_tokens
        job.done = True

    def _positions(self, job: PrefillJob, unit: _Unit) -> torch.Tensor:
        first = job.past_length + unit.begin
        return torch.arange(first, job.past_length + unit.end, device=self.stack.device)[None]  # (1, t)

    def _check_prompt(self, input_ids: torch.Tensor, cache: Cache) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.as_tensor(input_ids, dtype=torch.long)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"a prefill job takes one prompt of shape (T,) or (1, T), got {tuple(input_ids.shape)}")
        if input_ids.shape[1] == 0:
            raise ValueError("empty prompt: a prefill job needs at least one token")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"prompt ids must be integers, got {input_ids.dtype}")
        if cache is None:
            raise ValueError("prefill needs the request's cache (a DynamicCache or SparseServeCache), got None")
        self.stack.positions.check(cache.get_seq_length() + input_ids.shape[1] - 1, "the prompt")
        return input_ids


def _split(num_tokens: int, cap: int) -> list[tuple[int, int]]:
    """[0, num_tokens) in the fewest ranges of at most `cap` tokens, balanced in size.

    Balanced rather than cap, cap, ..., remainder: a tiny last chunk would cost a whole pass over
    the past, and a 1-token chunk over a past would take the cache's sparse decode path.
    """
    count = -(-num_tokens // cap)
    bounds = [num_tokens * i // count for i in range(count + 1)]
    return list(itertools.pairwise(bounds))
