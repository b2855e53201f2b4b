"""`target_tbt_ms`: prefill work beside decoding rows sized so that their time between tokens meets a target.

The pacer's arithmetic is checked on its own; through a `Generator` on a tiny model, a clock that
advances by a fixed cost per decode step and per token-layer of prefill (the model still runs)
makes the engine's timings, and so its budgets, exact.
"""

from __future__ import annotations

import itertools
import math

import pytest
from gen_support import prompt

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.generation import prefill as prefill_module
from sparseserve_hf.generation.pacing import NEWEST_WEIGHT, PrefillPacer
from tiny_models import tiny_model

DECODE_S, TOKEN_LAYER_S = 0.005, 0.0001  # the simulated costs: a decode step, one token-layer of prefill
LAYERS, PROMPT = 8, 50  # a unit of layer-segmented prefill: one layer over the 50-token prompt


@pytest.mark.core
@pytest.mark.parametrize("target", [0, -1.0, math.nan, math.inf, True, "0.05", None])
def test_a_pacer_needs_a_positive_finite_target(target):
    with pytest.raises(ValueError, match="target_s"):
        PrefillPacer(target)


@pytest.mark.core
def test_the_budget_is_what_fits_beside_the_decode_part_from_running_means():
    pacer = PrefillPacer(0.020)
    assert pacer.budget(decode_rows=0) is None  # nobody waits for this iteration's tokens
    assert pacer.budget(decode_rows=4) == 1  # nothing timed yet: one unit, to learn its cost
    pacer.decode_seconds(0.005)
    assert pacer.budget(decode_rows=4) == 1  # the decode part alone says nothing of prefill
    assert pacer.totals() == {"pacing_target_ms": 20.0, "pacing_decode_ms": 5.0, "pacing_token_layer_us": None}
    pacer.prefill_seconds(0.010, token_layers=100)  # 1e-4 s per token-layer
    assert pacer.budget(decode_rows=4) == 150  # (0.020 - 0.005) / 1e-4
    pacer.prefill_seconds(0.0, token_layers=0)  # no work: nothing learnt
    assert pacer.budget(decode_rows=1) == 150
    pacer.decode_seconds(0.009)  # the decode part grew: its running mean moves a quarter of the way
    assert pacer.decode_s == pytest.approx((1 - NEWEST_WEIGHT) * 0.005 + NEWEST_WEIGHT * 0.009)
    assert pacer.budget(decode_rows=4) == int((0.020 - pacer.decode_s) / 1e-4)
    pacer.decode_seconds(1.0)  # decode alone past the target: still one unit, so prompts progress
    assert pacer.budget(decode_rows=4) == 1


class SimulatedClock:
    """Seconds that advance only by the simulated costs of the engine's real work."""

    def __init__(self, gen: Generator) -> None:
        self.seconds = 0.0
        self.decode_s = DECODE_S  # what a decode step costs from now on
        gen.recorder.now = lambda: self.seconds
        runner_step, run_unit = gen._decoder_step, gen.prefill._run
        self.prefill_per_iteration: list[tuple[int, int]] = []  # (decoding rows, token-layers) of each iteration

        def decode(tokens, positions):
            self.seconds += self.decode_s
            return runner_step(tokens, positions)

        def prefill(job, unit):
            self.seconds += unit.cost * TOKEN_LAYER_S
            return run_unit(job, unit)

        run_prefills = gen._run_prefills

        def iteration_prefill(plan, events):
            ran = run_prefills(plan, events)
            self.prefill_per_iteration.append((len(plan.decode), ran))
            return ran

        gen._decoder_step, gen.prefill._run, gen._run_prefills = decode, prefill, iteration_prefill


def serve(
    target_tbt_ms: float | None, later_prompt: int = PROMPT
) -> tuple[Generator, SimulatedClock, list, list[float]]:
    """One request decoding while three more (of `later_prompt` tokens) arrive and prefill; returns the
    engine, the clock, the outputs in submission order and the first request's times between tokens
    (simulated seconds)."""
    model = tiny_model("llama", num_layers=LAYERS)
    # The clock charges a decode step when it is launched: one launched ahead (`decode_ahead`) would
    # be charged an iteration before its token is recorded, so steps here launch in turn.
    config = SparseServeConfig(block_size=16, token_budget=48, target_tbt_ms=target_tbt_ms, decode_ahead=False)
    gen = Generator(model, None, config)
    clock = SimulatedClock(gen)
    first = gen.submit(prompt(PROMPT, seed=1), SamplingParams(max_new_tokens=40))
    outputs = {}
    while not gen._requests[first].output:
        gen.step()
    later = [gen.submit(prompt(later_prompt, seed=seed), SamplingParams(max_new_tokens=6)) for seed in (2, 3, 4)]
    while gen.has_unfinished:
        outputs |= {e.request_id: e.output for e in gen.step() if e.output is not None}
    times = gen.recorder.requests[first].token_times
    return gen, clock, [outputs[i] for i in (first, *later)], [b - a for a, b in itertools.pairwise(times)]


