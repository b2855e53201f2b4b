"""The selection-trace seam: a recorded trace replayed as another model's loaded blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eval.bench.selection_trace import ROW_STEP_OFFSET, SelectionTrace, TraceReplay, overlaps, sha256

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.cache.store import TieredBlockStore
from sparseserve_hf.ops import get_ops
from tiny_models import HEAD_DIM, greedy, random_ids, tiny_model


def synthetic_trace(prompts=1, steps=4, layers=2, heads=2, blocks=20, seed=0) -> SelectionTrace:
    """Random selections that always hold the sink block and the last two blocks (window 2)."""
    rng = np.random.default_rng(seed)
    loaded = rng.random((prompts, steps, layers, heads, blocks)) < 0.3
    loaded[..., 0] = loaded[..., -2:] = True
    return SelectionTrace(loaded, np.full((prompts, steps), blocks), 1, 2, {"synthetic": True})


def replayed(trace: SelectionTrace, num_blocks: list[int], width: int, layer: int = 0, num_kv_heads: int = 2):
    replay = TraceReplay(trace, num_layers=4, num_kv_heads=num_kv_heads, device=torch.device("cpu"))
    return replay, replay(layer, torch.tensor(num_blocks), width)


def test_sink_and_window_stay_and_the_middle_stretches():
    trace = synthetic_trace()
    _, (picked, valid) = replayed(trace, [80], width=32)
    recorded = np.flatnonzero(trace.loaded[0, 0, 0, 0])
    got = picked[0, 0][valid[0, 0]].tolist()
    stretch = 77 // 17  # middle blocks: 80 - sink - window over 20 - sink - window
    expected = sorted(r if r < 1 else 80 - (20 - r) if r >= 18 else 1 + (r - 1) * stretch for r in recorded.tolist())
    assert got == expected and len(got) == len(recorded)  # the recorded load is kept
    assert not valid[0, 0, len(got) :].any() and (picked[~valid] == 0).all()


def test_middle_positions_stay_put_when_the_target_context_grows_a_block():
    """A real model's selected blocks keep their positions as the context grows; only the window moves."""
    trace = synthetic_trace(steps=1)
    _, (before, valid_before) = replayed(trace, [80], width=32)
    _, (after, valid_after) = replayed(trace, [81], width=32)
    middle = valid_before[0, 0] & (before[0, 0] < 78)
    assert torch.equal(before[0, 0][middle], after[0, 0][valid_after[0, 0] & (after[0, 0] < 78)])
    # One replay whose rows grow a block after its first call (its plan) hands out what a fresh
    # mapping at the new length gives: the window follows the end, the rest stays.
    replay, _ = replayed(trace, [80], width=32)
    grown, valid_grown = replay(0, torch.tensor([81]), 32)
    assert torch.equal(grown, after) and torch.equal(valid_grown, valid_after)


