"""GeneratorGroup (data parallel) on CPU: two engines, each with its own tiny Llama replica.

The group must give what one engine gives for the same requests, place a request where there
is room, and treat cancel, bad input and closed streams as one engine does, in its own ids.
"""

from __future__ import annotations

import copy

import pytest
from gen_support import prompt, tiny_model

from sparseserve_hf import Generator, GeneratorGroup, SamplingParams, SparseServeConfig

LENGTHS = (5, 37, 80, 130, 16, 61)


def small_config(**overrides) -> SparseServeConfig:
    return SparseServeConfig(**(dict(block_size=16, token_budget=48) | overrides))


def two_engines(config: SparseServeConfig) -> GeneratorGroup:
    model = tiny_model("llama")
    return GeneratorGroup([model, copy.deepcopy(model)], None, config)


@pytest.mark.core
def test_group_outputs_equal_one_engine_and_both_engines_serve():
    config = small_config(hbm_cache_bytes=1 << 20)
    prompts = [prompt(n, seed=n) for n in LENGTHS]
    params = SamplingParams(max_new_tokens=12)
    group = two_engines(config)
    outs = group.generate(prompts, params)
    alone = Generator(tiny_model("llama"), None, config).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert [o.request_id for o in outs] == list(range(len(prompts)))  # the group's own ids
    metrics = group.metrics()
    assert {r["engine"] for r in metrics["requests"].values()} == {0, 1}
    assert (
        metrics["totals"]["generated_tokens"]
        == 12 * len(prompts)
        == sum(e["generated_tokens"] for e in metrics["engines"])
    )
    assert group.dram_bytes_in_use() == 0 and not group.has_unfinished
    group.close()


@pytest.mark.core
def test_a_request_one_engine_would_hold_back_runs_on_the_other():
    """A cache with room for one prompt's prefill at a time: one engine admits the second request
    an iteration later; the group starts both at once, one per engine."""
    model = tiny_model("llama")
    probe = Generator(model, None, small_config(prefill_mode="full"))
    room = probe.sizes.prefill_bytes(130) + probe.sizes.prefill_bytes(130) // 2
    config = small_config(prefill_mode="full", hbm_cache_bytes=max(room, probe.sizes.one_row_hbm_cache_bytes))
    prompts, params = [prompt(130, seed=1), prompt(130, seed=2)], SamplingParams(max_new_tokens=4)
    single = Generator(model, None, config)
    for p in prompts:
        single.submit(p, params)
    group = GeneratorGroup([model, copy.deepcopy(model)], None, config)
    ids = [group.submit(p, params) for p in prompts]
    assert [group._where[i][0] for i in ids] == [0, 1]  # the second went where there was room
    assert len(single.step()) == 1  # one engine: the second request waits
    assert {event.request_id for event in group.step()} == set(ids)  # the group: both start now
    while group.has_unfinished:
        group.step()
    assert group.metrics()["totals"]["finished"] == 2


@pytest.mark.core
def test_cancel_bad_input_and_a_closed_stream_behave_as_on_one_engine():
    group = two_engines(small_config(hbm_cache_bytes=1 << 20))
    with pytest.raises(ValueError):
        group.submit([])  # an empty prompt: refused, nothing queued
    assert not group.has_unfinished and group.route() == 0
    with pytest.raises(TypeError, match="request_id"):
        group.cancel("0")
    keep, cancelled = group.submit(prompt(40, seed=3)), group.submit(prompt(50, seed=4))
    assert group.cancel(cancelled) and not group.cancel(999)
    finals = {}
    while group.has_unfinished:
        for event in group.step():
            if event.finished:
                finals[event.request_id] = event.output
    assert finals[cancelled].finish_reason == "cancelled" and finals[keep].finish_reason == "length"
    assert finals[keep].request_id == keep and group.request_times(keep)["ttft_s"] is not None
    outs = group.generate([prompt(20, seed=5), [10**9]], SamplingParams(max_new_tokens=3))  # an id past the vocab
    assert outs[0].finish_reason == "length" and outs[1].finish_reason == "error"
    stream = group.stream([prompt(70, seed=6), prompt(90, seed=7)], SamplingParams(max_new_tokens=50))
    next(stream)
    stream.close()  # the consumer broke off: both requests end and free their blocks
    assert not any(engine.has_unfinished for engine in group.engines)
    assert group.dram_bytes_in_use() == 0


def test_a_group_needs_distinct_replicas():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="own model replica"):
        GeneratorGroup([model, model])
    with pytest.raises(ValueError, match="at least one"):
        GeneratorGroup([])
    group = GeneratorGroup.replicate(model, None, small_config(), devices=["cpu", "cpu"])
    assert len(group.engines) == 2 and group.engines[1].model is not model


@pytest.mark.core
def test_an_engine_whose_step_raises_loses_no_other_engines_events():
    group = two_engines(small_config(hbm_cache_bytes=1 << 20))
    ids = [group.submit(prompt(40 + n, seed=n), SamplingParams(max_new_tokens=3)) for n in range(2)]
    assert sorted(group._where[i][0] for i in ids) == [0, 1]
    step, failed = group.engines[0].step, []

    def raising_once():
        if not failed:
            failed.append(True)
            raise RuntimeError("engine 0 broke")
        return step()

    group.engines[0].step = raising_once
    with pytest.raises(RuntimeError, match="engine 0 broke"):
        group.step()
    finals = {}
    while group.has_unfinished:
        for event in group.step():
            finals.setdefault(event.request_id, []).append(event.token_id)
    assert all(len([t for t in finals[i] if t is not None]) == 3 for i in ids)  # engine 1's first token kept
    group.close()
