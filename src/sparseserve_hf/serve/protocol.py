"""OpenAI request bodies -> (prompt, SamplingParams), with OpenAI-style errors for what cannot run.

Beyond OpenAI's fields (as vLLM has them): `top_k` (0 = off) and `ignore_eos` (generate exactly
`max_tokens`, for load tests on random weights).

Plain Python over the decoded JSON: every check raises `ApiError` (status, message, param) before
anything reaches the engine, so a bad request never disturbs a running one.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from ..generation import SamplingParams

COMMON_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "user",
        "ignore_eos",
    }
)
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
# OpenAI fields this server knows and does not implement: named in the 400, not silently ignored.
UNSUPPORTED_FIELDS = frozenset(
    {
        "logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "presence_penalty",
        "frequency_penalty", "tools", "tool_choice", "functions", "function_call", "response_format",
        "parallel_tool_calls", "audio", "modalities", "prediction", "store", "metadata", "service_tier",
        "reasoning_effort", "web_search_options",
    }
)  # fmt: skip
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: omit it and the request samples


class ApiError(Exception):
    """An error the client gets as OpenAI's `{"error": {...}}` body with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            status, "server_error"
        )

    def body(self) -> dict[str, Any]:
        """The OpenAI error JSON."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class ParsedRequest:
    """What a handler needs: the prompt (a str or token ids), how to sample, how to answer."""

    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


def parse_completion(body: Any, model_name: str, context_length: int | None) -> ParsedRequest:
    """A /v1/completions body; `context_length` bounds prompt + max_tokens checks later (None: unknown)."""
    fields = _checked_fields(body, COMPLETION_FIELDS, "prompt")
    _check_model(fields, model_name)
    prompt = fields["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise ApiError(
                400, "prompt must be a string or one list of token ids (ints >= 0); batches are not supported", "prompt"
            )
    elif not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids", "prompt")
    return _parsed(fields, prompt, fields.get("max_tokens", DEFAULT_COMPLETION_TOKENS), context_length)


def parse_chat(body: Any, model_name: str, context_length: int | None) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """A /v1/chat/completions body -> (messages, fields); `chat_request` finishes it once the
    messages are tokenized (the prompt length sets the default max_tokens)."""
    fields = _checked_fields(body, CHAT_FIELDS, "messages")
    _check_model(fields, model_name)
    messages = fields["messages"]
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "every message needs a string 'role'", "messages")
        if not isinstance(message.get("content"), str):
            raise ApiError(400, "message content must be a string (content parts are not supported)", "messages")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise ApiError(400, f"unsupported message field(s): {', '.join(sorted(extra))}", "messages")
    return [{"role": m["role"], "content": m["content"]} for m in messages], fields


def chat_request(fields: dict[str, Any], prompt_ids: list[int], context_length: int | None) -> ParsedRequest:
    """The chat request once its template is applied: max_tokens defaults to the rest of the context."""
    limit = fields.get("max_completion_tokens", fields.get("max_tokens"))
    if limit is None:
        limit = max(context_length - len(prompt_ids), 1) if context_length else DEFAULT_COMPLETION_TOKENS
    return _parsed(fields, prompt_ids, limit, context_length)


def _checked_fields(body: Any, allowed: frozenset[str], required: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unsupported = sorted(set(body) & UNSUPPORTED_FIELDS)
    if unsupported:
        raise ApiError(400, f"unsupported field(s): {', '.join(unsupported)}", unsupported[0])
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(unknown)}", unknown[0])
    if required not in body:
        raise ApiError(400, f"'{required}' is required", required)
    return body


def _check_model(fields: dict[str, Any], model_name: str) -> None:
    name = fields.get("model")
    if name is not None and name != model_name:
        raise ApiError(404, f"model {name!r} does not exist; this server serves {model_name!r}", "model")


def _parsed(
    fields: dict[str, Any], prompt: str | list[int], max_tokens: Any, context_length: int | None
) -> ParsedRequest:
    n = fields.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise ApiError(400, f"only n=1 is supported, got {n!r}", "n")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ApiError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    temperature = fields.get("temperature", DEFAULT_TEMPERATURE)
    temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    if not _is_number(temperature) or temperature < 0:
        raise ApiError(400, f"temperature must be a number >= 0, got {temperature!r}", "temperature")
    top_p = 1.0 if fields.get("top_p") is None else fields["top_p"]
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be a number in (0, 1], got {top_p!r}", "top_p")
    top_k = 0 if fields.get("top_k") is None else fields["top_k"]
    if not _is_int(top_k) or top_k < 0:
        raise ApiError(400, f"top_k must be an integer >= 0 (0 = off), got {top_k!r}", "top_k")
    seed = fields.get("seed")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise ApiError(400, f"seed must be an integer >= 0, got {seed!r}", "seed")
    stop = fields.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise ApiError(400, "stop must be a non-empty string or a list of up to 4 of them", "stop")
    ignore_eos = fields.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, f"ignore_eos must be a boolean, got {ignore_eos!r}", "ignore_eos")
    stream = fields.get("stream", False) or False
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be a boolean, got {stream!r}", "stream")
    options = fields.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, "stream_options supports only include_usage", "stream_options")
    if options and not stream:
        raise ApiError(400, "stream_options needs stream=true", "stream_options")
    if context_length is not None and not isinstance(prompt, str) and len(prompt) >= context_length:
        raise ApiError(400, f"the prompt has {len(prompt)} tokens; the model's context is {context_length}", "prompt")
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=top_k,
            seed=seed,
            stop=tuple(stop),
            ignore_eos=ignore_eos,
        )
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    return ParsedRequest(prompt, params, stream, bool(options.get("include_usage", False)))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