def test_layers_heads_and_rows_map_modulo_and_steps_advance_per_layer():
    trace = synthetic_trace(prompts=2, steps=5, layers=2, heads=2, blocks=20)
    replay = TraceReplay(trace, num_layers=4, num_kv_heads=3, device=torch.device("cpu"))
    rows = torch.tensor([20, 20, 20])
    for call in range(3):
        picked, valid = replay(3, rows, 32)  # layer 3 reads recorded layer 1
        for row in range(3):
            prompt, step = row % 2, (call + ROW_STEP_OFFSET * (row // 2)) % 5
            for head in range(3):
                want = np.flatnonzero(trace.loaded[prompt, step, 1, head % 2]).tolist()
                assert picked[row, head][valid[row, head]].tolist() == want
    assert replay.calls.tolist() == [0, 0, 0, 3]


def test_a_shorter_target_context_drops_collisions_and_stays_in_range():
    _, (picked, valid) = replayed(synthetic_trace(blocks=40), [7], width=16)
    for head in range(2):
        got = picked[0, head][valid[0, head]]
        assert got.tolist() == sorted(set(got.tolist())) and int(got.max()) < 7


def test_width_narrower_than_the_recorded_load_is_truncated_not_overflowed():
    _, (picked, valid) = replayed(synthetic_trace(), [80], width=3)
    assert picked.shape == (1, 2, 3) and valid.all()


def test_plans_outlive_other_batch_sizes_and_other_rows_stay_in_range():
    """A graph captured at one batch size replays its plan by address after other sizes came and
    went (the Generator's batches): the plan must still be there, and the rows then may be other,
    shorter rows than the plan's."""
    replay = TraceReplay(synthetic_trace(blocks=40), num_layers=2, num_kv_heads=2, device=torch.device("cpu"))
    replay(0, torch.tensor([80, 80]), 16)
    two = replay._plans[(2, 16)]
    replay(0, torch.tensor([80, 80, 80]), 16)
    picked, valid = replay(0, torch.tensor([9, 30]), 16)  # two rows again, one far shorter
    assert replay._plans[(2, 16)] is two and set(replay._plans) == {(2, 16), (3, 16)}
    assert int(picked[0].max()) < 9 and int(picked[1].max()) < 30 and valid.any()


def test_save_load_round_trip(tmp_path):
    trace = synthetic_trace(prompts=2, blocks=37)
    digest = trace.save(tmp_path / "t.npz")
    again = SelectionTrace.load(tmp_path / "t.npz")
    assert digest == sha256(tmp_path / "t.npz") and len(digest) == 64
    assert np.array_equal(again.loaded, trace.loaded) and np.array_equal(again.num_blocks, trace.num_blocks)
    assert (again.sink_blocks, again.window_blocks, again.meta) == (1, 2, {"synthetic": True})


def test_overlaps_on_known_selections():
    loaded = np.zeros((14, 1, 1, 10), dtype=bool)  # (T, L, H, N)
    loaded[:, 0, 0, :4] = True  # blocks 0-3 every step
    loaded[1::2, 0, 0, 4] = True  # block 4 on odd steps: 4 of 5 kept from the step before
    result = overlaps(loaded)
    one = np.mean([4 / (5 if t % 2 else 4) for t in range(1, 14)])
    assert result["overlap_1step"] == pytest.approx(one)
    assert result["overlap_union12"] == pytest.approx(1.0)  # block 4 is always in the last 12 steps


def test_an_override_that_loads_every_block_decodes_like_dense():
    """The seam decides what is loaded: every block loaded = dense tokens, at a budget that would not."""
    model, dense = tiny_model("llama"), tiny_model("llama", "sdpa")
    # the group union: its picks are G x a query head's wide, room for every block of this context
    config = SparseServeConfig(block_size=16, token_budget=64, sink_blocks=1, window_blocks=1, selection="group_union")
    store = TieredBlockStore(
        config, get_ops("torch", torch.device("cpu")), HEAD_DIM, torch.float32, torch.device("cpu")
    )
    calls = []

    def every_block(layer_idx, num_blocks, width):
        calls.append(layer_idx)
        position = torch.arange(width).expand(num_blocks.shape[0], 2, width)
        valid = position < num_blocks.view(-1, 1, 1)
        return torch.where(valid, position, 0), valid

    ids = random_ids(1, 90)  # 5-6 full blocks; 2 heads x (sink, window, 1 top-k) may not cover them
    width = 2 * config.selected_full_blocks
    assert width >= (90 + 12) // 16  # room for every block the decode reaches
    store.selection_override = every_block
    cache = SparseServeCache(model.config, config, store=store)
    assert torch.equal(greedy(model, ids, cache, max_new_tokens=12), greedy(dense, ids, max_new_tokens=12))
    assert calls and set(calls) == {0, 1}
    _, valid = cache.layers[0].last_pick[:2]
    assert int(valid.sum(-1).min()) == int(cache.layers[0].num_blocks[0])
