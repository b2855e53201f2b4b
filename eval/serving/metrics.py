"""Per-request serving records and what the report computes from them (pure Python)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from sparseserve_hf.generation.metrics import RequestTimes

# The paper's SLO (following Sarathi-Serve / Splitwise): p99 TBT <= 25 x one decode iteration of
# the dense baseline, and mean queueing delay <= 2 s.
SLO_TBT_ITERATIONS = 25.0
SLO_MEAN_QUEUEING_S = 2.0


@dataclass(kw_only=True)
class RequestRecord(RequestTimes):
    """One request's life in seconds from the start of the run (the trace's time zero): the
    Generator's own per-request times, plus the trace index, the output length asked for and an error."""

    index: int
    output_tokens: int
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**data)


def summarize(records: list[RequestRecord], dense_iteration_s: float | None = None) -> dict[str, Any]:
    """Means and tails over a run's requests, the SLO verdict where the dense iteration is known.

    Throughput counts generated tokens over the span from the first arrival to the last token.
    A request that failed or never produced its tokens counts against the SLO.
    """
    done = [r for r in records if r.error is None and r.token_times]
    tokens = sum(len(r.token_times) for r in done)
    last = max((r.token_times[-1] for r in done), default=None)
    span = None if last is None else last - min(r.arrival for r in records)
    tbt = [x for r in done for x in r.tbt]
    queueing = [r.queueing_delay for r in done if r.queueing_delay is not None]
    summary = {
        "requests": len(records),
        "completed": sum(len(r.token_times) >= r.output_tokens for r in done),
        "failed": sum(r.error is not None for r in records),
        "generated_tokens": tokens,
        "span_s": span,
        "throughput_tokens_per_s": tokens / span if span else 0.0,
        "mean_ttft_s": _mean([r.ttft for r in done]),
        "p50_ttft_s": _quantile([r.ttft for r in done], 0.5),
        "p99_ttft_s": _quantile([r.ttft for r in done], 0.99),
        "mean_tbt_s": _mean(tbt),
        "p50_tbt_s": _quantile(tbt, 0.5),
        "p99_tbt_s": _quantile(tbt, 0.99),
        "max_tbt_s": max(tbt, default=None),
        "mean_first_tbt_s": _mean([r.tbt[0] for r in done if r.tbt]),  # the wait after the first token
        "mean_queueing_s": _mean(queueing),
    }
    if dense_iteration_s is not None:
        summary["slo_tbt_s"] = SLO_TBT_ITERATIONS * dense_iteration_s
        summary["meets_slo"] = meets_slo(summary, dense_iteration_s)
    return summary


def meets_slo(summary: dict[str, Any], dense_iteration_s: float) -> bool:
    """p99 TBT and mean queueing delay within the SLO, and every request served in full."""
    if summary["failed"] or summary["completed"] < summary["requests"]:
        return False
    p99, queueing = summary["p99_tbt_s"], summary["mean_queueing_s"]
    if p99 is None or queueing is None:
        return False
    return p99 <= SLO_TBT_ITERATIONS * dense_iteration_s and queueing <= SLO_MEAN_QUEUEING_S


def goodput(points: dict[float, bool]) -> float:
    """Highest rate meeting the SLO with every lower measured rate meeting it too (0.0 if none)."""
    best = 0.0
    for rate in sorted(points):
        if not points[rate]:
            break
        best = rate
    return best


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def _quantile(values: list[float | None], q: float) -> float | None:
    """Nearest-rank quantile (the value at or above q of the sorted values)."""
    kept = sorted(v for v in values if v is not None)
    if not kept:
        return None
    return kept[min(len(kept) - 1, max(0, math.ceil(q * len(kept)) - 1))]