def test_prefill_beside_a_decoding_row_is_paced_to_the_target_and_the_tokens_do_not_change():
    """Unpaced, three prompts' whole prefills (8 layers x 50 tokens: 40 ms each) land between two of
    the decoding row's tokens. Paced at 20 ms, each iteration with a decoding row runs the prefill that
    fits beside its 5 ms decode step, 150 token-layers (three layers; the first request's own
    prefill taught the cost): the row's time between tokens stays within the target, with the same
    tokens."""
    _, unpaced_clock, unpaced, unpaced_gaps = serve(None)
    gen, clock, paced, gaps = serve(20.0)
    assert [o.token_ids for o in paced] == [o.token_ids for o in unpaced]
    assert max(unpaced_gaps) == pytest.approx(DECODE_S + 3 * LAYERS * PROMPT * TOKEN_LAYER_S)  # all three: 125 ms
    mixed = [ran for rows, ran in clock.prefill_per_iteration if rows and ran]
    assert set(mixed) <= {3 * PROMPT, 2 * PROMPT, PROMPT} and mixed.count(3 * PROMPT) >= 5  # what fits, in units
    assert max(gaps) <= 0.020 + 1e-9 and len(gaps) == 39
    totals = gen.metrics()["totals"]  # what the pacer learnt: the simulated costs
    assert totals["pacing_target_ms"] == 20.0 and totals["pacing_decode_ms"] == pytest.approx(DECODE_S * 1e3)
    assert totals["pacing_token_layer_us"] == pytest.approx(TOKEN_LAYER_S * 1e6)
    unpaced_mixed = [ran for rows, ran in unpaced_clock.prefill_per_iteration if rows and ran]
    assert max(unpaced_mixed) == 3 * LAYERS * PROMPT  # every prompt whole, in one iteration


def test_a_layer_longer_than_the_target_allows_is_split_to_fit_it(monkeypatch):
    """Prompts of 200 tokens: one layer over one of them is 20 ms of prefill, more than the 12 ms target
    leaves beside the 5 ms decode step (70 token-layers). Paced, such a layer runs as 3 chunks of 66-67
    tokens, one per iteration, and a second prompt waits rather than push an iteration past the target:
    the decoding row's times between tokens stay within it, with the unpaced run's tokens."""
    monkeypatch.setattr(prefill_module, "PACED_MIN_CHUNK_TOKENS", 32)
    long_prompt = 200
    _, _, unpaced, unpaced_gaps = serve(None, long_prompt)
    _, clock, paced, gaps = serve(12.0, long_prompt)
    assert [o.token_ids for o in paced] == [o.token_ids for o in unpaced]
    assert max(unpaced_gaps) == pytest.approx(DECODE_S + 3 * LAYERS * long_prompt * TOKEN_LAYER_S)
    mixed = [ran for rows, ran in clock.prefill_per_iteration if rows and ran]
    assert set(mixed) <= {66, 67} and len(mixed) >= 30  # a third of a layer beside most of the row's 39 tokens
    assert max(gaps) <= 0.012 + 1e-9


