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
    union = SparseServeConfig(block_size=16, token_budget=96, selection="group_union")  # 5 full blocks each
    # 2 layers x 2 KV heads x (sink 1 + window 1 + group 2 x 3 top-k), capped by the row's full blocks
    assert initial_working_set(union, llama.config, 1000) == 2 * 2 * 8
    assert initial_working_set(union, llama.config, 50) == 2 * 2 * 3  # 50 tokens: 3 full blocks + tail
    per_kv_head = SparseServeConfig(block_size=16, token_budget=96)  # the default: one pick per KV head
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
    steps = torch.tensor([gen._requests[rid].decode_steps + 1 for rid in gen.slots])
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


def per_layer_observe(stamp: torch.Tensor, layers, steps: torch.Tensor, window: int) -> torch.Tensor:
    """The estimator's spec, one layer at a time: stamp every valid pick, count each row's fresh blocks."""
    steps = steps.view(-1, 1, 1)
    for layer in layers:
        if layer.last_pick is not None:
            picked, valid = layer.last_pick[0], layer.last_pick[1]
            ids = torch.gather(layer.block_ids, 2, picked)
            for row, head, slot in valid.nonzero().tolist():
                block = int(ids[row, head, slot])
                stamp[block] = max(int(stamp[block]), int(steps[row, 0, 0]))
    fresh = torch.zeros(steps.shape[0], dtype=torch.long)
    for layer in layers:
        ids = layer.block_ids
        recent = (stamp[ids.clamp(min=0)] > steps - window) & (ids >= 0)
        fresh += recent.flatten(1).sum(1)
    return fresh


@pytest.mark.core
@pytest.mark.parametrize(
    ("widths", "idle_layer"), [((12, 12, 12, 12), False), ((12, 12, 12, 12), True), ((12, 20, 12, 12), False)]
)
def test_observe_equals_the_per_layer_spec(widths, idle_layer):
    """All layers at once (equal widths, all picked) or one at a time: the same stamps and sizes."""
    from types import SimpleNamespace

    from sparseserve_hf.generation.working_set import WorkingSetTracker

    gen = torch.Generator().manual_seed(0)
    batch, heads, union, capacity, window = 3, 2, 5, 200, 3
    layers = []
    for width in widths:
        table = torch.randperm(capacity, generator=gen)[: batch * heads * width].view(batch, heads, width)
        table[0, :, width - 3 :] = -1  # row 0 holds fewer blocks
        picked = torch.randint(0, width - 3, (batch, heads, union), generator=gen)
        valid = torch.rand(batch, heads, union, generator=gen) < 0.7
        layers.append(SimpleNamespace(block_ids=table, last_pick=(picked, valid, None, 1)))
    if idle_layer:
        layers.append(SimpleNamespace(block_ids=layers[0].block_ids.clone(), last_pick=None))  # picked nothing
    tracker = WorkingSetTracker(window, torch.device("cpu"))
    tracker.stamp = torch.randint(-3, 4, (capacity,), generator=gen)
    expected_stamp = tracker.stamp.clone()
    steps = torch.tensor([4, 2, 5])
    expected = per_layer_observe(expected_stamp, layers, steps, window)
    sizes = tracker.observe(SimpleNamespace(layers=layers, store=None), steps)
    assert torch.equal(tracker.stamp, expected_stamp) and torch.equal(sizes, expected)


@pytest.mark.core
def test_observe_issues_the_same_ops_for_any_number_of_layers():
    """After a CUDA-graph replay the estimator runs eagerly: its kernel count must not grow with depth."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    from sparseserve_hf.generation.working_set import WorkingSetTracker

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    def ops_for(num_layers: int) -> int:
        layer = SimpleNamespace(
            block_ids=torch.arange(2 * 2 * 8).view(2, 2, 8),
            last_pick=(torch.zeros(2, 2, 3, dtype=torch.long), torch.ones(2, 2, 3, dtype=torch.bool), None, 1),
        )
        tracker = WorkingSetTracker(4, torch.device("cpu"))
        tracker.stamp = torch.zeros(64, dtype=torch.long)
        with CountOps() as counter:
            tracker.observe(SimpleNamespace(layers=[layer] * num_layers, store=None), torch.tensor([1, 1]))
        return counter.count

    assert ops_for(32) == ops_for(2)
