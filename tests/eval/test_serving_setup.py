"""eval.serving's shared setup: every ladder rung keeps its device bytes (blocks + metadata) in the KV budget."""

from __future__ import annotations

import pytest
import torch
from eval.bench.decode_step_setup import build_model
from eval.serving.common import Budget, warmup_batch, warmup_request
from eval.serving.ours import run_generator
from eval.serving.setup import LADDER, ours_config
from eval.serving.trace import build_trace

from sparseserve_hf import Generator, SparseServeConfig

BLOCK_BYTES = 2 * 32 * 16 * 4  # tiny shape: 32 tokens x head_dim 16, fp32 keys and values


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", "sparseserve", "cpu", torch.float32, 128)


@pytest.fixture(scope="module")
def tiny_long():
    """The tiny shape with room for prompts whose prefill outgrows the smallest HBM cache it can run with."""
    return build_model("tiny", "sparseserve", "cpu", torch.float32, 512)


@pytest.mark.parametrize("system", list(LADDER))
def test_blocks_and_their_metadata_fit_the_kv_budget(tiny, system):
    budget = Budget(kv_bytes=10_000 * BLOCK_BYTES, kv_bytes_per_token=0, max_batch=4)
    dram = 40_000 * BLOCK_BYTES
    config = ours_config(system, tiny, budget, dram)
    metadata_per_block = config.metadata_vectors * 16 * 4
    if LADDER[system]["offload"]:
        assert config.dram_bytes == dram
        used = config.hbm_cache_bytes + dram // BLOCK_BYTES * metadata_per_block
    else:
        assert config.hbm_cache_bytes is None
        used = config.dram_bytes + config.dram_bytes // BLOCK_BYTES * metadata_per_block
    assert budget.kv_bytes - BLOCK_BYTES - metadata_per_block < used <= budget.kv_bytes


def test_a_pool_whose_metadata_fills_the_budget_is_refused(tiny):
    budget = Budget(kv_bytes=100 * BLOCK_BYTES, kv_bytes_per_token=0, max_batch=4)
    with pytest.raises(ValueError, match="lower --dram-gib"):
        ours_config("ours", tiny, budget, 10_000 * BLOCK_BYTES)


def test_the_warmup_request_is_a_short_cut_of_the_first_prompt():
    trace = build_trace(list(range(10, 9000)), num_requests=2, prompt_range=(5000, 6000), output_range=(3, 5))
    warmup = warmup_request(trace)
    assert warmup.prompt == trace.requests[0].prompt[:4096] and warmup.output_tokens == 8 and warmup.index == -1


def test_the_generator_warms_up_on_the_trace_s_longest_prompts_up_to_its_longest_context():
    trace = build_trace(list(range(10, 9000)), num_requests=4, prompt_range=(3000, 6000), output_range=(30, 500))
    second, first = sorted((r.prompt for r in trace.requests), key=len)[-2:]
    widest = max(len(r.prompt) + r.output_tokens for r in trace.requests)
    warmup = warmup_batch(trace)
    assert [len(r.prompt) + r.output_tokens for r in warmup] == [widest, len(second) + 8]
    assert (
        warmup[0].prompt[: len(first)] == first and warmup[0].prompt[len(first) :] == first[: widest - 8 - len(first)]
    )
    assert warmup[1].prompt == second and all(r.output_tokens == 8 and r.index == -1 for r in warmup)


def test_only_the_last_rung_replays_cuda_graphs(tiny):
    budget = Budget(kv_bytes=10_000 * BLOCK_BYTES, kv_bytes_per_token=0, max_batch=4)
    graphs = {system: ours_config(system, tiny, budget, 4000 * BLOCK_BYTES).cuda_graphs for system in LADDER}
    assert graphs == {system: system == "ours" for system in LADDER}


def run_refusing_from(tiny, prompt_range: tuple[int, int], pick) -> tuple[list, int]:
    """A 3-request trace through a Generator whose HBM cache is one byte short of the prefill of the
    prompt `pick` (min or max) chooses by length: (the run's records, that prompt's length)."""
    trace = build_trace(
        list(range(10, 250)) * 2, num_requests=3, prompt_range=prompt_range, output_range=(3, 5), seed=0
    )
    limit = pick(len(request.prompt) for request in trace.requests)
    config = SparseServeConfig(token_budget=96, prefill_mode="chunked", hbm_cache_bytes=64 * BLOCK_BYTES)
    needed = Generator(tiny, None, config).sizes.prefill_bytes(limit)
    gen = Generator(tiny, None, SparseServeConfig(token_budget=96, prefill_mode="chunked", hbm_cache_bytes=needed - 1))
    return run_generator(gen, trace, rate=100.0).records, limit


def test_a_request_the_generator_fails_keeps_the_generators_reason(tiny_long):
    records, longest = run_refusing_from(tiny_long, (240, 400), max)
    failed = [record for record in records if record.prompt_tokens == longest]
    assert failed and all("cannot fit alone" in record.error for record in failed)
    assert all(record.error is None for record in records if record.prompt_tokens < longest)


def test_a_run_whose_last_arrivals_are_all_refused_ends_with_their_reasons(tiny_long):
    """Nothing in flight after the last refusal: the run ends (it used to index past the trace)."""
    records, _ = run_refusing_from(tiny_long, (380, 400), min)
    assert len(records) == 3 and all("cannot fit alone" in record.error for record in records)
