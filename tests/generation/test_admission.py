"""Working-set admission under random arrivals: the cache budget holds and the hit rate does not drop."""

from __future__ import annotations

import random

import pytest
from gen_support import prompt

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig

BLOCK_BYTES = 2 * 16 * 16 * 4  # K+V x 16 tokens x head_dim 16 x fp32
SLOTS = 2 * 48  # 2 sparse layers


def run_trace(model, admission: bool, seed: int) -> tuple[Generator, int]:
    """10 requests of 150-300 tokens arriving at random steps; returns the engine and the most
    head-blocks one iteration's decode step touched (one decode step per `step()`: no decode ahead)."""
    config = SparseServeConfig(
        block_size=16,
        token_budget=64,
        hbm_cache_bytes=SLOTS * BLOCK_BYTES,
        max_batch=6,
        admission=admission,
        decode_ahead=False,
    )
    gen = Generator(model, None, config)
    rng = random.Random(seed)
    arrivals = sorted((rng.randrange(12), prompt(rng.randrange(150, 300), seed=seed * 100 + i)) for i in range(10))
    step, worst = 0, 0
    while arrivals or gen.has_unfinished:
        while arrivals and arrivals[0][0] <= step:
            gen.submit(arrivals.pop(0)[1], SamplingParams(max_new_tokens=16))
        before = gen.store.read_stats().blocks_selected
        gen.step()
        step += 1
        worst = max(worst, gen.store.read_stats().blocks_selected - before)
        assert gen.store.block_cache_bytes() <= config.hbm_cache_bytes
    return gen, worst


@pytest.mark.core
@pytest.mark.parametrize("seed", [0, 1])
def test_admitted_working_sets_never_exceed_the_cache(llama, seed):
    gen, worst = run_trace(llama, admission=True, seed=seed)
    totals = gen.metrics()["totals"]
    assert totals["admitted_working_set_peak_bytes"] <= SLOTS * BLOCK_BYTES
    assert worst <= SLOTS  # what a step actually touched fit in the cache
    assert totals["sat_out"] > 0  # the load was high enough for admission to say no
    assert totals["finished"] == 10 and totals["hbm_bytes_in_use"] == 0 and totals["dram_bytes_in_use"] == 0
    # what the budget cost, over every request's decode steps: one pick of 64 tokens per KV head (its
    # tail counted as the budget counts it) of 150-316 stored tokens
    assert totals["decode_steps"] > 0 and 0 < totals["loaded_fraction"] < 1
    assert 48 < totals["loaded_tokens_per_kv_head"] <= 64


def test_hit_rate_with_admission_is_at_least_without_under_load(llama):
    with_control, worst_with = run_trace(llama, admission=True, seed=0)
    without, worst_without = run_trace(llama, admission=False, seed=0)
    hit_with = with_control.metrics()["totals"]["hit_rate"]
    hit_without = without.metrics()["totals"]["hit_rate"]
    assert worst_without > worst_with  # without control a step outgrows what fits
    assert hit_with >= hit_without, (hit_with, hit_without)
    assert without.metrics()["totals"]["admitted_working_set_peak_bytes"] > SLOTS * BLOCK_BYTES


def first_to_second_token_waits(model, reserve_decode: bool) -> tuple[list[int], list[list[int]]]:
    """8 requests submitted at once into a cache whose slots serve a few decode rows: the iterations each
    request waited between its first and second tokens, and every request's tokens."""
    config = SparseServeConfig(
        block_size=16, token_budget=128, hbm_cache_bytes=80 * BLOCK_BYTES, reserve_decode=reserve_decode
    )
    gen = Generator(model, None, config)
    ids = [gen.submit(prompt(200, seed=70 + i), SamplingParams(max_new_tokens=10)) for i in range(8)]
    token_steps: dict[int, list[int]] = {i: [] for i in ids}
    outputs = {}
    step = 0
    while gen.has_unfinished:
        for event in gen.step():
            if event.token_id is not None:
                token_steps[event.request_id].append(step)
            if event.output is not None:
                outputs[event.request_id] = event.output.token_ids
        step += 1
    assert gen.metrics()["totals"]["hbm_bytes_in_use"] == 0
    return [token_steps[i][1] - token_steps[i][0] for i in ids], [outputs[i] for i in ids]


@pytest.mark.core
def test_reserving_decode_keeps_a_prefilled_request_from_waiting_for_its_second_token(llama):
    waits, tokens = first_to_second_token_waits(llama, reserve_decode=False)
    reserved_waits, reserved_tokens = first_to_second_token_waits(llama, reserve_decode=True)
    assert reserved_tokens == tokens
    assert max(waits) > 3  # the paper's rule: a late request's first token, then a wait for an older row to end
    assert max(reserved_waits) == 1  # a row and its bytes were reserved when its prefill started
