"""The FastAPI application: OpenAI's completions, chat completions and models, plus health and metrics."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ..generation import StreamEvent
from .engine import EngineStopped, EngineThread, RequestHandle
from .metrics import ServerMetrics
from .protocol import ApiError, ParsedRequest, chat_request, parse_chat, parse_completion


@dataclass
class ServerSettings:
    """What the handlers need to know besides the engine.

    Attributes:
        model_name: the only name `model` may carry (`/v1/models` lists it).
        api_key: bearer token every /v1 request must carry; None = no auth.
        max_queue: accepted requests without a first token beyond which new ones get 503.
        request_timeout: seconds a request may take end to end; None = no limit.
        context_length: the model's context in tokens (prompts past it get 400); None = unknown.
    """

    model_name: str
    api_key: str | None = None
    max_queue: int = 256
    request_timeout: float | None = None
    context_length: int | None = None


class _Counts:
    """Waiting (accepted, no token yet) and running requests, kept on the event loop."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.waiting = self.running = 0
        self.metrics = metrics

    def add(self, waiting: int = 0, running: int = 0) -> None:
        self.waiting += waiting
        self.running += running
        self.metrics.waiting.set(self.waiting)
        self.metrics.running.set(self.running)


def create_app(engine: EngineThread, tokenizer: Any, settings: ServerSettings, metrics: ServerMetrics) -> FastAPI:
    """The application over a not yet started engine: startup starts it, shutdown stops it."""
    counts = _Counts(metrics)
    draining = asyncio.Event()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        draining.set()
        await asyncio.to_thread(engine.stop, 30.0)

    app = FastAPI(title="sparseserve_hf", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        if exc.status >= 400:
            metrics.rejected.labels(str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.alive and not draining.is_set():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "error": engine.error}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _check_key(request, settings.api_key)
        card = {"id": settings.model_name, "object": "model", "created": int(time.time()), "owned_by": "sparseserve_hf"}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _check_key(request, settings.api_key)
        parsed = parse_completion(await _json(request), settings.model_name, settings.context_length)
        return await serve(parsed, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _check_key(request, settings.api_key)
        messages, fields = parse_chat(await _json(request), settings.model_name, settings.context_length)
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return await serve(chat_request(fields, list(ids), settings.context_length), chat=True)

    async def serve(parsed: ParsedRequest, chat: bool) -> Response:
        if draining.is_set() or not engine.alive:
            raise ApiError(503, "the server is not accepting requests", kind="unavailable")
        if counts.waiting >= settings.max_queue:
            raise ApiError(503, f"the request queue is full ({settings.max_queue} waiting)", kind="overloaded")
        counts.add(waiting=1)
        try:
            handle = await engine.submit(parsed.prompt, parsed.params)
        except (ValueError, TypeError) as exc:
            counts.add(waiting=-1)
            raise ApiError(400, str(exc)) from None
        except EngineStopped as exc:
            counts.add(waiting=-1)
            raise ApiError(503, str(exc), kind="unavailable") from None
        reply = _Reply(handle, engine, counts, settings, chat)
        if parsed.stream:
            return StreamingResponse(reply.chunks(parsed.include_usage), media_type="text/event-stream")
        return await reply.whole()

    return app


class _Reply:
    """One accepted request's answer: its events turned into OpenAI JSON, whole or as SSE chunks.

    Whatever way it ends (finished, timed out, the client gone, the task cancelled), the request
    leaves the counts and, unless it finished, is cancelled in the engine (its blocks freed).
    """

    def __init__(
        self, handle: RequestHandle, engine: EngineThread, counts: _Counts, settings: ServerSettings, chat: bool
    ) -> None:
        self.handle, self.engine, self.counts, self.settings, self.chat = handle, engine, counts, settings, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{handle.request_id}"
        self.created = int(time.time())
        self.started = False
        self.done = False
        deadline = settings.request_timeout
        self.deadline = None if deadline is None else time.monotonic() + deadline

    async def whole(self) -> JSONResponse:
        pieces = []
        try:
            async for event in self._events():
                pieces.append(event)
        finally:
            self._leave()
        output = pieces[-1].output
        body = self._frame(output.text or "", output.finish_reason) | {"usage": _usage(output)}
        return JSONResponse(body)

    async def chunks(self, include_usage: bool) -> AsyncIterator[str]:
        try:
            if self.chat:
                yield _sse(self._frame({"role": "assistant", "content": ""}, None, chunk=True))
            async for event in self._events():
                if event.token_id is not None:  # one chunk per token, "" while a character is incomplete
                    yield _sse(self._frame(self._delta(event.text or ""), None, chunk=True))
                if event.finished:
                    yield _sse(self._frame(self._delta(None), event.output.finish_reason, chunk=True))
                    if include_usage:
                        yield _sse(self._frame(None, None, chunk=True) | {"usage": _usage(event.output)})
        except ApiError as exc:  # headers are sent: the error travels as the stream's last event
            yield _sse(exc.body())
        finally:
            self._leave()
        yield "data: [DONE]\n\n"

    async def _events(self) -> AsyncIterator[StreamEvent]:
        while True:
            remaining = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
            try:
                event = await asyncio.wait_for(self.handle.events.get(), remaining)
            except asyncio.TimeoutError:
                raise ApiError(
                    504, f"the request took longer than {self.settings.request_timeout} s", kind="timeout"
                ) from None
            if isinstance(event, EngineStopped):
                self.done = True
                raise ApiError(503, str(event), kind="unavailable")
            if not self.started:
                self.started = True
                self.counts.add(waiting=-1, running=1)
            if event.finished:
                self.done = True
                _raise_for(event)
            yield event
            if event.finished:
                return

    def _leave(self) -> None:
        if not self.done:
            self.engine.cancel(self.handle.request_id)
            self.done = True
        self.counts.add(waiting=0 if self.started else -1, running=-1 if self.started else 0)
        self.started = False

    def _delta(self, text: str | None) -> Any:
        if self.chat:
            return {} if text is None else {"content": text}
        return text or ""

    def _frame(self, content: Any, finish_reason: str | None, chunk: bool = False) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
            key = "delta" if chunk else "message"
            value = content if chunk else {"role": "assistant", "content": content}
            choice = {"index": 0, key: value, "logprobs": None, "finish_reason": finish_reason}
        else:
            kind = "text_completion"
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
        choices = [] if content is None and chunk and finish_reason is None else [choice]
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.settings.model_name,
            "choices": choices,
        }


def _raise_for(event: StreamEvent) -> None:
    output = event.output
    if output.finish_reason == "error":
        raise ApiError(500, f"the request failed: {output.error}", kind="server_error")
    if output.finish_reason == "cancelled":
        raise ApiError(503, "the request was cancelled (the server is shutting down)", kind="unavailable")


def _usage(output: Any) -> dict[str, int]:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _check_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)")


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
