"""Every selection granularity (`scoring.SELECTIONS`) against the same contract: its pick fits the
width it declares (what the HBM cache is sized for), holds at most the distinct blocks it declares
(what admission counts; a KV head's own pick holds exactly that), always keeps the sink and window
blocks, and gives dense attention's tokens through the cache when the budget covers the sequence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.attention import pick_blocks
from sparseserve_hf.ops import TORCH_OPS, reference
from sparseserve_hf.scoring import SELECTIONS
from tiny_models import greedy, random_ids, tiny_model

GROUP, KV_HEADS, TABLE = 3, 2, 40


def config_for(selection: str, **overrides) -> SparseServeConfig:
    return SparseServeConfig(**{"block_size": 16, "token_budget": 128, "selection": selection, **overrides})


@pytest.mark.parametrize(
    ("selection", "load_budget"), [(name, None) for name in SELECTIONS] + [("group_union", 160)]
)  # load_budget caps the group union only
def test_pick_fits_the_declared_width_and_distinct_blocks(selection, load_budget):
    config = config_for(selection, load_budget=load_budget)
    granularity = SELECTIONS[selection]
    generator = torch.Generator().manual_seed(0)
    num_blocks = torch.tensor([TABLE, 25, 3])  # a long row, a medium one, one with fewer blocks than the budget
    scores = torch.randn(3, KV_HEADS * GROUP, TABLE, generator=generator)
    scores = scores.masked_fill(torch.arange(TABLE)[None, None, :] >= num_blocks[:, None, None], float("-inf"))
    picked, valid, head_mask = pick_blocks(TORCH_OPS, config, scores, num_blocks, KV_HEADS, TABLE)
    assert picked.shape[:2] == valid.shape[:2] == (3, KV_HEADS)
    assert picked.shape[-1] <= granularity.pick_width(config, GROUP)
    assert (head_mask is not None) == (selection == "query_head")
    for row, count in enumerate(num_blocks.tolist()):
        for head in range(KV_HEADS):
            chosen = set(picked[row, head][valid[row, head]].tolist())
            assert len(chosen) == int(valid[row, head].sum())  # no block loaded twice
            most = min(granularity.distinct_blocks(config, GROUP), count)
            assert len(chosen) == most if selection == "kv_head" else len(chosen) <= most  # a union may overlap
            assert all(0 <= block < count for block in chosen)
            kept = set(range(config.sink_blocks)) | set(range(count - config.window_blocks, count))
            assert kept <= chosen


@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_ranking_only_to_the_rank_depth_picks_what_a_full_ranking_picks(selection):
    """The hybrid interleave ranks each ranking's top `rank_depth` blocks only; the pick must not see it."""
    config = config_for(selection, metadata="hybrid")
    depth = SELECTIONS[selection].rank_depth(config)
    generator = torch.Generator().manual_seed(1)
    num_blocks = torch.tensor([TABLE, 30])
    unused = torch.arange(TABLE)[None, None, :] >= num_blocks[:, None, None]  # -inf there, as a table scores
    quest, means = torch.randn(2, 2, KV_HEADS * GROUP, TABLE, generator=generator).masked_fill(unused, float("-inf"))
    shallow = reference.combine_by_rank(quest, means, depth=depth)  # distinct scores: no ties to break
    full = reference.combine_by_rank(quest, means, depth=None)
    picks = [pick_blocks(TORCH_OPS, config, scores, num_blocks, KV_HEADS, TABLE) for scores in (shallow, full)]
    (picked, valid, _), (picked_full, valid_full, _) = picks
    for row in range(2):
        for head in range(KV_HEADS):
            chosen, chosen_full = picked[row, head][valid[row, head]], picked_full[row, head][valid_full[row, head]]
            assert set(chosen.tolist()) == set(chosen_full.tolist())


def test_query_head_mask_marks_each_head_s_own_picks():
    config = config_for("query_head")
    generator = torch.Generator().manual_seed(2)
    num_blocks = torch.tensor([TABLE])
    scores = torch.randn(1, KV_HEADS * GROUP, TABLE, generator=generator)
    union, valid, head_mask = pick_blocks(TORCH_OPS, config, scores, num_blocks, KV_HEADS, TABLE)
    own, own_valid = TORCH_OPS.select_blocks(
        scores, num_blocks, config.selected_full_blocks, config.sink_blocks, config.window_blocks, True
    )  # (1, Hq, K)
    for head in range(KV_HEADS * GROUP):
        kv = head // GROUP
        marked = set(union[0, kv][valid[0, kv] & head_mask[0, head]].tolist())
        assert marked == set(own[0, head][own_valid[0, head]].tolist())


@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_full_budget_gives_dense_tokens(selection):
    ids = random_ids(1, 77)
    expected = greedy(tiny_model("llama", "sdpa", num_heads=6, num_kv_heads=2), ids)
    model = tiny_model("llama", num_heads=6, num_kv_heads=2)
    cache = SparseServeCache(model.config, config_for(selection, token_budget=4096))
    assert torch.equal(greedy(model, ids, cache), expected)


def test_only_the_group_union_is_capped_by_a_load_budget():
    """`load_budget` is refused with the other granularities today; were it not, their widths would still
    be what their ops produce (neither op takes the cap), so the cache is never sized below its pick."""
    limits = SimpleNamespace(selected_full_blocks=8, sink_blocks=1, window_blocks=1, topk_blocks=6, load_blocks=10)
    widths = {name: (s.pick_width(limits, GROUP), s.distinct_blocks(limits, GROUP)) for name, s in SELECTIONS.items()}
    assert widths == {"group_union": (10, 10), "query_head": (24, 20), "kv_head": (8, 8)}
