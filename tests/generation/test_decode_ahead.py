"""`decode_ahead`: the next decode step launched before the current one is read back gives the same
tokens, and a stop token, NaN logits, a cancel or a failed launch in flight keep the fault contract."""

from __future__ import annotations

import pytest
from fault_support import Fault, arm, assert_drained, check_against_fault_free, drain, ended_once
from gen_support import prompt

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig

CONFIG = SparseServeConfig(block_size=16, token_budget=48, decode_ahead=True)
PROMPTS = (20, 45, 33, 60)


def params_for(stop_token: int | None = None) -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=14),
        SamplingParams(max_new_tokens=9, temperature=0.8, top_k=50, seed=7),
        SamplingParams(max_new_tokens=20, stop_token_ids=() if stop_token is None else (stop_token,)),
        SamplingParams(max_new_tokens=17),
    ]


def run(model, config: SparseServeConfig, params: list[SamplingParams], setup=None) -> tuple[Generator, list, list]:
    """Submit the prompts, step until every request decodes, call `setup(gen, ids)`, drain; returns
    the engine, the request ids and every event."""
    gen = Generator(model, None, config)
    ids = [gen.submit(prompt(n, seed=n), p) for n, p in zip(PROMPTS, params)]
    events = gen.step() + gen.step() + gen.step()
    if setup is not None:
        events += setup(gen, ids)
    return gen, ids, events + drain(gen)


def without_ahead(model, params: list[SamplingParams]) -> list:
    config = SparseServeConfig(**(CONFIG.to_dict() | {"decode_ahead": False}))
    return Generator(model, None, config).generate([prompt(n, seed=n) for n in PROMPTS], params)


def stepped(model, config: SparseServeConfig, params: list[SamplingParams]) -> tuple[Generator, list, list, list]:
    """The requests stepped to the end: the engine, the ids, every event, and after each `step()`
    whether a decode step was left in flight and every request's working set (`metrics()`)."""
    gen = Generator(model, None, config)
    ids = [gen.submit(prompt(n, seed=n), p) for n, p in zip(PROMPTS, params)]
    events, in_flight, sets = [], [], []
    while gen.has_unfinished:
        events += gen.step()
        in_flight.append(gen._ahead is not None)
        sets.append({rid: r["working_set_blocks"] for rid, r in gen.metrics()["requests"].items()})
    return gen, ids, events, (in_flight, sets)


@pytest.mark.core
@pytest.mark.parametrize("rows_per_step", [None, 2], ids=["all-rows", "two-rows-others-wait"])
def test_steps_launched_ahead_give_the_tokens_of_steps_launched_in_turn(llama, rows_per_step):
    """Greedy, seeded sampling, different lengths and a stop token mid-way (that row decodes one
    token more, dropped), every request decoding or (an HBM cache of two rows) two at a time while
    the others wait: every output and every iteration's working sets equal the run without decode
    ahead (each iteration reads one step back either way), and steps really were in flight between
    iterations."""
    config = CONFIG
    if rows_per_step is not None:
        rows_bytes = rows_per_step * Generator(llama, None, CONFIG).sizes.one_row_hbm_cache_bytes
        config = SparseServeConfig(**(CONFIG.to_dict() | {"hbm_cache_bytes": rows_bytes}))
    stop = without_ahead(llama, params_for())[2].token_ids[5]  # the third request ends at its sixth token instead
    params = params_for(stop)
    in_turn = SparseServeConfig(**(config.to_dict() | {"decode_ahead": False}))
    _, ref_ids, ref_events, (ref_in_flight, ref_sets) = stepped(llama, in_turn, params)
    gen, ids, events, (in_flight, sets) = stepped(llama, config, params)
    reference, outputs = ended_once(ref_events, ref_ids), ended_once(events, ids)
    assert reference[ref_ids[2]].finish_reason == "stop" and len(reference[ref_ids[2]].token_ids) <= 6
    assert [(o.token_ids, o.finish_reason) for o in map(outputs.get, ids)] == [
        (o.token_ids, o.finish_reason) for o in map(reference.get, ref_ids)
    ]
    assert sets == ref_sets  # the steps' decode counts reached the working-set tracker in turn
    assert sum(in_flight) >= 5 and not any(ref_in_flight)  # most decode iterations left the next step running
    assert_drained(gen)


