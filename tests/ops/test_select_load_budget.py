"""A KV head's load cap (`SparseServeConfig.load_budget`): the capped group union, spec and kernels."""

from __future__ import annotations

import math

import pytest
import torch
from test_select import scores_for

from kernel_support import DEVICE
from sparseserve_hf.ops import reference, triton_select, triton_two_level


def capped_union_by_hand(scores, count, num_selected, sink, window, heads, cap) -> list[int]:
    """One (row, KV head), in plain Python: every head ranks its blocks (sink and window first, then
    by score, NaN lowest, equal scores to the lower block); the union of each head's k best, for
    the largest k <= K whose union holds at most `cap` blocks."""
    rankings = []
    for head in heads:

        def key(n, head=head):
            forced = n < sink or n >= count - window
            value = scores[head, n].item()
            value = -3.4e38 if math.isnan(value) else value  # NaN ranks lowest
            return (0 if forced else 1, -value, n)

        rankings.append(sorted(range(count), key=key))
    for k in range(min(num_selected, count), -1, -1):
        union = set().union(*(ranking[:k] for ranking in rankings))
        if len(union) <= cap:
            return sorted(union)
    raise AssertionError("k = 0 always fits")


def loaded(union, valid, row, kv) -> list[int]:
    return union[row, kv][valid[row, kv]].cpu().tolist()


@pytest.mark.parametrize("cap", [8, 11, 20, 31])  # K, between, G*K - 1 (G = 4, K = 8)
@pytest.mark.parametrize("integer", [False, True])  # integer scores tie often (the hybrid's ranks)
def test_the_reference_cuts_each_heads_ranking_evenly(cap, integer):
    counts, kv_heads, group, num_selected = [60, 30, 9], 2, 4, 8
    torch.manual_seed(cap)
    scores = scores_for(3, kv_heads * group, 64, counts, integer=integer)
    scores[0, 1, 10:14] = float("nan")
    union, valid = reference.select_group_union(scores, torch.tensor(counts), num_selected, 1, 2, kv_heads, None, cap)
    assert union.shape == (3, kv_heads, cap)
    for row, count in enumerate(counts):
        for kv in range(kv_heads):
            heads = range(kv * group, (kv + 1) * group)
            want = capped_union_by_hand(scores[row], count, num_selected, 1, 2, heads, cap)
            assert loaded(union, valid, row, kv) == want


def test_a_cap_at_or_above_the_whole_union_changes_nothing():
    counts, kv_heads, num_selected = [64, 20], 2, 8
    scores = scores_for(2, 8, 64, counts)
    whole = reference.select_group_union(scores, torch.tensor(counts), num_selected, 1, 1, kv_heads)
    for cap in (None, 32, 40):
        capped = reference.select_group_union(scores, torch.tensor(counts), num_selected, 1, 1, kv_heads, None, cap)
        assert torch.equal(capped[0], whole[0]) and torch.equal(capped[1], whole[1])


@pytest.mark.parametrize("cap", [8, 13, 28, 31])  # 28 and 31: the search range is one k (7)
@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("counts", [[64, 37, 0], [9, 64, 40]])
def test_the_kernels_give_the_reference_capped_union(cap, integer, counts):
    """One level and two levels (16-block chunks), float and tied integer scores, entry for entry."""
    kv_heads, num_selected = 2, 8
    torch.manual_seed(len(counts) * cap)
    scores = scores_for(3, kv_heads * 4, 64, counts, integer=integer)
    num_blocks = torch.tensor(counts)
    want = reference.select_group_union(scores, num_blocks, num_selected, 1, 2, kv_heads, None, cap)
    args = (scores.to(DEVICE), num_blocks.to(DEVICE), num_selected, 1, 2, kv_heads, None, cap)
    for got in (
        triton_select.select_group_union(*args),
        triton_two_level.select_group_union_chunked(*args, chunk=16),
    ):
        assert torch.equal(got[1].cpu(), want[1]) and torch.equal(got[0].cpu(), want[0])
        assert int(got[1].sum(-1).max()) <= cap


def test_the_kernel_searches_integer_keys_with_a_score_floor():
    """The few-bit search of rank-interleave scores (-inf or integers >= the floor) under a cap."""
    counts, kv_heads, num_selected, cap, floor = [50, 50], 1, 6, 9, -40
    scores = scores_for(2, 3, 50, counts, integer=True)
    num_blocks = torch.tensor(counts)
    want = reference.select_group_union(scores, num_blocks, num_selected, 1, 1, kv_heads, floor, cap)
    got = triton_select.select_group_union(
        scores.to(DEVICE), num_blocks.to(DEVICE), num_selected, 1, 1, kv_heads, floor, cap
    )
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
