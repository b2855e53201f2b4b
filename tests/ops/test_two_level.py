"""The two-level group-union selection against the one-level kernel and `reference.select_group_union`."""

from __future__ import annotations

import functools

import pytest
import torch
from test_select import scores_for

from kernel_support import DEVICE
from sparseserve_hf.ops import reference, triton_rank, triton_select, triton_two_level


def both(scores, counts, num_selected, sink, window, kv_heads, score_floor=None, chunk=16):
    """(one-level, two-level) unions of the same scores, on the kernels' device."""
    args = (scores.to(DEVICE), torch.tensor(counts).to(DEVICE), num_selected, sink, window, kv_heads, score_floor)
    one = triton_select.select_group_union(*args)
    two = triton_two_level.select_group_union_chunked(*args, chunk=chunk)
    return one, two


@pytest.mark.parametrize("kv_heads,group", [(2, 4), (1, 3), (2, 1)])  # group 1: selection="kv_head"
@pytest.mark.parametrize("counts", [[100, 37, 0], [64, 64, 63], [16, 17, 5]])
def test_two_levels_give_the_one_level_union_entry_for_entry(kv_heads, group, counts):
    scores = scores_for(3, kv_heads * group, 100, counts)
    one, two = both(scores, counts, 8, 1, 2, kv_heads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    want, want_valid = reference.select_group_union(scores, torch.tensor(counts), 8, 1, 2, kv_heads)
    assert torch.equal(two[0].cpu(), want) and torch.equal(two[1].cpu(), want_valid)


def test_ties_across_chunks_go_to_the_lowest_blocks():
    """Every score equal: each head's top-K is the sink, the window and the lowest other blocks,
    though they span chunks and every chunk offers K candidates."""
    counts = [90]
    scores = torch.zeros(1, 4, 90)
    one, two = both(scores, counts, 10, 1, 1, 1, chunk=16)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert two[0][0, 0][two[1][0, 0]].cpu().tolist() == [*range(9), 89]


@pytest.mark.parametrize("depth,counts", [(12, [100, 40, 7]), (30, [70, 31, 0])])
def test_rank_interleaves_with_the_few_bit_search(depth, counts):
    """The hybrid default's integer scores (most blocks at the floor) and its few-bit search."""
    first, second = scores_for(3, 8, 100, counts), scores_for(3, 8, 100, counts)
    combined = reference.combine_by_rank(first, second, depth=depth)
    one, two = both(combined, counts, min(depth, 16), 1, 2, 2, score_floor=-2 * depth)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_nan_scores_and_a_table_one_chunk_wide():
    counts = [30, 12]
    scores = scores_for(2, 4, 30, counts)
    scores[0, 1, 3:20] = float("nan")
    for chunk in (16, 32):  # two chunks, then the whole table in one
        one, two = both(scores, counts, 6, 1, 1, 2, chunk=chunk)
        assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_the_op_takes_two_levels_from_its_minimum_width(monkeypatch):
    counts = [60, 33]
    scores = scores_for(2, 4, 64, counts).to(DEVICE)
    args = (scores, torch.tensor(counts).to(DEVICE), 6, 1, 1, 2)
    launched = []
    original = triton_two_level.select_group_union_chunked
    monkeypatch.setattr(
        triton_two_level,
        "select_group_union_chunked",
        lambda *a, **k: launched.append(k["chunk"]) or original(*a, **k),
    )
    monkeypatch.setattr(triton_two_level, "CHUNK", 16)
    assert triton_two_level.MIN_TABLE > 64  # the default: one level at this width
    one = triton_two_level.select_group_union(*args)
    monkeypatch.setattr(triton_two_level, "MIN_TABLE", 64)
    two = triton_two_level.select_group_union(*args)
    assert launched == [16] and torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_a_chunk_that_is_not_a_power_of_two_is_refused():
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        triton_two_level.select_group_union_chunked(torch.zeros(1, 2, 40), torch.tensor([40]), 4, 1, 1, 1, chunk=24)


@pytest.mark.parametrize("depth", [5, 12, 40])
@pytest.mark.parametrize("counts", [[100, 37, 0], [16, 17, 100]])
def test_two_level_rank_interleave_equals_the_one_level_kernel(depth, counts):
    """Each ranking's top-`depth` list, its ranks and the floor elsewhere, for tables several
    chunks wide, rows of every length (-inf past each row's count) and lists deeper than a chunk."""
    first, second = scores_for(3, 4, 100, counts), scores_for(3, 4, 100, counts)
    first[0, 1, 40:60] = second[0, 1, 50:70] = 0.25  # ties inside and across chunks
    first, second = first.to(DEVICE), second.to(DEVICE)
    one = triton_rank.combine_top_ranks(first, second, depth)
    two = triton_two_level.combine_top_ranks_chunked(first, second, depth, chunk=16)
    assert torch.equal(one, two)  # (the one-level kernel against the reference: tests/ops/test_rank.py)


def test_the_score_op_takes_the_two_level_interleave_from_its_minimum_width(monkeypatch):
    first, second = scores_for(2, 4, 64, [64, 20]).to(DEVICE), scores_for(2, 4, 64, [64, 20]).to(DEVICE)
    monkeypatch.setattr(triton_two_level, "CHUNK", 16)
    one = triton_two_level.combine_top_ranks(first, second, 6)
    monkeypatch.setattr(triton_two_level, "MIN_TABLE", 64)
    launched = []
    original = triton_two_level.combine_top_ranks_chunked
    monkeypatch.setattr(
        triton_two_level, "combine_top_ranks_chunked", lambda *a, **k: launched.append(k["chunk"]) or original(*a, **k)
    )
    two = triton_two_level.combine_top_ranks(first, second, 6)
    assert launched == [16] and torch.equal(one, two)


def test_a_drop_in_decode_selects_the_same_blocks_in_two_levels(monkeypatch):
    """End to end through `generate` with the Triton op set (hybrid metadata, the group union): the
    two-level kernels on a table of several chunks pick what the one-level kernels pick."""
    from test_triton_ladder import random_ids, tiny_llama

    from sparseserve_hf import SparseServeCache, SparseServeConfig
    from tiny_models import greedy

    model = tiny_llama("sparseserve")
    ids = random_ids(2, 400)  # 25 blocks of 16: two chunks of 16
    runs, launched = [], []
    for name in ("combine_top_ranks_chunked", "select_group_union_chunked"):
        original = getattr(triton_two_level, name)
        spy = functools.partial(
            lambda original, name, *a, **k: launched.append(name) or original(*a, **k), original, name
        )
        monkeypatch.setattr(triton_two_level, name, spy)
    for min_table in (None, 16):
        monkeypatch.setattr(triton_two_level, "MIN_TABLE", min_table)
        monkeypatch.setattr(triton_two_level, "CHUNK", 16)
        config = SparseServeConfig(
            block_size=16, token_budget=128, backend="triton", hbm_cache_bytes=1 << 19, metadata="hybrid",
            selection="group_union", group_aggregation="max",
        )  # fmt: skip
        cache = SparseServeCache(model.config, config)
        runs.append((greedy(model, ids, cache, max_new_tokens=4), [layer.last_selection for layer in cache.layers]))
    assert torch.equal(runs[0][0], runs[1][0]) and set(launched) == {
        "combine_top_ranks_chunked",
        "select_group_union_chunked",
    }
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_wide_tables_take_two_levels_in_chunks_by_how_many_programs_one_level_would_run(monkeypatch):
    monkeypatch.setattr(triton_two_level, "MIN_TABLE", 64)
    monkeypatch.setattr(triton_two_level, "_multiprocessors", lambda device: 132)
    monkeypatch.setattr(triton_two_level, "CHUNK", 32)
    monkeypatch.setattr(triton_two_level, "FILLED_CHUNK", 16)
    device = torch.device("cpu")
    chunk = 32
    assert triton_two_level.two_level_chunk(64, 64, device) == 32  # B=2 x 32 query heads: half the SMs idle
    assert triton_two_level.two_level_chunk(1024, 4096, device) == 16  # B=32 x 32: the rows fill the GPU
    assert triton_two_level.two_level_chunk(1024, 64, device) == 16
    assert triton_two_level.two_level_chunk(64, 63, device) is None  # a narrower table: one level
    assert triton_two_level.two_level_chunk(64, chunk, device) is None  # one chunk would hold the whole table
    monkeypatch.setattr(triton_two_level, "MIN_TABLE", None)
    assert triton_two_level.two_level_chunk(1, 1 << 20, device) is None


def test_the_ops_take_the_filled_chunk_when_the_rows_fill_the_gpu(monkeypatch):
    counts = [60, 33]
    scores = scores_for(2, 4, 64, counts).to(DEVICE)
    second = scores_for(2, 4, 64, counts).to(DEVICE)
    union_args = (scores, torch.tensor(counts).to(DEVICE), 6, 1, 1, 2)
    one_level = triton_rank.combine_top_ranks(scores, second, 6), triton_select.select_group_union(*union_args)
    launched = []
    for name in ("combine_top_ranks_chunked", "select_group_union_chunked"):
        original = getattr(triton_two_level, name)
        monkeypatch.setattr(
            triton_two_level, name, lambda *a, name=name, original=original, **k: launched.append((name, k["chunk"]))
            or original(*a, **k),
        )  # fmt: skip
    monkeypatch.setattr(triton_two_level, "MIN_TABLE", 64)
    monkeypatch.setattr(triton_two_level, "FILLED_CHUNK", 16)
    monkeypatch.setattr(triton_two_level, "_multiprocessors", lambda device: 2)  # 2 x 4 rows x heads fill it
    ranks = triton_two_level.combine_top_ranks(scores, second, 6)
    union = triton_two_level.select_group_union(*union_args)
    assert launched == [("combine_top_ranks_chunked", 16), ("select_group_union_chunked", 16)]
    assert torch.equal(ranks, one_level[0])
    assert torch.equal(union[0], one_level[1][0]) and torch.equal(union[1], one_level[1][1])