@pytest.mark.parametrize("rows", [[1], None], ids=["one-row", "all-rows"])
def test_nan_logits_in_a_step_launched_ahead_end_the_bad_rows_only(llama, monkeypatch, rows):
    params = params_for()
    reference = dict(enumerate(without_ahead(llama, params)))

    def poison_next_head(gen, ids):
        assert gen._ahead is not None  # the next step is in flight: the fault lands on the one after
        fault = Fault(at=1, kind="nan", rows=rows)
        with monkeypatch.context() as mp:
            arm(mp, gen, "head", fault)
            events = gen.step()
        assert fault.fired
        return events

    gen, ids, events = run(llama, CONFIG, params, poison_next_head)
    outputs = ended_once(events, ids)
    failed = check_against_fault_free(outputs, {rid: reference[i] for i, rid in enumerate(ids)})
    assert failed == (1 if rows else 4)
    assert all("non-finite" in o.error for o in outputs.values() if o.finish_reason == "error")
    assert_drained(gen)


def test_a_cancel_while_a_step_is_in_flight_ends_that_request_only(llama):
    params = params_for()
    reference = dict(enumerate(without_ahead(llama, params)))

    def cancel_first(gen, ids):
        assert gen._ahead is not None
        assert gen.cancel(ids[0])
        return gen.step()

    gen, ids, events = run(llama, CONFIG, params, cancel_first)
    outputs = ended_once(events, ids)
    assert outputs[ids[0]].finish_reason == "cancelled"
    assert outputs[ids[0]].token_ids == reference[0].token_ids[: len(outputs[ids[0]].token_ids)]
    for i, rid in enumerate(ids[1:], start=1):
        assert (outputs[rid].token_ids, outputs[rid].finish_reason) == (
            reference[i].token_ids,
            reference[i].finish_reason,
        )
    assert_drained(gen)


@pytest.mark.parametrize("kind", ["raise", "raise_after"])
def test_a_failed_launch_ahead_ends_the_batch_after_the_tokens_before_it(llama, monkeypatch, kind):
    """A decoder layer raising while the next step is launched ahead: the step read back in the same
    iteration still delivers its tokens, then the batch ends with "error" (its layers may be half
    advanced); the engine serves a fresh request and nothing leaks."""
    params = params_for()
    reference = dict(enumerate(without_ahead(llama, params)))

    def fail_next_launch(gen, ids):
        fault = Fault(at=1, kind=kind)
        with monkeypatch.context() as mp:
            arm(mp, gen, "layer", fault, layer=1)
            events = gen.step()
        assert fault.fired
        return events

    gen, ids, events = run(llama, CONFIG, params, fail_next_launch)
    outputs = ended_once(events, ids)
    assert check_against_fault_free(outputs, {rid: reference[i] for i, rid in enumerate(ids)}) == 4
    assert all(len(o.token_ids) >= 4 for o in outputs.values())  # three iterations, then the read-back step
    fresh = prompt(25, seed=99)
    greedy = SamplingParams(max_new_tokens=8)
    assert (
        gen.generate([fresh], greedy)[0].token_ids
        == Generator(llama, None, CONFIG).generate([fresh], greedy)[0].token_ids
    )
    assert_drained(gen)


def test_a_failed_launch_ahead_is_forgotten_once_its_batch_has_failed(llama, monkeypatch):
    """Launching ahead fails and then reading the current step fails too: the batch ends once, and
    the launch's error does not end a later, healthy batch."""
    from sparseserve_hf.generation import in_flight

    params = params_for()

    def fail_launch_then_read(gen, ids):
        assert gen._ahead is not None  # this iteration reads a step in flight: its one launch is ahead
        launches, reads = Fault(at=1), Fault(at=1)
        with monkeypatch.context() as mp:
            mp.setattr(gen, "_launch_decode", launches.wrap(gen._launch_decode))
            mp.setattr(in_flight.InFlightStep, "read", reads.wrap(in_flight.InFlightStep.read))
            events = gen.step()
        assert launches.fired and reads.fired
        return events

    gen, ids, events = run(llama, CONFIG, params, fail_launch_then_read)
    assert all(o.finish_reason == "error" for o in ended_once(events, ids).values())
    fresh = [prompt(25, seed=99), prompt(40, seed=98)]
    greedy = SamplingParams(max_new_tokens=8)
    outs = gen.generate(fresh, greedy)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert [o.token_ids for o in outs] == [o.token_ids for o in Generator(llama, None, CONFIG).generate(fresh, greedy)]
    assert_drained(gen)


def test_an_iteration_counts_only_the_rows_it_decoded(llama):
    """A row that a stop token ended decodes one token more in the step launched ahead: the engine's
    decode-row count is the run's without decode ahead."""
    stop = without_ahead(llama, params_for())[2].token_ids[5]
    params = params_for(stop)
    in_turn = SparseServeConfig(**(CONFIG.to_dict() | {"decode_ahead": False}))
    ref, _, _, _ = stepped(llama, in_turn, params)
    gen, _, _, (in_flight, _) = stepped(llama, CONFIG, params)
    assert any(in_flight)
    assert gen.metrics()["totals"]["decode_rows"] == ref.metrics()["totals"]["decode_rows"]
