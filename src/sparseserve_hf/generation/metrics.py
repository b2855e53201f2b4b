"""Per-request timings and engine totals: TTFT, TBT, queueing delay, throughput, memory, hit rate."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import IO, Any


@dataclass(slots=True)
class RequestTimes:
    """Wall-clock times (time.perf_counter seconds) of one request's life, plus its sizes."""

    arrival: float
    prompt_tokens: int
    admitted: float | None = None  # prefill started
    token_times: list[float] = field(default_factory=list)
    finish: float | None = None
    finish_reason: str | None = None
    working_set_blocks: int = 0  # latest estimate, head-blocks
    working_set_bytes: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def queueing_delay(self) -> float | None:
        """Arrival to admission (prefill start)."""
        return None if self.admitted is None else self.admitted - self.arrival

    @property
    def tbt(self) -> list[float]:
        """Time between consecutive tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def as_dict(self, request_id: int) -> dict[str, Any]:
        """Everything about this request, JSON-ready (times relative to arrival)."""
        rel = [t - self.arrival for t in self.token_times]
        return {
            "request_id": request_id,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(self.token_times),
            "finish_reason": self.finish_reason,
            "arrival": self.arrival,
            "admitted_s": self.queueing_delay,
            "first_token_s": self.ttft,
            "token_times_s": rel,
            "finish_s": None if self.finish is None else self.finish - self.arrival,
            "ttft_s": self.ttft,
            "tbt_s": self.tbt,
            "queueing_delay_s": self.queueing_delay,
            "working_set_blocks": self.working_set_blocks,
            "working_set_bytes": self.working_set_bytes,
        }


ITERATION_KINDS = ("decode", "mixed", "prefill", "idle")  # decodes only, + prefill work, prefill only, neither


class MetricsRecorder:
    """Collects RequestTimes and memory samples; optionally writes a JSON line per finished request.

    Args:
        sink: a path or a text handle for JSON lines (one per finished request); None = none.
    """

    def __init__(self, sink: str | IO[str] | None = None) -> None:
        self.requests: dict[int, RequestTimes] = {}
        self.hbm_peak_bytes = 0
        self.iterations = 0
        self.decode_rows = 0  # summed over iterations
        self.admitted_peak_bytes = 0  # largest M_used admission allowed in one iteration
        self.sat_out = 0  # prefilled requests left out of an iteration, summed over iterations
        # Wall seconds of each iteration by what it ran: the breakdown that says where serving time goes.
        self.iteration_s: dict[str, list[float]] = {kind: [] for kind in ITERATION_KINDS}
        self.prefill_token_layers = 0  # summed over iterations
        self.start: float | None = None
        self._sink = sink

    @staticmethod
    def now() -> float:
        """The clock every time here is read from."""
        return time.perf_counter()

    def arrive(self, request_id: int, prompt_tokens: int) -> None:
        """A request was submitted."""
        now = self.now()
        self.start = now if self.start is None else self.start
        self.requests[request_id] = RequestTimes(arrival=now, prompt_tokens=prompt_tokens)

    def admit(self, request_id: int) -> None:
        """A request's prefill started."""
        self.requests[request_id].admitted = self.now()

    def token(self, request_id: int, when: float) -> None:
        """A request produced a token at `when`."""
        self.requests[request_id].token_times.append(when)

    def finish(self, request_id: int, reason: str) -> None:
        """A request ended; writes its JSON line when a sink was given."""
        times = self.requests[request_id]
        times.finish, times.finish_reason = self.now(), reason
        if self._sink is not None:
            line = json.dumps(times.as_dict(request_id)) + "\n"
            if isinstance(self._sink, str):
                with open(self._sink, "a", encoding="utf-8") as handle:
                    handle.write(line)
            else:
                self._sink.write(line)

    def memory(self, hbm_bytes: int) -> None:
        """Sample the device bytes in use (kept as a peak)."""
        self.hbm_peak_bytes = max(self.hbm_peak_bytes, hbm_bytes)

    def iteration(
        self, decode_rows: int, admitted_bytes: int, sat_out: int, seconds: float = 0.0, prefill_token_layers: int = 0
    ) -> None:
        """One Generator iteration ran `decode_rows` decodes (`sat_out` more were left out) with
        working sets totalling `admitted_bytes`, and `prefill_token_layers` of prefill, in `seconds`."""
        self.iterations += 1
        self.decode_rows += decode_rows
        self.sat_out += sat_out
        self.admitted_peak_bytes = max(self.admitted_peak_bytes, admitted_bytes)
        self.prefill_token_layers += prefill_token_layers
        if decode_rows:
            kind = "mixed" if prefill_token_layers else "decode"
        else:
            kind = "prefill" if prefill_token_layers else "idle"
        self.iteration_s[kind].append(seconds)

    def totals(self) -> dict[str, Any]:
        """Throughput and latency summaries over every request seen so far."""
        reqs = list(self.requests.values())
        tokens = sum(len(r.token_times) for r in reqs)
        times = [t for r in reqs for t in r.token_times]
        elapsed = (max(times) - self.start) if times and self.start is not None else 0.0
        return {
            "requests": len(reqs),
            "finished": sum(r.finish is not None for r in reqs),
            "generated_tokens": tokens,
            "elapsed_s": elapsed,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "mean_ttft_s": _mean([r.ttft for r in reqs]),
            "p50_ttft_s": _median([r.ttft for r in reqs]),
            "mean_tbt_s": _mean([x for r in reqs for x in r.tbt]),
            "p50_tbt_s": _median([x for r in reqs for x in r.tbt]),
            "mean_queueing_delay_s": _mean([r.queueing_delay for r in reqs]),
            "hbm_peak_bytes": self.hbm_peak_bytes,
            "iterations": self.iterations,
            "decode_rows": self.decode_rows,
            "mean_decode_batch": self.decode_rows / self.iterations if self.iterations else 0.0,
            "admitted_working_set_peak_bytes": self.admitted_peak_bytes,
            "sat_out": self.sat_out,
            "prefill_token_layers": self.prefill_token_layers,
            "iterations_by_kind": {
                kind: {"count": len(times), "total_s": sum(times), "p50_s": _median(times)}
                for kind, times in self.iteration_s.items()
            },
        }


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
