"""What every serving system shares: the run clock, the KV budget, the warm-up request, run results.

Every runner (`stock.py`, `ours.py`) first serves one short warm-up request (kernel compilation and
allocator growth are not serving), then starts its clock and returns a `RunResult`: one
`RequestRecord` per trace request, times in seconds from that start, and what the engine reports
about itself. A run stops at its deadline (or, for stock's static batches, once its queue grows past
a limit: `QueueingStop`); requests unfinished then fail.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from eval.serving.metrics import RequestRecord
from eval.serving.trace import Trace, TraceRequest

PREFILL_CHUNK = 2048  # tokens per prefill chunk, every system (vLLM's default chunk in the paper's baselines)
WARMUP_PROMPT_TOKENS = 4096  # past the 2048-token budget: the warm-up runs selection and block transfers too
WARMUP_NEW_TOKENS = 8
WARMUP_ROWS = 2  # the Generator's warm-up: whole prompts served together (a decode row beside a prefill)


class Clock:
    """Seconds since the run started (time.perf_counter based, like the engines' own timestamps)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def since_start(self, perf_counter_time: float) -> float:
        return perf_counter_time - self.start

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


@dataclass(frozen=True)
class Budget:
    """What one system may keep in HBM for KV (bytes), and the bytes one token's KV takes."""

    kv_bytes: int
    kv_bytes_per_token: int
    max_batch: int


@dataclass
class RunResult:
    """One system's run of the trace: a record per request and the engine's own totals."""

    records: list[RequestRecord]
    engine: dict[str, Any] = field(default_factory=dict)


def warmup_batch(trace: Trace) -> list[TraceRequest]:
    """The trace's WARMUP_ROWS longest prompts, WARMUP_NEW_TOKENS out each; not measured. The longest
    is lengthened (its own tokens again) so that its decode reaches the trace's longest context,
    its longest prompt plus its longest output.

    What the Generator serves, together, before a run: its kernels meet the run's largest shapes (the
    longest prefill, the widest block tables a decode reaches, a decode row beside a prefill, paced
    splits) before the clock starts, as stock's warm-up calls run the run's own first batches. A
    short prompt alone left compilation for shapes first seen inside the timed run."""
    longest = sorted(trace.requests, key=lambda r: len(r.prompt), reverse=True)[:WARMUP_ROWS]
    widest = max(len(r.prompt) + r.output_tokens for r in trace.requests) - WARMUP_NEW_TOKENS
    first = longest[0].prompt
    prompts = [(first * -(-widest // len(first)))[: max(widest, len(first))], *(r.prompt for r in longest[1:])]
    return [TraceRequest(index=-1, gap=0.0, prompt=prompt, output_tokens=WARMUP_NEW_TOKENS) for prompt in prompts]


def warmup_request(trace: Trace) -> TraceRequest:
    """The first WARMUP_PROMPT_TOKENS of the trace's first prompt, WARMUP_NEW_TOKENS out; not measured."""
    first = trace.requests[0]
    return TraceRequest(index=-1, gap=0.0, prompt=first.prompt[:WARMUP_PROMPT_TOKENS], output_tokens=WARMUP_NEW_TOKENS)


def cuda_peak_bytes(model) -> dict[str, int]:
    """The device's peak allocation so far (the warm-up included), where there is a device."""
    if model.device.type != "cuda":
        return {}
    return {"cuda_peak_bytes": torch.cuda.max_memory_allocated(model.device)}


def progress(total: int, desc: str) -> tqdm:
    """Requests served so far, on stderr (a sweep's log shows how far each point got)."""
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, mininterval=10.0)


class QueueingStop:
    """Whether a run may stop before its trace ends: once the last `batches` batches each waited past
    `limit_s` (their oldest request's queueing) and each longer than the one before. The goodput pair
    needs only to show that stock misses the SLO at a rate; a queue still growing past the SLO's mean
    queueing (2 s) will miss it, so the rest of such a run is device time that shows nothing new.
    `limit_s` None: never."""

    def __init__(self, limit_s: float | None, batches: int = 3) -> None:
        if limit_s is not None and limit_s < 0:
            raise ValueError(f"the queueing limit must be >= 0 s, got {limit_s}")
        self.limit_s, self.batches = limit_s, batches
        self.waits: list[float] = []
        self.stopped_at_s: float | None = None
        self._oldest: int | None = None

    def stop(self, oldest: int, waited_s: float, now_s: float) -> bool:
        """Record a batch about to start whose oldest request (index `oldest`) waited `waited_s`;
        True: stop instead. A batch tried again (one row fewer after an out-of-memory) counts once."""
        if self.limit_s is None or oldest == self._oldest:
            return False
        self._oldest = oldest
        self.waits.append(waited_s)
        last = self.waits[-self.batches :]
        growing = all(later > earlier for earlier, later in itertools.pairwise(last))
        if len(last) == self.batches and min(last) > self.limit_s and growing:
            self.stopped_at_s = now_s
            return True
        return False

    def fail_unstarted(self, records: list[RequestRecord]) -> None:
        """Requests never admitted because the run stopped fail, saying why."""
        if self.stopped_at_s is None:
            return
        for record in records:
            if record.admitted is None and record.error is None:
                record.error = (
                    f"not started: the run stopped at {self.stopped_at_s:.1f} s, its queueing past "
                    f"{self.limit_s:g} s and growing"
                )


def fail_unfinished(records: list[RequestRecord], deadline_s: float) -> None:
    """A request without all its tokens and without an error ran into the run's deadline."""
    for record in records:
        if record.error is None and len(record.token_times) < record.output_tokens:
            record.error = f"not finished within the run's deadline of {deadline_s:g} s"


def out_of_memory(exc: torch.OutOfMemoryError) -> str:
    """A request's error when the cap broke: the first line of PyTorch's message."""
    return f"out of memory: {str(exc).splitlines()[0]}"


def new_records(trace: Trace, rate: float) -> list[RequestRecord]:
    arrivals = trace.arrivals(rate)
    return [
        RequestRecord(arrival=a, prompt_tokens=len(r.prompt), index=r.index, output_tokens=r.output_tokens)
        for r, a in zip(trace.requests, arrivals)
    ]


Runner = Callable[..., RunResult]  # (rate, deadline_s=math.inf) -> RunResult
