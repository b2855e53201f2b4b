"""Working-set estimator: union of the last w steps' selections, stamped per DRAM block on the device."""

from __future__ import annotations

import pytest
import torch
from gen_support import prompt

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.generation.working_set import initial_working_set
from sync_guard import forbid_host_syncs


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


def test_observe_runs_no_host_sync_and_counts_the_stamped_blocks(llama):
    """The stamps and sizes stay on the device (the Generator reads them back with the sampled tokens)."""
    gen = Generator(llama, None, SparseServeConfig(block_size=16, token_budget=64, working_set_window=3))
    gen.submit(prompt(400, seed=3), SamplingParams(max_new_tokens=8))
    gen.submit(prompt(300, seed=4), SamplingParams(max_new_tokens=8))
    while not all(r.decode_steps for r in gen._requests.values()):
        gen.step()
    steps = torch.tensor([gen._requests[rid].decode_steps + 1 for rid in gen.batch_ids])
    with forbid_host_syncs() as seen:
        sizes = gen.tracker.observe(gen.batch, steps)
    assert seen == [] and sizes.shape == (2,)
    picked_total = torch.zeros(2, dtype=torch.long)
    for layer in gen.batch.layers:  # every block picked this step now carries its row's step
        picked, valid = layer.last_pick[0], layer.last_pick[1]  # (B, Hkv, U)
        ids = torch.gather(layer.block_ids, 2, picked)
        row_steps = steps.view(-1, 1, 1).expand_as(ids)
        assert torch.equal(gen.tracker.stamp[ids[valid]], row_steps[valid])
        picked_total += valid.flatten(1).sum(1)
    assert bool((sizes >= picked_total).all())  # the window holds at least this step's picks
