"""Stock transformers under the trace: `model.generate` over static batches formed from what has
arrived (with a `DynamicCache`, `DynamicCache(offloading=True)` or `cache_implementation="static"`,
which `generate` compiles on a GPU), and transformers' own continuous batching (the manager behind
`generate_batch`, paged attention)."""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import replace

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from eval.serving.common import (
    PREFILL_CHUNK,
    WARMUP_NEW_TOKENS,
    Budget,
    Clock,
    QueueingStop,
    RunResult,
    cuda_peak_bytes,
    fail_unfinished,
    new_records,
    out_of_memory,
    progress,
    warmup_request,
)
from eval.serving.metrics import RequestRecord
from eval.serving.trace import Trace, TraceRequest
from sparseserve_hf.compat import cache_kwarg

PAD_ID = 0


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


CACHES = ("dynamic", "offloaded", "static")  # generate's cache: DynamicCache, offloaded, static (compiled)


def warm_static_generate(
    model, trace: Trace, budget: Budget, cache: str = "dynamic", saturated_only: bool = False
) -> int:
    """One call of every batch shape a run may form, each with WARMUP_NEW_TOKENS new tokens: the batch
    `run_static_generate` forms at time zero, then one row fewer down to 1 (decode kernels are chosen
    per batch size, a process's first steps at a new size pay for it, and a static cache compiles
    per size). `saturated_only`: the run is saturated (every request at time zero), so only the sizes
    of the batches it forms are warmed (`saturated_batch_sizes`): no size it never runs is compiled.

    Returns the rows the cap held: a batch that does not fit is retried with one row fewer."""
    records = new_records(trace, math.inf)
    rows = len(_static_batch(records, 0, 0.0, budget))
    cache_len = static_cache_len(trace.requests)
    while rows >= 1:
        first = [replace(trace.requests[i], output_tokens=WARMUP_NEW_TOKENS) for i in range(rows)]
        sizes = saturated_batch_sizes(records, budget, rows) if saturated_only else range(rows, 0, -1)
        try:
            for size in sizes:
                generate_step_times(model, first[:size], Clock(), cache, cache_len=cache_len)
            return rows
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            rows -= 1
    raise ValueError("the HBM cap holds no single request of this trace for stock generate")


def saturated_batch_sizes(records: list[RequestRecord], budget: Budget, rows: int) -> list[int]:
    """The distinct sizes, largest first, of the static batches a saturated run of `records` forms
    with at most `rows` rows (every request arrived at time zero, so the batches are fixed)."""
    capped, sizes, first = replace(budget, max_batch=rows), set(), 0
    while first < len(records):
        size = len(_static_batch(records, first, 0.0, capped))
        sizes.add(size)
        first += size
    return sorted(sizes, reverse=True)


def run_static_generate(
    model,
    trace: Trace,
    rate: float,
    budget: Budget,
    cache: str = "dynamic",
    deadline_s: float = math.inf,
    rows_cap: int | None = None,
    stop_queueing_s: float | None = None,
) -> RunResult:
    """FCFS static batches: whatever has arrived (up to the KV budget) runs to its longest output.

    A batch the cap cannot hold (the torch.cat-grown cache fragments the allocator past the budget's
    arithmetic) runs again with one row fewer, and later batches keep that many rows at most: stock
    at the largest batch that runs. `rows_cap`: the rows to start from (`warm_static_generate`'s).
    `stop_queueing_s`: stop once the queue grows past it (`QueueingStop`); the engine's
    `stopped_at_s` says when."""
    if cache not in CACHES:
        raise ValueError(f"unknown cache {cache!r}; one of {', '.join(CACHES)}")
    if cache == "offloaded" and model.device.type != "cuda":
        raise ValueError("stock offloading (DynamicCache(offloading=True)) needs a CUDA model")
    records, clock, first, batch_sizes = new_records(trace, rate), Clock(), 0, []
    cache_len = static_cache_len(trace.requests)
    rows_cap = budget.max_batch if rows_cap is None else min(rows_cap, budget.max_batch)
    by_index = {r.index: r for r in trace.requests}
    queue = QueueingStop(stop_queueing_s)
    with progress(len(records), f"static generate at {rate:g} req/s") as bar:
        while first < len(records) and records[first].arrival < deadline_s:
            clock.wait_until(records[first].arrival)
            now = clock.now()
            if queue.stop(first, now - records[first].arrival, now):
                break
            batch = _static_batch(records, first, clock.now(), replace(budget, max_batch=rows_cap))
            for record in batch:
                record.admitted = clock.now()
            try:
                requests = [by_index[r.index] for r in batch]
                left = None if math.isinf(deadline_s) else max(0.0, deadline_s - clock.now())
                times = generate_step_times(model, requests, clock, cache, max_time=left, cache_len=cache_len)
                for record in batch:
                    record.token_times = times[: record.output_tokens]
            except torch.OutOfMemoryError as exc:
                torch.cuda.empty_cache()
                if len(batch) > 1:  # the cap holds fewer rows than the budget's arithmetic: retry with one fewer
                    rows_cap = len(batch) - 1
                    continue
                batch[0].error = out_of_memory(exc)  # one request the cap cannot hold fails, the run goes on
            batch_sizes.append(len(batch))
            first += len(batch)
            bar.update(len(batch))
    queue.fail_unstarted(records)
    fail_unfinished(records, deadline_s)
    engine = {"batch_sizes": batch_sizes, "rows_cap": rows_cap, "stopped_at_s": queue.stopped_at_s}
    return RunResult(records, engine | cuda_peak_bytes(model))


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


