"""The hybrid rank interleave kernel against `reference.combine_by_rank` (with a depth)."""

from __future__ import annotations

import pytest
import torch

from kernel_support import DEVICE
from sparseserve_hf.ops import reference, triton_rank


def ragged_scores(rows: int, heads: int, width: int, counts: list[int]) -> torch.Tensor:
    scores = torch.randn(rows, heads, width)
    return scores.masked_fill(torch.arange(width) >= torch.tensor(counts)[:, None, None], float("-inf"))


@pytest.mark.parametrize("depth", [1, 7, 16, 40])
@pytest.mark.parametrize("counts", [[37, 5, 0], [64, 64, 63]])
def test_matches_reference(depth, counts):
    first, second = ragged_scores(3, 4, 64, counts), ragged_scores(3, 4, 64, counts)
    want = reference.combine_by_rank(first, second, depth=depth)
    got = triton_rank.combine_top_ranks(first.to(DEVICE), second.to(DEVICE), depth)
    assert torch.equal(got.cpu(), want)


def test_depth_past_the_table_ranks_every_block():
    first, second = ragged_scores(2, 2, 10, [10, 4]), ragged_scores(2, 2, 10, [10, 4])
    got = triton_rank.combine_top_ranks(first.to(DEVICE), second.to(DEVICE), 64)
    assert torch.equal(got.cpu(), reference.combine_by_rank(first, second, depth=64))
    assert torch.equal(got.cpu(), reference.combine_by_rank(first, second))  # depth >= N: the full ranking


def test_equal_scores_take_the_lower_block_first():
    first = torch.zeros(1, 1, 6)
    second = torch.full((1, 1, 6), float("-inf"))
    second[..., :] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    got = triton_rank.combine_top_ranks(first.to(DEVICE), second.to(DEVICE), 3)
    assert got.cpu()[0, 0].tolist() == [0.0, -2.0, -4.0, -6.0, -6.0, -6.0]  # first's ties by index, then second's


def test_a_wide_table_with_many_ties_ranks_them_by_block_index():
    # The decode shape's width (~1K blocks) at the default depth, with scores drawn from a few
    # values. The full ranking breaks ties by position, as the kernel does; cut at the depth it is
    # what the kernel must give, entry for entry.
    torch.manual_seed(3)
    first = torch.randint(0, 40, (2, 3, 1000)).float()
    second = torch.randint(0, 9, (2, 3, 1000)).float()
    first[1, :, 900:] = second[1, :, 900:] = float("-inf")
    full = reference.combine_by_rank(first, second)
    want = torch.where(torch.isneginf(full), full, full.clamp(min=-2.0 * 61))
    got = triton_rank.combine_top_ranks(first.to(DEVICE), second.to(DEVICE), 61).cpu()
    assert torch.equal(got, want)
