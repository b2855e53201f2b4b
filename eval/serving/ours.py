"""Ours under the trace: requests submitted to a `Generator` as they arrive."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from eval.bench.selection_trace import SelectionTrace, TraceReplay
from eval.serving.common import (
    Clock,
    RunResult,
    fail_unfinished,
    new_records,
    out_of_memory,
    progress,
    warmup_batch,
)
from eval.serving.metrics import RequestRecord
from eval.serving.trace import Trace
from sparseserve_hf import Generator, SamplingParams, SparseServeConfig


def warmed_generator(model, trace: Trace, config: SparseServeConfig, selection_trace: Path | None = None) -> Generator:
    """A Generator that has served the warm-up batch (kernels compiled, pools allocated); with
    `selection_trace`, its loads replay that recording (real locality) from the warm-up on."""
    gen = Generator(model, None, config)
    if selection_trace is not None:
        text = model.config
        recorded = SelectionTrace.load(selection_trace)
        gen.store.selection_override = TraceReplay(
            recorded, text.num_hidden_layers, text.num_key_value_heads, model.device
        )
    warmup = warmup_batch(trace)
    gen.generate(
        [list(r.prompt) for r in warmup], SamplingParams(max_new_tokens=warmup[0].output_tokens, ignore_eos=True)
    )
    return gen


def run_generator(gen: Generator, trace: Trace, rate: float, deadline_s: float = math.inf) -> RunResult:
    """Requests submitted to `gen` as they arrive; one engine iteration whenever work is queued.

    Requests unfinished at the deadline are cancelled, so `gen` can serve the next run.
    """
    before = gen.metrics()["totals"]
    records, clock, by_id, submitted = new_records(trace, rate), Clock(), {}, 0
    with progress(len(records), f"Generator at {rate:g} req/s") as bar:
        while (submitted < len(records) or gen.has_unfinished) and clock.now() < deadline_s:
            while submitted < len(records) and records[submitted].arrival <= clock.now():
                request = trace.requests[submitted]
                params = SamplingParams(max_new_tokens=request.output_tokens, ignore_eos=True)
                try:
                    by_id[gen.submit(list(request.prompt), params)] = records[submitted]
                except ValueError as exc:  # a prompt the Generator can never run fails alone, with its reason
                    records[submitted].error = str(exc)
                    bar.update(1)
                submitted += 1
            if not gen.has_unfinished:
                if submitted == len(records):  # the last arrival was refused at submit: nothing left
                    break
                clock.wait_until(min(records[submitted].arrival, deadline_s))
                continue
            try:
                events = [event for event in gen.step() if event.request_id in by_id]
            except torch.OutOfMemoryError as exc:  # the cap broke: report what was served, fail the rest
                result = _failed_run(records, by_id, gen, clock, out_of_memory(exc))
                _drain(gen, by_id)
                return result
            for event in events:
                if event.finished and event.output.error:  # why the Generator failed it, kept for the record
                    by_id[event.request_id].error = event.output.error
            bar.update(sum(event.finished for event in events))
    _drain(gen, by_id)
    metrics = gen.metrics()
    for request_id, record in by_id.items():
        _fill_from_generator(record, metrics["requests"][request_id], clock)
    fail_unfinished(records, deadline_s)
    return RunResult(records, engine_totals_since(metrics["totals"], before) | {"config": gen.config.to_dict()})


def _drain(gen: Generator, request_ids: Iterable[int]) -> None:
    """Cancel this run's unfinished requests and take every event still due, so that the next run
    on `gen` starts from an empty engine (no final event of this run comes out of its steps)."""
    for request_id in request_ids:
        gen.cancel(request_id)
    while gen.has_unfinished:  # also True while a cancelled request's final event waits
        gen.step()


def _failed_run(records: list[RequestRecord], by_id: dict, gen: Generator, clock: Clock, error: str) -> RunResult:
    """The run as far as it got: finished requests keep their times, every other one fails with `error`."""
    metrics = gen.metrics()
    for request_id, record in by_id.items():
        times = metrics["requests"][request_id]
        if times["finish_reason"] is not None:
            _fill_from_generator(record, times, clock)
    for record in records:
        if not record.token_times or len(record.token_times) < record.output_tokens:
            record.error = record.error or error
    return RunResult(records, {"aborted": error})


def _fill_from_generator(record: RequestRecord, times: dict, clock: Clock) -> None:
    """The Generator's per-request times (relative to its submit) onto the trace's clock."""
    submitted = clock.since_start(times["arrival"])
    if times["admitted_s"] is not None:
        record.admitted = submitted + times["admitted_s"]
    record.token_times = [submitted + t for t in times["token_times_s"]]
    if times["finish_reason"] == "error":
        record.error = record.error or "the Generator failed this request"
    elif times["finish_reason"] == "cancelled":
        record.error = "cancelled at the run's deadline"


COUNTED = (
    "hits", "misses", "h2d_bytes", "iterations", "decode_rows", "prefill_token_layers", "sat_out", "graph_captures",
    "graph_capture_s",
)  # fmt: skip
PEAKS = ("hbm_peak_bytes", "admitted_working_set_peak_bytes", "hbm_cache_bytes", "cuda_peak_bytes")


def engine_totals_since(totals: dict[str, Any], warmup: dict[str, Any]) -> dict[str, Any]:
    """The Generator's counters since `warmup` (its totals then: a warm-up's taken out), and its peaks.

    Per-request latencies are left out: `summarize` computes them from the records on one clock.
    """
    out = {key: totals[key] - warmup[key] for key in COUNTED}
    out |= {key: totals[key] for key in PEAKS if key in totals}
    looked_up = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / looked_up if looked_up else 0.0
    out["mean_decode_batch"] = out["decode_rows"] / out["iterations"] if out["iterations"] else 0.0
    out["iterations_by_kind"] = {
        kind: {"count": now["count"] - warmup["iterations_by_kind"][kind]["count"],
               "total_s": now["total_s"] - warmup["iterations_by_kind"][kind]["total_s"]}
        for kind, now in totals["iterations_by_kind"].items()
    }  # fmt: skip
    return out
