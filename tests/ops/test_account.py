"""Triton load accounting against `reference.account_loads` (exact integers)."""

from __future__ import annotations

import pytest
import torch

from kernel_support import DEVICE
from sparseserve_hf.ops import reference, triton_account


@pytest.mark.parametrize("batch,kv_heads,width", [(1, 1, 5), (3, 2, 37), (40, 8, 64)])
def test_account_loads_matches_reference(batch, kv_heads, width):
    valid = torch.rand(batch, kv_heads, width) < 0.6
    num_blocks = torch.randint(0, 50, (batch,))
    tail_len = torch.randint(0, 16, (batch,))
    num_blocks[0], tail_len[0] = 0, 0  # an empty (padding) row
    totals = torch.randint(0, 1000, (kv_heads, reference.LOAD_COUNTERS))  # adds to what is there
    expected = totals.clone()
    for _ in range(2):
        reference.account_loads(expected, valid, num_blocks, tail_len, 16)
    got = totals.to(DEVICE)
    for _ in range(2):
        triton_account.account_loads(got, valid.to(DEVICE), num_blocks.to(DEVICE), tail_len.to(DEVICE), 16)
    assert torch.equal(got.cpu(), expected)


def test_account_loads_of_a_strided_selection_into_a_slice_of_the_counters():
    pool = torch.zeros(6, reference.LOAD_COUNTERS, dtype=torch.long)
    valid = (torch.rand(4, 2, 3, 10) < 0.5)[:, :, 1]  # (B, Hkv, U) with a row stride of 30
    num_blocks, tail_len = torch.tensor([3, 0, 9, 1]), torch.tensor([1, 0, 15, 16])
    expected = pool.clone()
    reference.account_loads(expected[2:4], valid, num_blocks, tail_len, 16)
    got = pool.to(DEVICE)
    triton_account.account_loads(got[2:4], valid.to(DEVICE), num_blocks.to(DEVICE), tail_len.to(DEVICE), 16)
    assert torch.equal(got.cpu(), expected)
