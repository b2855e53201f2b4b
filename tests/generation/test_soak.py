"""Soak: 2,000 requests with random lengths, sampling, stops, bad inputs and cancellations.

Every request must end exactly once with a reason, and the DRAM pool and HBM cache must be empty
at the end (no leaked block, no leaked reference).
"""

from __future__ import annotations

import random

from gen_support import VOCAB, prompt

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.generation.outputs import FINISH_REASONS

NUM_REQUESTS = 2000
BLOCK_BYTES = 2 * 16 * 16 * 4


def random_request(rng: random.Random, i: int) -> tuple[list[int], SamplingParams]:
    roll = rng.random()
    ids = [] if roll < 0.02 else [VOCAB + 1] if roll < 0.04 else prompt(rng.randrange(1, 70), seed=i)
    greedy = rng.random() < 0.5
    params = SamplingParams(
        max_new_tokens=rng.randrange(1, 9),
        temperature=0.0 if greedy else rng.choice((0.5, 1.0, 1.3)),
        top_k=rng.choice((0, 5, 40)),
        top_p=rng.choice((1.0, 0.9, 0.5)),
        seed=rng.randrange(1000) if rng.random() < 0.5 else None,
        stop_token_ids=tuple(rng.sample(range(1, VOCAB), 3)) if rng.random() < 0.3 else (),
    )
    return ids, params


def test_soak_every_request_ends_and_pools_drain(llama):
    rng = random.Random(1234)
    config = SparseServeConfig(
        block_size=16,
        token_budget=48,
        hbm_cache_bytes=2 * 128 * BLOCK_BYTES,
        dram_bytes=240 * BLOCK_BYTES,
        max_batch=16,
    )
    gen = Generator(llama, None, config)
    ended: dict[int, str] = {}
    rejected = submitted = 0
    live: list[int] = []
    while submitted < NUM_REQUESTS or gen.has_unfinished:
        for _ in range(rng.randrange(0, 7)):
            if submitted == NUM_REQUESTS:
                break
            ids, params = random_request(rng, submitted)
            submitted += 1
            try:
                live.append(gen.submit(ids, params))
            except ValueError:
                rejected += 1
        if live and rng.random() < 0.15:
            gen.cancel(rng.choice(live))
        for event in gen.step():
            if event.finished:
                assert event.request_id not in ended, "a request ended twice"
                ended[event.request_id] = event.output.finish_reason
                live.remove(event.request_id)
                assert event.output.finish_reason in FINISH_REASONS
                assert event.output.finish_reason != "error" or event.output.error
        reserved = sum(r.dram_blocks for r in gen._requests.values() if r.state != "waiting")
        assert reserved <= gen.store.dram.capacity
    assert len(ended) + rejected == NUM_REQUESTS and rejected > 0
    reasons = set(ended.values())
    assert {"stop", "length", "cancelled"} <= reasons, reasons
    assert gen.dram_bytes_in_use() == 0 and gen.hbm_bytes_in_use() == 0
    assert gen.store.dram.num_used == 0 and int(gen.store.dram.refcount.sum()) == 0
    assert gen.store.hbm.num_resident == 0 and gen.slots == [] and not gen.batch.layers[0].is_initialized
    totals = gen.metrics()["totals"]
    assert totals["finished"] == len(ended) and totals["hbm_peak_bytes"] > 0
