"""Working-set estimator: union of the last w steps' selections, stamped per DRAM block on the device."""

from __future__ import annotations

import pytest
from gen_support import prompt

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.generation.working_set import initial_working_set


@pytest.mark.core
def test_initial_estimate_is_the_budget_per_layer_and_kv_head(llama):
    config = SparseServeConfig(block_size=16, token_budget=96)  # 5 full blocks: sink 1 + window 1 + top-3
    # 2 layers x 2 KV heads x (1 + 1 + group 2 x 3 top-k), capped by the row's full blocks
    assert initial_working_set(config, llama.config, 1000) == 2 * 2 * 8
    assert initial_working_set(config, llama.config, 50) == 2 * 2 * 3  # 50 tokens: 3 full blocks + tail
    per_kv_head = SparseServeConfig(block_size=16, token_budget=96, selection="kv_head")
    assert initial_working_set(per_kv_head, llama.config, 1000) == 2 * 2 * 5


def test_measured_union_grows_with_the_window_and_is_bounded(llama):
    sizes = {}
    for window in (1, 12):
        config = SparseServeConfig(block_size=16, token_budget=64, working_set_window=window)
        gen = Generator(llama, None, config)
        rid = gen.submit(prompt(400, seed=2), SamplingParams(max_new_tokens=40))
        while gen.has_unfinished:
            gen.step()
            if gen.has_unfinished and gen._requests[rid].decode_steps:
                blocks = gen._requests[rid].working_set_blocks
                assert 0 < blocks <= window * initial_working_set(config, llama.config, 440)
        sizes[window] = gen.metrics()["requests"][rid]["working_set_blocks"]
        assert gen.tracker.stamp.numel() >= gen.store.dram.capacity
    one_step_cap = initial_working_set(SparseServeConfig(block_size=16, token_budget=64), llama.config, 440)
    assert sizes[1] <= one_step_cap < sizes[12]  # one step's union is at most the budget; 12 steps hold more
