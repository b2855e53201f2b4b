"""The exactness ladder's batching rung over seeded mixes of the Generator's features.

Each seed draws a config (prefill mode and chunking, pacing, prefix caching, decode ahead, decode
reservation, metadata, HBM cache and DRAM pool sizes), a handful of prompts (some over a shared
prefix) with their arrival iterations, and whether the decode step is captured and replayed (the
CPU stand-in for CUDA graphs). Served together on a simulated clock whose decode cost changes every
iteration (so the pacer's room moves), every request ends as it does alone, with its tokens, and
nothing stays held. Features are tested one at a time elsewhere; their combinations are where a
bug hid that one at a time did not show (a paced prompt over a cached prefix that waited an
iteration tried to adopt its prefix again).

Channel metadata keeps the channels each block's writer chose from its prompt chunk's queries:
a paced split or a prefix another request wrote changes a block's channels, so there every request
must complete, not match its tokens alone.
"""

from __future__ import annotations

import random

import pytest
from fault_support import assert_drained
from gen_support import prompt
from test_pacing import SimulatedClock

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.generation import prefill as prefill_module
from tiny_models import tiny_model

# Chosen for coverage: pacing with captured steps (1, 17, 190), pacing beside prefix caching (51, 124,
# and 84, the mix that used to fail), channel metadata alone (74) and paced (23), full prefill (11).
SEEDS = (1, 11, 17, 23, 51, 74, 84, 124, 190)
DECODE_COSTS = (0.002, 0.01, 0.03)  # simulated seconds per decode step, drawn each iteration


def draw_mix(seed: int) -> tuple[dict, list[list[int]], list[SamplingParams], list[int], bool]:
    """(config fields, prompts, sampling params, arrival iterations, captured) for `seed`."""
    rng = random.Random(seed)
    fields = dict(
        block_size=16,
        token_budget=rng.choice([48, 64, 96]),
        max_batch=rng.choice([2, 3, 4]),
        hbm_cache_bytes=rng.choice([None, 300 * 2048, 600 * 2048]),
        dram_bytes=rng.choice([None, 4000 * 2048]),
        prefill_mode=rng.choice(["layer_segmented", "chunked", "full"]),
        max_inject_tokens=rng.choice([None, 60, 200]),
        target_tbt_ms=rng.choice([None, 8.0, 20.0]),
        decode_ahead=rng.choice([False, True]),
        reserve_decode=rng.choice([False, True]),
        prefix_caching=rng.choice([False, True]),
        metadata=rng.choice(["hybrid", "channels", "quest"]),
    )
    if fields["metadata"] == "channels":
        fields |= dict(selection="kv_head", group_aggregation="sum")
    count = rng.randint(2, 6)
    shared = prompt(300, seed=seed + 1000)
    prompts = [
        (shared[: rng.randint(20, 200)] if fields["prefix_caching"] and rng.random() < 0.5 else [])
        + prompt(rng.randint(10, 400), seed=seed * 10 + i)
        for i in range(count)
    ]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 30)) for _ in range(count)]
    arrivals = sorted(rng.randint(0, 40) for _ in range(count))
    return fields, prompts, params, arrivals, rng.random() < 0.7


def serve(
    model, fields: dict, prompts, params, arrivals: list[int], captured: bool, seed: int
) -> tuple[list, Generator]:
    """Each prompt submitted at its arrival iteration; returns the outputs in prompt order and the engine."""
    from fake_graphs import FakeGraphs

    gen = Generator(model, None, SparseServeConfig(**fields, cuda_graphs=captured))
    if captured:
        gen._decoder.capture, gen._decoder.graphs = True, FakeGraphs(gen._decoder)
    clock, costs = SimulatedClock(gen), random.Random(seed)
    index_of, outputs, iteration = {}, {}, 0
    while len(index_of) < len(prompts) or gen.has_unfinished:
        for i in range(len(index_of), len(prompts)):
            if arrivals[i] <= iteration:
                index_of[gen.submit(prompts[i], params[i])] = i
        clock.decode_s = costs.choice(DECODE_COSTS)
        outputs |= {index_of[e.request_id]: e.output for e in gen.step() if e.output is not None}
        iteration += 1
    return [outputs[i] for i in range(len(prompts))], gen


@pytest.mark.parametrize("seed", SEEDS)
def test_a_mix_of_features_serves_each_request_as_it_runs_alone(seed, monkeypatch):
    monkeypatch.setattr(prefill_module, "PACED_MIN_CHUNK_TOKENS", 32)  # the tiny prompts' layers split
    model = tiny_model("llama", num_layers=4)
    fields, prompts, params, arrivals, captured = draw_mix(seed)
    together, gen = serve(model, fields, prompts, params, arrivals, captured, seed)
    alone_fields = fields | dict(target_tbt_ms=None, prefix_caching=False)
    alone = [serve(model, alone_fields, [p], [q], [0], False, seed)[0][0] for p, q in zip(prompts, params)]
    writer_dependent = fields["metadata"] == "channels" and (fields["target_tbt_ms"] or fields["prefix_caching"])
    for mine, theirs in zip(together, alone):
        assert mine.finish_reason == theirs.finish_reason == "length", (fields, mine.finish_reason)
        assert writer_dependent or mine.token_ids == theirs.token_ids, fields
    if gen.prefixes is not None:
        gen.prefixes.index.clear()  # the cached prefixes' blocks, the only ones meant to stay
    assert_drained(gen)
