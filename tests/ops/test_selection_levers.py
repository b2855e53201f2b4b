"""Selection levers: sub-block metadata (`metadata_sub_blocks`), against hand-computed values."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparseserve_hf import SparseServeConfig
from sparseserve_hf.ops import reference


def test_quest_sub_block_metadata_by_hand():
    # One block of 4 tokens, 2 channels, 2 sub-blocks of 2 tokens.
    keys = torch.tensor([[1.0, -1.0], [3.0, 0.0], [-2.0, 5.0], [0.0, 1.0]])
    meta = reference.block_metadata(keys, "quest", 2)
    expected = torch.tensor([[1.0, -1.0], [3.0, 0.0], [-2.0, 1.0], [0.0, 5.0]])  # min_0, max_0, min_1, max_1
    torch.testing.assert_close(meta, expected)
    torch.testing.assert_close(reference.block_metadata(keys, "cuboid", 2), torch.tensor([[2.0, -0.5], [-1.0, 3.0]]))
    # The default (one summary) is the whole block's min/max, as before.
    torch.testing.assert_close(reference.block_metadata(keys, "quest"), torch.tensor([[-2.0, -1.0], [3.0, 5.0]]))


def test_quest_sub_block_score_is_the_max_over_sub_blocks_by_hand():
    keys = torch.tensor([[1.0, -1.0], [3.0, 0.0], [-2.0, 5.0], [0.0, 1.0]])
    query = torch.tensor([[[1.0, 1.0]]])  # (B=1, Hq=1, D=2)
    # Sub-block 0: max(1,3) + max(-1,0) = 3; sub-block 1: max(-2,0) + max(1,5) = 5; block = 5.
    # Whole block: 3 + 5 = 8 (looser: no single token reaches it; the true max q.k is 3).
    fine = reference.score_blocks(query, reference.block_metadata(keys, "quest", 2)[None, None, None], "quest")
    coarse = reference.score_blocks(query, reference.block_metadata(keys, "quest")[None, None, None], "quest")
    assert fine.item() == 5.0 and coarse.item() == 8.0
    # Cuboid: sub-block means (2, -0.5) -> 1.5 and (-1, 3) -> 2; block = 2.
    cuboid = reference.score_blocks(query, reference.block_metadata(keys, "cuboid", 2)[None, None, None], "cuboid")
    assert cuboid.item() == 2.0


@pytest.mark.parametrize("sub_blocks", [1, 2, 4, 8])
def test_finer_quest_metadata_is_a_tighter_upper_bound(sub_blocks):
    keys = torch.randn(2, 3, 6, 8, 16)  # (B, Hkv, N, S, D)
    query = torch.randn(2, 6, 16)
    fine = reference.score_blocks(query, reference.block_metadata(keys, "quest", sub_blocks), "quest")
    coarse = reference.score_blocks(query, reference.block_metadata(keys, "quest"), "quest")
    exact = torch.einsum("bhgd,bhnsd->bhgns", query.view(2, 3, 2, 16), keys).amax(-1).flatten(1, 2)  # (B, Hq, N)
    assert (fine <= coarse + 1e-5).all() and (fine >= exact - 1e-5).all()
    if sub_blocks == 8:  # one token per sub-block: the bound is exact
        torch.testing.assert_close(fine, exact)


def test_block_metadata_rejects_a_sub_block_count_that_does_not_divide_the_block():
    with pytest.raises(ValueError, match="sub_blocks must divide"):
        reference.block_metadata(torch.randn(8, 16), "quest", 3)


@pytest.mark.parametrize("value", [0, 3, 64, -2, 1.0, True])
def test_config_metadata_sub_blocks_is_validated(value):
    with pytest.raises(ValueError, match="metadata_sub_blocks"):
        SparseServeConfig(metadata_sub_blocks=value)


def test_config_metadata_vectors():
    assert SparseServeConfig(metadata="quest").metadata_vectors == 2
    assert SparseServeConfig(metadata="quest", metadata_sub_blocks=4).metadata_vectors == 8
    assert SparseServeConfig(metadata="cuboid", metadata_sub_blocks=4).metadata_vectors == 4
    hybrid = SparseServeConfig(metadata="hybrid", metadata_sub_blocks=2)
    assert SparseServeConfig.from_dict(hybrid.to_dict()).metadata_sub_blocks == 2


def test_hybrid_metadata_keeps_a_mean_per_8_tokens_by_default():
    config = SparseServeConfig(metadata="hybrid")
    assert (config.metadata, config.sub_blocks, config.metadata_vectors) == ("hybrid", 4, 6)
    assert SparseServeConfig(metadata="hybrid", block_size=2, token_budget=8).sub_blocks == 2  # capped at block_size
    assert SparseServeConfig(metadata="quest").sub_blocks == 1
    assert SparseServeConfig(metadata="cuboid").sub_blocks == 1
    # None means "the kind's default", so switching kinds with replace() gets the new kind's default
    assert replace(config, metadata="quest").metadata_vectors == 2
    assert replace(config, metadata="quest", metadata_sub_blocks=4).sub_blocks == 4
    assert SparseServeConfig.from_dict(config.to_dict()) == config


def test_hybrid_metadata_layout_by_hand():
    keys = torch.tensor([[1.0, -1.0], [3.0, 0.0], [-2.0, 5.0], [0.0, 1.0]])
    meta = reference.block_metadata(keys, "hybrid", 2)  # whole-block min, max, then the 2 sub-block means
    expected = torch.tensor([[-2.0, -1.0], [3.0, 5.0], [2.0, -0.5], [-1.0, 3.0]])
    torch.testing.assert_close(meta, expected)
    assert reference.metadata_sub_blocks("hybrid", 4) == 2
    with pytest.raises(ValueError, match="hybrid metadata"):
        reference.metadata_sub_blocks("hybrid", 2)


def test_combine_by_rank_interleaves_the_two_rankings_by_hand():
    first = torch.tensor([[[5.0, 4.0, 3.0, 2.0, 1.0, float("-inf")]]])  # ranks 0 1 2 3 4 (last unused)
    second = torch.tensor([[[0.0, 1.0, 2.0, 9.0, 8.0, float("-inf")]]])  # ranks 4 3 2 0 1
    combined = reference.combine_by_rank(first, second)
    # min ranks: 0 (first), 1 (first), 2 (tie -> first), 0 (second), 1 (second) -> -(2*min + [second won])
    assert combined.tolist() == [[[-0.0, -2.0, -4.0, -1.0, -3.0, float("-inf")]]]
    top = combined.topk(4, dim=-1).indices.sort().values.tolist()
    assert top == [[[0, 1, 3, 4]]]  # the two best of each ranking


def test_hybrid_score_table_ignores_unused_entries():
    keys = torch.randn(10, 8, 16)
    meta = reference.block_metadata(keys, "hybrid", 2)  # (C, 4, D)
    query = torch.randn(1, 2, 16)
    table = torch.tensor([[[3, 7, 1, -1, -1]]])
    padded = reference.score_table(query, meta, table, "hybrid")
    short = reference.score_table(query, meta, table[..., :3], "hybrid")
    torch.testing.assert_close(padded[..., :3], short)
    assert torch.isneginf(padded[..., 3:]).all()


def test_config_hybrid_vectors():
    assert SparseServeConfig(metadata="hybrid", metadata_sub_blocks=1).metadata_vectors == 3
    assert SparseServeConfig(metadata="hybrid", metadata_sub_blocks=4).metadata_vectors == 6


@pytest.mark.parametrize("num_selected", [1, 5, 16, 40])
def test_ranking_only_the_top_k_selects_what_the_full_ranking_selects(num_selected):
    """combine_by_rank(depth=K) ranks two top-K lists instead of sorting every block: same top-K blocks."""
    torch.manual_seed(num_selected)
    first, second = torch.randn(3, 4, 37), torch.randn(3, 4, 37)
    first[1, :, 30:] = second[1, :, 30:] = float("-inf")  # a row with 30 blocks in a table of 37
    num_blocks = torch.tensor([37, 30, 37])
    full = reference.combine_by_rank(first, second)
    shallow = reference.combine_by_rank(first, second, depth=num_selected)
    for sink, window in [(0, 0), (1, 1), (2, 3)]:
        if sink + window > num_selected:  # the forced blocks alone overflow K (config refuses this)
            continue
        want = reference.select_blocks(full, num_blocks, num_selected, sink, window)
        got = reference.select_blocks(shallow, num_blocks, num_selected, sink, window)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (sink, window)
    assert torch.equal(shallow.isneginf(), full.isneginf())


def test_shallow_combination_equals_the_full_one_on_the_top_ranks():
    """With depth d: each block in either top-d list scores what the full ranking gives it, the rest -2d."""
    torch.manual_seed(0)
    first, second = torch.randn(2, 3, 50), torch.randn(2, 3, 50)
    first[0, :, 40:] = second[0, :, 40:] = float("-inf")
    full, shallow = reference.combine_by_rank(first, second), reference.combine_by_rank(first, second, depth=8)
    in_lists = full > -16  # min(rank1, rank2) < 8
    assert torch.equal(shallow[in_lists], full[in_lists])
    rest = ~in_lists & ~full.isneginf()
    assert bool((shallow[rest] == -16).all()) and torch.equal(shallow.isneginf(), full.isneginf())