def static_cache_len(requests: list[TraceRequest]) -> int:
    """Tokens of the static cache that every batch of `requests` uses: the longest prompt plus the
    longest output. One length for the whole run: `generate` compiles its static-cache forward for
    each new cache length, so a cache sized per batch (its default, the longest so far) would compile
    again inside the timed run whenever a batch is longer than every one before it."""
    return max(len(r.prompt) for r in requests) + max(r.output_tokens for r in requests)


def generate_step_times(
    model,
    requests: list[TraceRequest],
    clock: Clock,
    cache: str = "dynamic",
    max_time: float | None = None,
    cache_len: int | None = None,
) -> list[float]:
    """Run one left-padded static batch through `generate` with `cache` (one of CACHES; stopped after
    `max_time` seconds, if given); returns the time of each step's tokens. `cache_len`: the static
    cache's tokens (at least this batch's; None: `generate`'s own sizing)."""
    longest = max(len(r.prompt) for r in requests)
    ids = torch.full((len(requests), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, request in enumerate(requests):
        ids[row, longest - len(request.prompt) :] = torch.tensor(request.prompt)
        mask[row, longest - len(request.prompt) :] = 1
    new_tokens = max(r.output_tokens for r in requests)
    streamer = _StepTimes(clock)
    # generate's chunked prefill: a padded batch's whole-prompt prefill (its 4D mask alone is B x T^2)
    # does not fit beside the KV under the cap
    if cache == "static":  # generate builds it (cache_len tokens, else the longest so far) and compiles on a GPU
        how = {"cache_implementation": "static", "max_cache_len": cache_len}
    else:
        how = {cache_kwarg(model): DynamicCache(config=model.config, offloading=cache == "offloaded")}
    with torch.no_grad():
        model.generate(
            ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, streamer=streamer, pad_token_id=PAD_ID,
            prefill_chunk_size=PREFILL_CHUNK, max_time=max_time, **how,
        )  # fmt: skip
    return streamer.times


# ---- stock continuous batching (the manager behind generate_batch) ----------------------------------


def run_continuous_batching(
    model,
    trace: Trace,
    rate: float,
    budget: Budget,
    block_size: int = 256,
    batch_tokens: int = PREFILL_CHUNK,
    deadline_s: float = math.inf,
) -> RunResult:
    """transformers' continuous batching with paged attention, requests added as they arrive.

    `batch_tokens` caps the tokens of one forward (prefill is chunked to it, as in vLLM): left to
    itself the manager sizes it from free memory, and the logits of that many tokens break the cap.
    """
    from transformers import ContinuousBatchingConfig

    warmup = warmup_request(trace)
    longest = max(r.output_tokens for r in trace.requests)
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(longest, warmup.output_tokens))
    blocks = max(1, budget.kv_bytes // (block_size * budget.kv_bytes_per_token))
    size_field = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    # transformers 5.17 calls the page size block_size; async double-buffering would double the memory
    cb_config = ContinuousBatchingConfig(
        **{size_field: block_size}, num_blocks=blocks, max_requests_per_batch=budget.max_batch,
        max_batch_tokens=batch_tokens, use_async_batching=False,
    )  # fmt: skip
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
    manager.start()
    try:
        _serve_warmup(manager, warmup)
        records, clock = new_records(trace, rate), Clock()
        by_id: dict[str, RequestRecord] = {}
        with progress(len(records), f"continuous batching at {rate:g} req/s") as bar:
            for record in records:
                while clock.now() < min(record.arrival, deadline_s) and manager.is_running():
                    wait = min(0.05, max(0.0, record.arrival - clock.now()))
                    bar.update(_collect(manager, by_id, clock, timeout=wait))
                if clock.now() >= deadline_s:
                    break
                request_id = manager.add_request(
                    list(trace.requests[record.index].prompt), max_new_tokens=record.output_tokens,
                    record_timestamps=True,
                )  # fmt: skip
                if request_id is None:  # the manager refused it (its generation thread died)
                    record.error = "dropped by the continuous-batching manager"
                else:
                    by_id[request_id] = record
            while by_id and manager.is_running() and clock.now() < deadline_s:
                bar.update(_collect(manager, by_id, clock, timeout=1.0))
        if not manager.is_running():  # its generation thread died (the deadline's are failed below)
            for record in by_id.values():
                record.error = "the continuous-batching manager stopped before finishing it"
    finally:
        manager.stop(block=True)
    fail_unfinished(records, deadline_s)
    return RunResult(records, cuda_peak_bytes(model))


def _serve_warmup(manager, warmup: TraceRequest, timeout_s: float = 600.0) -> None:
    """Serve the warm-up request to its end (or until the manager stops or `timeout_s` passes)."""
    request_id = manager.add_request(list(warmup.prompt), max_new_tokens=warmup.output_tokens)
    deadline = time.perf_counter() + timeout_s
    while request_id is not None and manager.is_running() and time.perf_counter() < deadline:
        result = manager.get_result(timeout=1.0)
        if result is not None and result.request_id == request_id and result.is_finished():
            return


def _collect(manager, by_id: dict[str, RequestRecord], clock: Clock, timeout: float) -> int:
    """Record (and forget) one finished result, if one comes within `timeout`; returns how many (0 or 1)."""
    result = manager.get_result(timeout=timeout)
    if result is None or not result.is_finished() or result.request_id not in by_id:
        return 0
    record = by_id.pop(result.request_id)
    record.admitted = clock.since_start(result.lifespan[0]) if result.lifespan[0] > 0 else None
    record.token_times = [clock.since_start(t) for t in (result.timestamps or [])]
    record.error = result.error
    return 1
