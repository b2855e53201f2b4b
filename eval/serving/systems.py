"""The systems the trace runs through, each in real time against the trace's arrival times.

Stock transformers: `model.generate` over static batches formed from what has arrived (optionally
with `DynamicCache(offloading=True)`), and transformers' own continuous batching (the manager
behind `generate_batch`, paged attention). Ours: `Generator` under a `SparseServeConfig`. Every
runner returns one `RequestRecord` per trace request, times in seconds from the run's start.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from eval.serving.metrics import RequestRecord
from eval.serving.trace import Trace, TraceRequest
from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.compat import cache_kwarg

PAD_ID = 0


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


def new_records(trace: Trace, rate: float) -> list[RequestRecord]:
    arrivals = trace.arrivals(rate)
    return [
        RequestRecord(arrival=a, prompt_tokens=len(r.prompt), index=r.index, output_tokens=r.output_tokens)
        for r, a in zip(trace.requests, arrivals)
    ]


# ---- stock generate: static batches of what has arrived ---------------------------------------------


class _StepTimes(BaseStreamer):
    """Streamer that stamps each generated step (its first `put` is the prompt)."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.times, self._seen_prompt = clock, [], False

    def put(self, value) -> None:
        if self._seen_prompt:
            self.times.append(self.clock.now())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def run_static_generate(
    model, trace: Trace, rate: float, budget: Budget, offloading: bool = False
) -> list[RequestRecord]:
    """FCFS static batches: whatever has arrived (up to the KV budget) runs to its longest output."""
    if offloading and model.device.type != "cuda":
        raise ValueError("stock offloading (DynamicCache(offloading=True)) needs a CUDA model")
    records, clock, first = new_records(trace, rate), Clock(), 0
    while first < len(records):
        clock.wait_until(records[first].arrival)
        batch = _static_batch(records, first, clock.now(), budget)
        for record in batch:
            record.admitted = clock.now()
        try:
            times = generate_step_times(model, [trace.requests[r.index] for r in batch], clock, offloading)
            for record in batch:
                record.token_times = times[: record.output_tokens]
        except torch.OutOfMemoryError as exc:  # a batch the cap cannot hold: its requests fail, the run goes on
            for record in batch:
                record.error = f"out of memory: {str(exc).splitlines()[0]}"
            torch.cuda.empty_cache()
        first += len(batch)
    return records


def _static_batch(records: list[RequestRecord], first: int, now: float, budget: Budget) -> list[RequestRecord]:
    """The arrived requests from `first` on whose left-padded batch KV fits the budget (at least one)."""
    batch = [records[first]]
    for record in records[first + 1 :]:
        if record.arrival > now or len(batch) == budget.max_batch:
            break
        grown = batch + [record]
        longest = max(r.prompt_tokens for r in grown) + max(r.output_tokens for r in grown)
        if len(grown) * longest * budget.kv_bytes_per_token > budget.kv_bytes:
            break
        batch = grown
    return batch


def generate_step_times(model, requests: list[TraceRequest], clock: Clock, offloading: bool) -> list[float]:
    """Run one left-padded static batch through `generate`; returns the time of each step's tokens."""
    longest = max(len(r.prompt) for r in requests)
    ids = torch.full((len(requests), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, request in enumerate(requests):
        ids[row, longest - len(request.prompt) :] = torch.tensor(request.prompt)
        mask[row, longest - len(request.prompt) :] = 1
    new_tokens = max(r.output_tokens for r in requests)
    streamer = _StepTimes(clock)
    caches = {cache_kwarg(model): DynamicCache(config=model.config, offloading=True)} if offloading else {}
    with torch.no_grad():
        model.generate(
            ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, streamer=streamer, pad_token_id=PAD_ID, **caches,
        )  # fmt: skip
    return streamer.times


# ---- stock continuous batching (the manager behind generate_batch) ----------------------------------


def run_continuous_batching(
    model, trace: Trace, rate: float, budget: Budget, block_size: int = 256
) -> list[RequestRecord]:
    """transformers' continuous batching with paged attention, requests added as they arrive."""
    from transformers import ContinuousBatchingConfig

    records, clock = new_records(trace, rate), Clock()
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(r.output_tokens for r in records))
    blocks = max(1, budget.kv_bytes // (block_size * budget.kv_bytes_per_token))
    size_field = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    cb_config = ContinuousBatchingConfig(
        **{size_field: block_size}, num_blocks=blocks, max_requests_per_batch=budget.max_batch
    )  # transformers 5.17 calls the page size block_size
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
    manager.start()
    try:
        by_id: dict[str, RequestRecord] = {}
        for record in records:
            while clock.now() < record.arrival and manager.is_running():
                _collect(manager, by_id, clock, timeout=min(0.05, max(0.0, record.arrival - clock.now())))
            request_id = manager.add_request(
                list(trace.requests[record.index].prompt), max_new_tokens=record.output_tokens, record_timestamps=True
            )
            if request_id is None:  # the manager refused it (its generation thread died)
                record.error = "dropped by the continuous-batching manager"
            else:
                by_id[request_id] = record
        while by_id and manager.is_running():
            _collect(manager, by_id, clock, timeout=1.0)
        for record in by_id.values():  # never finished: the manager stopped
            record.error = "the continuous-batching manager stopped before finishing it"
    finally:
        manager.stop(block=True)
    return records


def _collect(manager, by_id: dict[str, RequestRecord], clock: Clock, timeout: float) -> None:
    """Record (and forget) one finished result, if one comes within `timeout`."""
    result = manager.get_result(timeout=timeout)
    if result is None or not result.is_finished():
        return
    record = by_id.pop(result.request_id)
    record.admitted = clock.since_start(result.lifespan[0]) if result.lifespan[0] > 0 else None
    record.token_times = [clock.since_start(t) for t in (result.timestamps or [])]
    record.error = result.error


# ---- ours: the Generator ------------------------------------------------------------------------------


def run_generator(model, trace: Trace, rate: float, config: SparseServeConfig) -> list[RequestRecord]:
    """Requests submitted to a `Generator` as they arrive; one engine iteration whenever work is queued."""
    records, clock = new_records(trace, rate), Clock()
    gen, by_id, submitted = Generator(model, None, config), {}, 0
    while submitted < len(records) or gen.has_unfinished:
        while submitted < len(records) and records[submitted].arrival <= clock.now():
            request = trace.requests[submitted]
            params = SamplingParams(max_new_tokens=request.output_tokens, ignore_eos=True)
            by_id[gen.submit(list(request.prompt), params)] = records[submitted]
            submitted += 1
        if gen.has_unfinished:
            gen.step()
        else:
            clock.wait_until(records[submitted].arrival)
    for request_id, times in gen.metrics()["requests"].items():
        _fill_from_generator(by_id[request_id], times, clock)
    return records


def _fill_from_generator(record: RequestRecord, times: dict, clock: Clock) -> None:
    """The Generator's per-request times (relative to its submit) onto the trace's clock."""
    submitted = clock.since_start(times["arrival"])
    if times["admitted_s"] is not None:
        record.admitted = submitted + times["admitted_s"]
    record.token_times = [submitted + t for t in times["token_times_s"]]
    if times["finish_reason"] == "error":
        record.error = "the Generator failed this request"


Runner = Callable[..., list[RequestRecord]]
