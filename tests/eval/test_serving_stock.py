"""eval.serving.stock's static batches: warmed at every batch size a saturated run starts with, and
run at the largest batch the cap holds (a batch that breaks it runs again with one row fewer)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from eval.bench.decode_step_setup import build_model
from eval.serving.common import Budget, new_records
from eval.serving.setup import kv_bytes_per_token
from eval.serving.stock import (
    run_static_generate,
    saturated_batch_sizes,
    static_cache_len,
    warm_static_generate,
)
from eval.serving.trace import build_trace

from sparseserve_hf.compat import cache_kwarg


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", "sdpa", "cpu", torch.float32, 128)


@pytest.fixture
def trace():
    return build_trace([10 + i % 240 for i in range(900)], num_requests=5, prompt_range=(40, 60), output_range=(3, 5))


def rows_seen(model, cap_rows: int | None = None) -> tuple[list[int], object]:
    """Record the batch size of every forward; past `cap_rows` rows a forward fails as the cap would."""
    seen = []

    def hook(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append(ids.shape[0])
        if cap_rows is not None and ids.shape[0] > cap_rows:
            raise torch.OutOfMemoryError(f"{ids.shape[0]} rows do not fit")

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_warm_up_runs_every_size_of_the_first_batch(model, trace):
    budget = Budget(kv_bytes=1 << 30, kv_bytes_per_token=kv_bytes_per_token(model), max_batch=3)
    seen, handle = rows_seen(model)
    try:
        rows = warm_static_generate(model, trace, budget)
    finally:
        handle.remove()
    assert rows == 3
    assert list(dict.fromkeys(seen)) == [3, 2, 1]  # each size's prefill and decode steps, largest first


def test_a_saturated_warm_up_runs_only_the_sizes_the_run_forms(model, trace):
    """5 requests at time zero, 3 rows at most: the run forms batches of 3 and 2, never 1."""
    budget = Budget(kv_bytes=1 << 30, kv_bytes_per_token=kv_bytes_per_token(model), max_batch=3)
    seen, handle = rows_seen(model)
    try:
        rows = warm_static_generate(model, trace, budget, saturated_only=True)
        warmed = list(dict.fromkeys(seen))
        seen.clear()
        result = run_static_generate(model, trace, math.inf, budget, rows_cap=rows)
    finally:
        handle.remove()
    assert rows == 3 and warmed == [3, 2]
    assert result.engine["batch_sizes"] == [3, 2] and set(seen) == set(warmed)
    six = replace(trace, requests=[*trace.requests, replace(trace.requests[0], index=5)])
    assert saturated_batch_sizes(new_records(six, math.inf), budget, 3) == [3]
    assert saturated_batch_sizes(new_records(six, math.inf), budget, 4) == [4, 2]


def test_a_batch_the_cap_cannot_hold_runs_again_with_fewer_rows(model, trace):
    budget = Budget(kv_bytes=1 << 30, kv_bytes_per_token=kv_bytes_per_token(model), max_batch=4)
    seen, handle = rows_seen(model, cap_rows=2)
    try:
        assert warm_static_generate(model, trace, budget) == 2
        result = run_static_generate(model, trace, math.inf, budget)  # not told: it finds the rows itself
    finally:
        handle.remove()
    assert result.engine["batch_sizes"] == [2, 2, 1] and result.engine["rows_cap"] == 2
    assert all(r.error is None and len(r.token_times) == r.output_tokens for r in result.records)
    assert max(seen) == 4  # the first batch tried every row the budget allowed before it was cut
    seen, handle = rows_seen(model)
    try:
        told = run_static_generate(model, trace, math.inf, budget, rows_cap=2)  # as the warm-up found
    finally:
        handle.remove()
    assert told.engine["batch_sizes"] == [2, 2, 1] and max(seen) == 2  # no batch past it is tried


def test_a_request_no_batch_holds_fails_alone(model, trace):
    budget = Budget(kv_bytes=1 << 30, kv_bytes_per_token=kv_bytes_per_token(model), max_batch=2)
    _, handle = rows_seen(model, cap_rows=0)
    try:
        with pytest.raises(ValueError, match="holds no single request"):
            warm_static_generate(model, trace, budget)
        result = run_static_generate(model, trace, math.inf, budget)
    finally:
        handle.remove()
    assert all(r.error and "1 rows do not fit" in r.error for r in result.records)
    assert result.engine["batch_sizes"] == [1] * len(trace.requests)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_each_cache_serves_every_request_in_full(model, trace, cache):
    budget = Budget(kv_bytes=1 << 30, kv_bytes_per_token=kv_bytes_per_token(model), max_batch=2)
    result = run_static_generate(model, trace, math.inf, budget, cache=cache)
    assert all(r.error is None and len(r.token_times) == r.output_tokens for r in result.records)
    assert result.engine["batch_sizes"] == [2, 2, 1]
    with pytest.raises(ValueError, match="unknown cache 'paged'"):
        run_static_generate(model, trace, math.inf, budget, cache="paged")


def test_a_static_run_keeps_one_cache_length_from_its_warm_up_on(model, trace):
    """generate compiles its static-cache forward per cache length: every batch, warm-up included,
    uses the run's longest prompt plus longest output, so no batch of the timed run compiles again."""
    last = trace.requests[-1]
    trace = replace(
        trace, requests=[*trace.requests[:-1], replace(last, prompt=last.prompt * 2)]
    )  # the last batch longest
    budget = Budget(kv_bytes=1 << 30, kv_bytes_per_token=kv_bytes_per_token(model), max_batch=2)
    model.__dict__.pop("_previous_max_cache_length", None)  # generate's memory of earlier calls' lengths
    name, lengths = cache_kwarg(model), []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs[name].layers[0].max_cache_len), with_kwargs=True
    )
    try:
        rows = warm_static_generate(model, trace, budget, cache="static")
        warm_calls = len(lengths)
        result = run_static_generate(model, trace, math.inf, budget, cache="static", rows_cap=rows)
    finally:
        handle.remove()
    assert all(r.error is None and len(r.token_times) == r.output_tokens for r in result.records)
    assert 0 < warm_calls < len(lengths)
    assert set(lengths) == {static_cache_len(trace.requests)}
    assert static_cache_len(trace.requests) == max(len(r.prompt) for r in trace.requests) + max(
        r.output_tokens for r in trace.requests
    )
