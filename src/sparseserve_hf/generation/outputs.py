"""What the Generator hands back: one RequestOutput per request, StreamEvents as tokens come."""

from __future__ import annotations

from dataclasses import dataclass

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished request.

    Attributes:
        request_id: the id `Generator.submit` returned.
        prompt_token_ids: the prompt as token ids.
        token_ids: the generated ids (an EOS or stop token that ended generation included).
        text: the generated text (special tokens skipped, cut before a stop string), or None
            without a tokenizer.
        finish_reason: "stop" (EOS, stop token or stop string), "length" (max_new_tokens or the
            model's context), "cancelled" or "error".
        error: what went wrong, for finish_reason "error"; else None.
    """

    request_id: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str | None
    finish_reason: str
    error: str | None = None


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One step's news for one request: a new token, its finish, or both.

    Attributes:
        request_id: the request.
        token_id: the new token, or None (a finish without a token: cancelled, error, or a
            stop string completed by an earlier token).
        text: the text this token added (may be "" while a multi-byte character is incomplete,
            and stops before a stop string), or None without a tokenizer.
        output: the RequestOutput when this event finishes the request, else None.
        prompt_index: position of the request's prompt in the list given to `stream` /
            `generate`; None for requests added with `submit`.
    """

    request_id: int
    token_id: int | None
    text: str | None
    output: RequestOutput | None = None
    prompt_index: int | None = None

    @property
    def finished(self) -> bool:
        """True on the request's last event."""
        return self.output is not None
