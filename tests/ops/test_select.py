"""The fused group-union selection kernel against `reference.select_group_union`."""

from __future__ import annotations

import pytest
import torch

from kernel_support import DEVICE
from sparseserve_hf.ops import reference, triton_select


def scores_for(batch: int, num_q_heads: int, width: int, counts: list[int], integer: bool = False) -> torch.Tensor:
    """(B, Hq, N) random scores, -inf past each row's count (as `score_table` gives them)."""
    scores = (
        torch.randint(-40, 0, (batch, num_q_heads, width)).float()
        if integer
        else torch.randn(batch, num_q_heads, width)
    )
    unused = torch.arange(width) >= torch.tensor(counts)[:, None, None]
    return scores.masked_fill(unused, float("-inf"))


def check(scores, counts, num_selected, sink, window, kv_heads, exact_ties=True, score_floor=None):
    num_blocks = torch.tensor(counts)
    want, want_valid = reference.select_group_union(scores, num_blocks, num_selected, sink, window, kv_heads)
    got, got_valid = triton_select.select_group_union(
        scores.to(DEVICE), num_blocks.to(DEVICE), num_selected, sink, window, kv_heads, score_floor
    )
    if exact_ties:
        assert torch.equal(got_valid.cpu(), want_valid) and torch.equal(got.cpu(), want)
    for row in range(len(counts)):  # every loaded block exists, and sink + window are always loaded
        for head in range(kv_heads):
            loaded = set(got[row, head][got_valid[row, head]].cpu().tolist())
            assert all(0 <= n < counts[row] for n in loaded)
            forced = {n for n in range(counts[row]) if n < sink or n >= counts[row] - window}
            assert forced <= loaded


@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 4), (1, 3)])
@pytest.mark.parametrize("counts", [[37, 5, 0], [64, 64, 63]])
def test_matches_reference_on_random_scores(kv_heads, group, counts):
    check(scores_for(3, kv_heads * group, 64, counts), counts, 8, 1, 2, kv_heads)


def test_nan_scores_rank_below_every_real_score():
    counts = [30, 30]
    scores = scores_for(2, 4, 32, counts)
    scores[0, 1, 3:20] = float("nan")  # more NaN than top-k slots
    scores[1, :, 5] = float("nan")
    check(scores, counts, 6, 1, 1, 2)


def test_tied_scores_keep_k_per_head():
    """Integer scores tie often (the hybrid ranking's are small integers): each head still takes
    exactly K blocks; which of the tied ones may differ from the reference's top-k."""
    counts = [50, 17]
    scores = scores_for(2, 6, 50, counts, integer=True)
    num_selected, kv_heads = 7, 2
    check(scores, counts, num_selected, 1, 1, kv_heads, exact_ties=False)
    got, valid = triton_select.select_group_union(
        scores.to(DEVICE), torch.tensor(counts).to(DEVICE), num_selected, 1, 1, kv_heads
    )
    got, valid = got.cpu(), valid.cpu()
    group = 3
    for row, count in enumerate(counts):
        for kv in range(kv_heads):
            loaded = set(got[row, kv][valid[row, kv]].tolist())
            allowed, smallest_head_pick = {0, count - 1}, num_selected
            for head in range(kv * group, (kv + 1) * group):
                rank = scores[row, head, :count].clone()
                rank[0] = rank[count - 1] = float("inf")  # sink and window
                kth = rank.topk(num_selected).values[-1]
                allowed |= {n for n in range(count) if rank[n] >= kth}
            assert loaded <= allowed and smallest_head_pick <= len(loaded) <= group * num_selected


def test_combined_hybrid_ranks_match_exactly():
    """`combine_by_rank` scores (distinct small integers above a shared floor) select exactly as the reference."""
    counts = [90, 40]
    first, second = scores_for(2, 8, 96, counts), scores_for(2, 8, 96, counts)
    combined = reference.combine_by_rank(first, second, depth=10)
    check(combined, counts, 10, 1, 2, 2)
    check(combined, counts, 10, 1, 2, 2, score_floor=-20)  # the few-bit search the hybrid default runs


@pytest.mark.parametrize("depth,counts", [(12, [60, 40, 7]), (30, [20, 31, 0]), (64, [64, 1, 33])])
def test_few_bit_search_over_rank_interleaves_matches_the_float_search(depth, counts):
    """Scores at the floor (blocks in neither top list: rows shorter than the depth) and -inf
    entries rank as in the float search, sink and window blocks still first."""
    first, second = scores_for(3, 8, 64, counts), scores_for(3, 8, 64, counts)
    combined = reference.combine_by_rank(first, second, depth=depth)
    check(combined, counts, min(depth, 16), 1, 2, 2, score_floor=-2 * depth)
    num_blocks = torch.tensor(counts).to(DEVICE)
    floats = triton_select.select_group_union(combined.to(DEVICE), num_blocks, min(depth, 16), 1, 2, 2)
    integers = triton_select.select_group_union(combined.to(DEVICE), num_blocks, min(depth, 16), 1, 2, 2, -2 * depth)
    assert all(torch.equal(a, b) for a, b in zip(floats, integers))


def test_rows_shorter_than_the_budget_load_every_block():
    counts = [3, 0]
    scores = scores_for(2, 4, 16, counts)
    got, valid = triton_select.select_group_union(scores.to(DEVICE), torch.tensor(counts).to(DEVICE), 8, 1, 1, 2)
    assert got[0, :, :3].cpu().tolist() == [[0, 1, 2]] * 2 and valid[0].sum(-1).tolist() == [3, 3]
    assert not valid[1].any() and (got[1] == 0).all()


def test_scores_one_float_step_apart_are_ranked_to_the_last_bit():
    """The search stops once the bits so far part the top K from the rest; scores a single ulp
    apart part only at the last bit, and must still select exactly."""
    counts = [40, 40]
    steps = torch.arange(40, dtype=torch.float32)
    base = torch.full((40,), 1.5).view(torch.int32) + steps.int()  # consecutive floats above 1.5
    scores = torch.full((2, 4, 40), float("-inf"))
    scores[0] = base.view(torch.float32)[torch.randperm(40)]
    scores[1] = -base.view(torch.float32)[torch.randperm(40)]  # negatives: the keys' other half
    check(scores, counts, 9, 1, 1, 2)
