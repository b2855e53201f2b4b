"""RequestFrontend: the list-in, list-out API (`stream`, `generate`) over `submit` and `step`.

One engine (`Generator`) and a group of them (`GeneratorGroup`) share it: what a caller sees
of prompts, per-prompt params, rejected prompts and a stream closed early is the same for both.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .inputs import as_prompt_list
from .outputs import RequestOutput, StreamEvent
from .params import SamplingParams

Prompt = str | Sequence[int] | torch.Tensor


class RequestFrontend:
    """`stream` and `generate` for a class that provides:

    - `submit(prompt, params, prompt_index=...) -> int`, raising ValueError/TypeError for a
      prompt that can never run;
    - `step() -> list[StreamEvent]`;
    - `_pending`: a list of events to hand out with the next `step()`;
    - `_abandon(request_ids)`: end requests whose stream was closed before they finished;
    - `_rejected(prompt, index, message) -> StreamEvent`: the one event of a refused prompt.
    """

    _pending: list[StreamEvent]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams | None] | None = None,
    ) -> Iterator[StreamEvent]:
        """Submit `prompts` and yield their events as tokens come (each event names its prompt_index).

        `prompts` is a list of prompts, or one prompt (a str, a flat list of token ids, a 1-D
        tensor: a list of one, as in vLLM's `LLM.generate`; so `stream("Hi")` is one request,
        not "H" and "i"). A 2-D tensor is a list of its rows. `params` is one SamplingParams for
        all, one per prompt, or None (the defaults).

        A prompt that can never run (empty, too long, bad ids...) yields one finishing event with
        finish_reason "error" and the message; the others run. Events of requests added with
        `submit` are kept for the next `step()` caller.

        Raises (at the call, before anything is submitted):
            TypeError: `prompts` is neither a prompt nor a sequence of them; `params` is not a
                SamplingParams, None or a sequence of them.
            ValueError: a params sequence whose length is not the number of prompts.
        """
        prompt_list = as_prompt_list(prompts)
        return self._stream(prompt_list, _per_prompt(params, len(prompt_list)))

    def _stream(self, prompts: list[Any], params: list[SamplingParams | None]) -> Iterator[StreamEvent]:
        """`stream`'s loop. Closed early (the consumer broke off or raised, or an interrupt), it
        ends its unfinished requests (`_abandon`) and loses no other request's event."""
        own: set[int] = set()
        try:
            for index, (prompt, request_params) in enumerate(zip(prompts, params)):
                try:
                    own.add(self.submit(prompt, request_params, prompt_index=index))
                except (ValueError, TypeError) as exc:
                    yield self._rejected(prompt, index, str(exc))
            while own:
                events = self.step()
                self._pending.extend(event for event in events if event.request_id not in own)  # before any yield
                for event in [event for event in events if event.request_id in own]:
                    if event.finished:
                        own.discard(event.request_id)
                    yield event
        finally:
            self._abandon(own)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams | None] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` to completion; returns their outputs in the same order.

        Takes what `stream` takes: a list of prompts, or one prompt, which returns a list of one
        output. Raises what `stream` raises, before anything runs.
        """
        prompt_list = as_prompt_list(prompts)
        outputs: list[RequestOutput | None] = [None] * len(prompt_list)
        for event in self._stream(prompt_list, _per_prompt(params, len(prompt_list))):
            if event.finished:
                outputs[event.prompt_index] = event.output
        return outputs  # type: ignore[return-value]


def _per_prompt(params: object, count: int) -> list[SamplingParams | None]:
    """`params` of `stream`/`generate` as one entry per prompt; refuses anything else by name."""
    if params is None or isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, Sequence) or isinstance(params, str):
        raise TypeError(f"params must be a SamplingParams, None or a list of them, got {type(params).__name__}")
    bad = [type(p).__name__ for p in params if p is not None and not isinstance(p, SamplingParams)]
    if bad:
        raise TypeError(f"params must be a SamplingParams, None or a list of them; the list holds {bad[0]}")
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; give one, or one per prompt")
    return list(params)
