"""The Generator on its own thread: asyncio handlers hand requests in and read events out.

The GPU work is sequential, so one thread owns the `Generator` and is the only one that touches
it. Handlers call `submit` / `cancel` from the event loop; both only put a command on a
thread-safe queue. The engine thread applies the commands between iterations and hands each
event to its request's `asyncio.Queue` with `call_soon_threadsafe`, so no handler ever waits on
the GPU, and the engine never waits on a slow client.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..generation import Generator, SamplingParams, StreamEvent

IDLE_WAIT_S = 0.05  # how long an idle engine blocks on its command queue before looking again
STATS_EVERY_S = 0.5  # how often the engine refreshes the engine-wide gauges (reading them syncs)


class EngineStopped(RuntimeError):
    """The engine loop is not running (not started, stopped, or it died)."""


@dataclass
class RequestHandle:
    """One request as a handler sees it: its id and its events, in order."""

    request_id: int
    events: asyncio.Queue[StreamEvent]
    submitted_at: float = field(default_factory=time.perf_counter)


class EngineThread:
    """Owns a `Generator` and runs its iterations on a daemon thread.

    Args:
        generator: the engine; nothing else may touch it once `start` ran.
        on_finish: called on the engine thread with (event, request metrics dict) when a request
            finishes (the server's Prometheus counters), and `on_stats(generator totals)` every
            STATS_EVERY_S while busy; both optional.
    """

    def __init__(
        self,
        generator: Generator,
        on_finish: Callable[[StreamEvent, dict[str, Any]], None] | None = None,
        on_stats: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.generator = generator
        self._on_finish, self._on_stats = on_finish, on_stats
        self._commands: queue.Queue[tuple] = queue.Queue()
        self._routes: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: str | None = None  # why the loop died, if it did
        self._last_stats = 0.0

    # ---- called from the event loop -----------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (once)."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is already started")
        self._thread = threading.Thread(target=self._run, name="sparseserve-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """True while the loop runs (what `/health` reports)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    async def submit(self, prompt: str | list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request; returns its handle once the engine has accepted it.

        Raises ValueError/TypeError as `Generator.submit` does (nothing was queued then), or
        EngineStopped.
        """
        if not self.alive:
            raise EngineStopped(self.error or "the engine is not running")
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._commands.put(("submit", prompt, params, loop, accepted, events))
        request_id = await accepted
        return RequestHandle(request_id, events)

    def cancel(self, request_id: int) -> None:
        """End a request now (its blocks are freed on the engine thread); a finished one is left alone."""
        self._commands.put(("cancel", request_id))

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop after the current iteration; requests still running end as cancelled."""
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(block=not self.generator.has_unfinished)
                if self.generator.has_unfinished:
                    self._deliver(self.generator.step())
                    self._report_stats(force=not self.generator.has_unfinished)  # going idle: final figures
        except BaseException as exc:  # noqa: BLE001  the loop must not die silently
            self.error = f"engine loop failed: {type(exc).__name__}: {exc}"
            traceback.print_exc()
        finally:
            self._stop.set()
            self._end_all(self.error or "the server is shutting down")

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "submit":
            _, prompt, params, loop, accepted, events = command
            try:
                request_id = self.generator.submit(prompt, params)
            except (ValueError, TypeError) as exc:
                loop.call_soon_threadsafe(_settle, accepted, None, exc)
                return
            self._routes[request_id] = (loop, events)
            loop.call_soon_threadsafe(_settle, accepted, request_id, None)
        elif kind == "cancel" and command[1] in self._routes:
            self.generator.cancel(command[1])

    def _deliver(self, events: list[StreamEvent]) -> None:
        for event in events:
            route = self._routes.get(event.request_id)
            if event.finished:
                self._routes.pop(event.request_id, None)
                if self._on_finish is not None:
                    self._on_finish(event, self.generator.request_times(event.request_id) or {})
            if route is not None:
                loop, events_queue = route
                loop.call_soon_threadsafe(events_queue.put_nowait, event)

    def _report_stats(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self._on_stats is None or (not force and now - self._last_stats < STATS_EVERY_S):
            return
        self._last_stats = now
        self._on_stats(self.generator.metrics()["totals"])

    def _end_all(self, message: str) -> None:
        """Cancel whatever still runs (freeing its blocks) and tell every waiting handler."""
        for request_id in list(self._routes):
            self.generator.cancel(request_id)
        try:
            while self.generator.has_unfinished:  # delivers the cancellations, frees the blocks
                self._deliver(self.generator.step())
        except Exception:  # noqa: BLE001  shutting down: what could be freed was
            traceback.print_exc()
        for loop, events_queue in self._routes.values():
            loop.call_soon_threadsafe(events_queue.put_nowait, EngineStopped(message))
        self._routes.clear()
        while True:  # submits that never reached the engine
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "submit":
                command[3].call_soon_threadsafe(_settle, command[4], None, EngineStopped(message))


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the handler gave up (client gone)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
