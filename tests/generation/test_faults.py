"""Fault containment of the Generator: a failure while serving one request (its forward, its logits,
its sampling, its block transfers) ends that request, or the decode batch it was in, with
finish_reason "error" and a message; the engine keeps serving; no block, slot or byte leaks; the
other requests get their fault-free tokens.

The first tests pin one failure each; `test_random_faults_keep_the_contract` injects seeded faults
at random calls of every fault site (tests/generation/fault_support.py) under three engine setups.
"""

from __future__ import annotations

import random

import pytest
import torch
from fault_support import (
    SITES,
    Fault,
    arm,
    assert_drained,
    check_against_fault_free,
    drain,
    ended_once,
)
from gen_support import prompt

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig

CONFIG = SparseServeConfig(block_size=16, token_budget=48, decode_ahead=False)  # faults at pinned iterations
GREEDY = SamplingParams(max_new_tokens=8)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on tensors this small two threads only add sync overhead (most of a
    trial's time on a loaded 2-core machine). Fault-free references run under the same setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def sampling(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=8, temperature=0.8, top_k=50, seed=seed)


def fault_free(model, prompts, params, config: SparseServeConfig = CONFIG) -> list:
    """The outputs of the same requests on a fresh engine with nothing failing."""
    return Generator(model, None, config).generate(prompts, params)


def serves_a_fresh_request(gen: Generator, model, config: SparseServeConfig = CONFIG) -> None:
    """After the failures the engine still gives a new request its fault-free tokens, and drains."""
    fresh = prompt(25, seed=99)
    assert gen.generate([fresh], GREEDY)[0].token_ids == fault_free(model, [fresh], GREEDY, config)[0].token_ids
    assert_drained(gen)


# ---- one failure each ----------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [[1], None], ids=["one-row", "all-rows"])
def test_nan_logits_in_a_sampling_decode_step_end_the_bad_rows_only(llama, monkeypatch, rows):
    """NaN logits used to escape step() from the sampler, and the rows then decoded on from a stored
    K/V with no token recorded for it (their cache one entry longer than their tokens)."""
    prompts = [prompt(n, seed=n) for n in (20, 30, 40)]
    params = [sampling(1), GREEDY, sampling(3)]
    reference = fault_free(llama, prompts, params)
    gen = Generator(llama, None, CONFIG)
    ids = [gen.submit(p, q) for p, q in zip(prompts, params)]
    events = gen.step() + gen.step() + gen.step()  # all three are decoding
    fault = Fault(at=1, kind="nan", rows=rows)
    with monkeypatch.context() as mp:
        arm(mp, gen, "head", fault)
        events += gen.step()
    events += drain(gen)
    outputs = ended_once(events, ids)
    failed = [rid for rid in ids if outputs[rid].finish_reason == "error"]
    assert fault.fired and len(failed) == (1 if rows else 3)
    assert all("non-finite" in outputs[rid].error and len(outputs[rid].token_ids) == 3 for rid in failed)
    assert check_against_fault_free(outputs, dict(zip(ids, reference))) == len(failed)
    serves_a_fresh_request(gen, llama)


@pytest.mark.parametrize("kind", ["nan", "oom"])
def test_a_failure_at_a_first_token_ends_that_request_and_the_others_go_on(llama, monkeypatch, kind):
    """NaN (or an OOM) in the logits of a prompt's first token used to leave the request RUNNING
    with no token: every later step() raised and no request ever ended."""
    prompts = [prompt(n, seed=n) for n in (20, 30, 40)]
    reference = fault_free(llama, prompts, GREEDY)
    gen = Generator(llama, None, CONFIG)
    ids = [gen.submit(p, GREEDY) for p in prompts[:2]]
    events = gen.step() + gen.step()  # both decoding
    fault = Fault(at=2, kind=kind)  # call 1: the decode step; call 2: the new prompt's first token
    with monkeypatch.context() as mp:
        arm(mp, gen, "head", fault)
        ids.append(gen.submit(prompts[2], GREEDY))
        events += gen.step()
    events += drain(gen)
    outputs = ended_once(events, ids)
    assert fault.fired and [outputs[rid].finish_reason for rid in ids] == ["length", "length", "error"]
    assert outputs[ids[2]].token_ids == () and ("non-finite" if kind == "nan" else "OutOfMemoryError") in (
        outputs[ids[2]].error
    )
    check_against_fault_free(outputs, dict(zip(ids, reference)))
    serves_a_fresh_request(gen, llama)


@pytest.mark.parametrize("site", ["layer", "head"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_cuda_out_of_memory_ends_the_request_or_batch_and_the_engine_keeps_serving(llama, monkeypatch, site, phase):
    """torch.OutOfMemoryError from a decoder layer or the LM head: in a prefill it ends that prompt,
    in a decode step the batch; the rest is served and nothing leaks."""
    prompts = [prompt(n, seed=n) for n in (20, 30, 40)]
    reference = fault_free(llama, prompts, GREEDY)
    gen = Generator(llama, None, CONFIG)
    ids = [gen.submit(p, GREEDY) for p in prompts]
    events = [] if phase == "prefill" else gen.step() + gen.step()
    fault = Fault(at=2 if phase == "prefill" else 1, kind="oom")  # prefill: the second prompt's
    with monkeypatch.context() as mp:
        arm(mp, gen, site, fault, layer=1)
        events += gen.step()
    events += drain(gen)
    outputs = ended_once(events, ids)
    reasons = [outputs[rid].finish_reason for rid in ids]
    assert fault.fired and reasons == (["length", "error", "length"] if phase == "prefill" else ["error"] * 3)
    assert all("OutOfMemoryError: CUDA out of memory" in outputs[rid].error for rid in ids if outputs[rid].error)
    check_against_fault_free(outputs, dict(zip(ids, reference)))
    serves_a_fresh_request(gen, llama)


def test_a_cancelled_requests_event_comes_before_has_unfinished_turns_false(llama):
    """`while gen.has_unfinished: gen.step()` used to stop with the final events of cancelled
    requests still held; they then came out of a later, unrelated step()."""
    gen = Generator(llama, None, CONFIG)
    kept, cancelled = gen.submit(prompt(20, 1), GREEDY), gen.submit(prompt(30, 2), GREEDY)
    events = gen.step()
    assert gen.cancel(cancelled)
    events += drain(gen)
    assert ended_once(events, [kept, cancelled])[cancelled].finish_reason == "cancelled"
    last = gen.submit(prompt(40, 3), GREEDY)
    gen.step()
    assert gen.cancel(last) and gen.has_unfinished  # nothing in flight, one event due
    assert [e.output.finish_reason for e in gen.step()] == ["cancelled"] and not gen.has_unfinished
    later = gen.submit(prompt(25, 4), GREEDY)
    assert {e.request_id for e in drain(gen)} == {later}
    assert_drained(gen)


def test_a_stream_closed_early_ends_its_requests_and_loses_no_other_event(llama):
    """A consumer that stops reading `stream` (a break, or an exception in its loop) used to leave
    the stream's requests running for nobody, and drop the other requests' events of that step."""
    gen = Generator(llama, None, CONFIG)
    other = gen.submit(prompt(20, 1), GREEDY)
    for _ in gen.stream([prompt(30, 2), prompt(40, 3)], GREEDY):
        break  # after the first event: one step ran, all three are prefilled
    events = drain(gen)
    assert {e.request_id for e in events} == {other}  # the stream's two ended with it, silently
    assert ended_once(events, [other])[other].token_ids == fault_free(llama, [prompt(20, 1)], GREEDY)[0].token_ids
    assert_drained(gen)


@pytest.mark.parametrize("at", [2, 4], ids=["prefill", "decode"])
def test_an_interrupt_mid_step_propagates_and_leaves_the_engine_clean(llama, monkeypatch, at):
    """KeyboardInterrupt in a forward (Ctrl-C, a notebook's stop button) used to leave the
    interrupted rows half-advanced and every request of the `generate` call in flight."""
    prompts = [prompt(n, seed=n) for n in (20, 30, 40)]
    gen = Generator(llama, None, CONFIG)
    with monkeypatch.context() as mp:
        arm(mp, gen, "layer", Fault(at=at, kind="interrupt"), layer=1)  # call 2: a prefill, 4: the first decode
        with pytest.raises(KeyboardInterrupt):
            gen.generate(prompts, GREEDY)
    assert_drained(gen)
    assert [o.token_ids for o in gen.generate(prompts, GREEDY)] == [
        o.token_ids for o in fault_free(llama, prompts, GREEDY)
    ]


@pytest.mark.parametrize("built_inside", [False, True], ids=["built-outside", "built-inside"])
def test_one_engine_serves_inside_and_outside_inference_mode(llama, monkeypatch, built_inside):
    """Alternating torch.inference_mode and normal mode (and failing in between) used to break the
    engine's own error handler: tables made in one mode were updated in place in the other."""
    prompts = [prompt(n, seed=n) for n in (20, 45)]
    expected = [o.token_ids for o in fault_free(llama, prompts, GREEDY)]
    with torch.inference_mode(built_inside):
        gen = Generator(llama, None, CONFIG)
    for round_, inference in enumerate((not built_inside, built_inside, not built_inside, built_inside)):
        with torch.inference_mode(inference), monkeypatch.context() as mp:
            if round_ == 2:  # a decode step fails in this mode: the batch ends, the engine goes on
                arm(mp, gen, "layer", Fault(at=4, kind="raise_after"), layer=1)
            outs = gen.generate(prompts, GREEDY)
        if round_ == 2:
            assert [o.finish_reason for o in outs] == ["error", "error"]
        else:
            assert [o.token_ids for o in outs] == expected, f"round {round_}, inference_mode={inference}"
        assert_drained(gen)


def test_a_tokenizer_that_fails_on_an_output_ends_that_request_only(llama):
    """A tokenizer raising on one request's tokens (e.g. an id past its vocabulary) ends that request."""

    class Picky:
        eos_token_id = None

        def __call__(self, text):
            return {"input_ids": [int(piece) for piece in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            if bad in ids:
                raise IndexError(f"piece id {bad} is out of range")
            return " ".join(map(str, ids))

    prompts = [prompt(n, seed=n) for n in (20, 30)]
    reference = fault_free(llama, prompts, GREEDY)
    bad = next(t for t in reference[0].token_ids[1:] if t not in reference[1].token_ids)
    gen = Generator(llama, Picky(), CONFIG)
    ids = [gen.submit(p, GREEDY) for p in prompts]
    outputs = ended_once(drain(gen), ids)
    assert outputs[ids[0]].finish_reason == "error" and "IndexError" in outputs[ids[0]].error
    assert outputs[ids[1]].token_ids == reference[1].token_ids and outputs[ids[1]].text
    assert_drained(gen)


# ---- seeded random faults ------------------------------------------------------------------------

PROMPT_LENGTHS = (15, 30, 47, 9, 62, 33)  # tails fill during decode for some (block_size 16)
TRIAL_PARAMS = [SamplingParams(max_new_tokens=6)] * 5 + [SamplingParams(max_new_tokens=6, temperature=0.8, seed=3)]
SETUPS = {
    "segmented-admission": dict(max_batch=3, hbm_cache_bytes=48 * 2048, max_inject_tokens=40),
    "graph-step": dict(
        max_batch=3,
        token_budget=64,
        hbm_cache_bytes=48 * 2048,
        dram_bytes=400 * 2048,
        max_inject_tokens=60,
        cuda_graphs=True,
    ),
    "chunked": dict(prefill_mode="chunked", max_inject_tokens=32),
}
TRIALS = 20  # per (setup, site): 3 x 5 x 20 = 300 trials
KINDS_AT = {
    "layer": ("raise", "oom", "raise_after"),
    "head": ("raise", "oom", "nan"),
    "save": ("raise", "oom"),  # a save fails before it returns: ids it returned belong to the caller
    "fetch": ("raise", "oom", "raise_after"),
    "sampler": ("raise", "raise_after"),
}


@pytest.fixture(scope="module")
def trial_setups(llama):
    """Per setup: its config, the fault-free outputs of every trial prompt, and each site's calls in a
    typical trial (so that random faults land within a trial's calls)."""
    prompts = [prompt(n, seed=n) for n in PROMPT_LENGTHS]
    setups = {}
    for name, overrides in SETUPS.items():
        config = SparseServeConfig(**(dict(block_size=16, token_budget=48) | overrides))
        reference = fault_free(llama, prompts, TRIAL_PARAMS, config)
        counters = {site: Fault(at=0) for site in SITES}
        gen = Generator(llama, None, config)
        with pytest.MonkeyPatch.context() as mp:
            for site, counter in counters.items():
                arm(mp, gen, site, counter, layer=1)
            run_trial(gen, prompts, [0, 1, 5], first_wave=2, steps_between=1)
        calls = {site: max(counter.calls, 1) for site, counter in counters.items()}
        setups[name] = (config, prompts, reference, calls)
    return setups


def run_trial(gen: Generator, prompts, picks: list[int], first_wave: int, steps_between: int):
    """Submit prompts `picks[:first_wave]`, step `steps_between` times, submit the rest, run to the
    end. Returns (events, {request id: prompt index})."""
    index_of = {gen.submit(prompts[i], TRIAL_PARAMS[i]): i for i in picks[:first_wave]}
    events = []
    for _ in range(steps_between):
        events += gen.step()
    index_of |= {gen.submit(prompts[i], TRIAL_PARAMS[i]): i for i in picks[first_wave:]}
    return events + drain(gen), index_of


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("setup", list(SETUPS))
def test_random_faults_keep_the_contract(llama, trial_setups, setup, site):
    config, prompts, reference, calls = trial_setups[setup]
    rng = random.Random(f"{setup}/{site}")
    fired = failed = 0
    for trial in range(TRIALS):
        kind = rng.choice(KINDS_AT[site])
        fault = Fault(rng.randint(1, calls[site]), kind, rows=rng.choice([None, [rng.randrange(3)]]))
        picks = rng.sample(range(len(prompts)), 3)
        gen = Generator(llama, None, config)
        with pytest.MonkeyPatch.context() as mp:
            arm(mp, gen, site, fault, layer=rng.randrange(2))
            events, index_of = run_trial(gen, prompts, picks, rng.randint(1, 3), rng.randint(0, 3))
        outputs = ended_once(events, index_of)
        where = f"trial {trial}: {kind} at call {fault.at} of {site}"
        assert all(o.finish_reason != "error" for o in outputs.values()) or fault.fired, where
        failed += check_against_fault_free(outputs, {rid: reference[i] for rid, i in index_of.items()})
        fired += fault.fired
        assert_drained(gen)
        fresh = rng.randrange(len(prompts))  # the same engine, nothing failing now
        assert gen.generate([prompts[fresh]], TRIAL_PARAMS[fresh])[0].token_ids == reference[fresh].token_ids, where
        assert_drained(gen)
    assert fired >= TRIALS // 2 and failed >= fired // 2  # the faults really landed, and really failed requests