def test_a_prompt_whose_layers_were_split_differently_decodes_in_the_batch(monkeypatch):
    """The decode step holds every layer's block table at one width. A paced prompt whose first layer
    ran whole and whose later layers ran in chunks (the decode step grew slower between them, so the
    room for prefill shrank) fills its layers' tables differently; joining the batch, every layer
    takes the batch's width, and its tokens are the unpaced run's, with the step captured and
    replayed (the CPU stand-in refuses a replay whose tensors moved, as a CUDA graph would misread)."""
    from fake_graphs import FakeGraphs

    monkeypatch.setattr(prefill_module, "PACED_MIN_CHUNK_TOKENS", 32)

    def serve_split(target_tbt_ms: float | None) -> tuple[list, list[set[int]], list[int]]:
        config = SparseServeConfig(
            block_size=16, token_budget=48, target_tbt_ms=target_tbt_ms, decode_ahead=False, cuda_graphs=True
        )
        gen = Generator(tiny_model("llama", num_layers=LAYERS), None, config)
        gen._decoder.capture, gen._decoder.graphs = True, FakeGraphs(gen._decoder)
        clock = SimulatedClock(gen)
        first = gen.submit(prompt(700, seed=1), SamplingParams(max_new_tokens=30))
        while not gen._requests[first].output:
            gen.step()
        later = gen.submit(prompt(600, seed=2), SamplingParams(max_new_tokens=6))
        outputs, widths = {}, []
        while gen.has_unfinished:
            outputs |= {e.request_id: e.output for e in gen.step() if e.output is not None}
            clock.decode_s = 0.055  # from the second iteration on: less room beside each step
            widths.append({layer.block_ids.shape[2] for layer in gen.batch.layers if layer.is_initialized})
        ran = [tokens for rows, tokens in clock.prefill_per_iteration if rows and tokens]
        assert all(outputs[i].finish_reason == "length" for i in (first, later))
        return [outputs[first].token_ids, outputs[later].token_ids], widths, ran

    unpaced, _, _ = serve_split(None)
    paced, widths, ran = serve_split(70.0)
    assert ran[0] >= 600 and min(ran) < 600  # the first layer whole (650 token-layers of room), later ones split
    assert all(len(width) <= 1 for width in widths)
    assert paced == unpaced


def test_a_paced_prompt_over_a_cached_prefix_that_waits_keeps_its_prefix():
    """Prefix caching beside pacing: a prompt over a cached prefix adopts it, then gets no work in that
    iteration (another prompt took the room beside the decoding row, and only an iteration's first
    prefill work may overshoot it). Next iteration it goes on after its prefix, where it used to try
    to adopt the prefix again, into a cache that already held it, and end with "error". Its tokens are
    those of a run without prefix caching or pacing, and it looked its prefix up once."""

    def serve_prefixed(target_tbt_ms: float | None, prefix_caching: bool) -> tuple[dict, dict, list[int]]:
        config = SparseServeConfig(
            block_size=16,
            token_budget=48,
            target_tbt_ms=target_tbt_ms,
            decode_ahead=False,
            prefix_caching=prefix_caching,
        )
        gen = Generator(tiny_model("llama", num_layers=LAYERS), None, config)
        clock = SimulatedClock(gen)
        shared, outputs = prompt(160, seed=7), {}
        gen.submit(prompt(PROMPT, seed=1), SamplingParams(max_new_tokens=40))  # the decoding row
        first = gen.submit(shared + prompt(20, seed=2), SamplingParams(max_new_tokens=3))  # computes the prefix
        while first not in outputs:
            outputs |= {e.request_id: e.output for e in gen.step() if e.output is not None}
        gen.submit(prompt(100, seed=3), SamplingParams(max_new_tokens=3))  # a layer: 100 of the 150 of room
        gen.submit(shared + prompt(80, seed=4), SamplingParams(max_new_tokens=3))  # its 82 left do not fit 50
        while gen.has_unfinished:
            outputs |= {e.request_id: e.output for e in gen.step() if e.output is not None}
        ran = [tokens for rows, tokens in clock.prefill_per_iteration if rows]
        return outputs, gen.metrics()["totals"], ran

    outputs, totals, ran = serve_prefixed(20.0, prefix_caching=True)
    plain, _, _ = serve_prefixed(None, prefix_caching=False)
    assert all(out.finish_reason == "length" for out in outputs.values())
    assert {i: out.token_ids for i, out in outputs.items()} == {i: out.token_ids for i, out in plain.items()}
    assert totals["prefix_hits"] == 1 and totals["prefix_reused_tokens"] == 160
    assert totals["prefix_lookups"] == 4  # one per request, though the last looked while it waited
    assert ran.count(100) >= LAYERS  # the other prompt ran layer by layer beside the decoding row


def test_iterations_without_a_decoding_row_are_not_paced():
    model = tiny_model("llama", num_layers=LAYERS)
    gen = Generator(model, None, SparseServeConfig(block_size=16, token_budget=48, target_tbt_ms=1.0))
    clock = SimulatedClock(gen)
    gen.generate([prompt(PROMPT, seed=5)], SamplingParams(max_new_tokens=3))
    assert clock.prefill_per_iteration[0] == (0, LAYERS * PROMPT)  # the whole prompt: nobody was waiting
