"""Triton channel scores against `ops.channels` (the spec)."""

from __future__ import annotations

import pytest
import torch

from kernel_support import DEVICE, DTYPES
from sparseserve_hf.ops import channels, triton_channels

FP8 = torch.float8_e4m3fn


def ragged_table(batch: int, kv_heads: int, width: int, pool_size: int, counts: list[int]) -> torch.Tensor:
    """(B, Hkv, N) distinct random DRAM ids, row b using its first counts[b] entries, -1 after."""
    ids = torch.randperm(pool_size)[: batch * kv_heads * width].view(batch, kv_heads, width)
    return ids.masked_fill(torch.arange(width) >= torch.tensor(counts)[:, None, None], -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 3), (1, 4)])
@pytest.mark.parametrize("dim,read", [(16, 5), (64, 24), (128, 48), (64, 64)])
def test_block_logsumexp_matches_reference(poisoned, dtype, kv_heads, group, dim, read):
    torch.manual_seed(dim + read + group)
    counts = [37, 5, 0]  # odd, short and empty rows; N = 37 spans three 16-block tiles
    table = ragged_table(3, kv_heads, 37, 400, counts)
    keys = torch.randn(400, 32, dim) * torch.rand(dim) * 4  # channels of different ranges
    metadata = channels.channel_metadata(keys, FP8)  # (C, M, D)
    query = torch.randn(3, kv_heads * group, dim).to(dtype)
    chosen, scaled = channels.channel_queries(query, kv_heads, read, dim**-0.5)
    expected = channels.block_logsumexp(scaled, chosen, metadata, table)
    got = triton_channels.block_logsumexp(scaled.to(DEVICE), chosen.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE))
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(torch.isneginf(got).cpu(), table.repeat_interleave(group, 1) < 0)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-5)


def test_score_channels_matches_reference_and_strided_tables(poisoned):
    torch.manual_seed(5)
    keys = torch.randn(300, 32, 64)
    metadata = channels.channel_metadata(keys, FP8)
    wide = ragged_table(2, 3, 48, 300, [48, 20])
    table = wide[:, :, :40]  # a view: rows strided past its width, as a graph step's fixed-width tables
    query = torch.randn(2, 9, 64)
    expected = channels.score_channels(query, metadata, table, 24, 0.125)
    got = triton_channels.score_channels(query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), 24, 0.125)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-6, rtol=1e-4)
    assert torch.allclose(got[0].sum(-1).cpu(), torch.ones(9))


def test_empty_table_returns_empty():
    metadata = channels.channel_metadata(torch.randn(4, 32, 16), FP8).to(DEVICE)
    scaled, chosen = torch.zeros(0, 2, 2, 4, device=DEVICE), torch.zeros(0, 2, 4, dtype=torch.long, device=DEVICE)
    out = triton_channels.block_logsumexp(
        scaled, chosen, metadata, torch.zeros(0, 2, 5, dtype=torch.long, device=DEVICE)
    )
    assert out.shape == (0, 4, 5)


@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 3), (1, 4)])
@pytest.mark.parametrize("dim,read", [(16, 5), (128, 48)])
def test_tensor_core_products_match_reference_to_fp16_rounding(poisoned, kv_heads, group, dim, read):
    """The launch knob: keys and the scaled query rounded to fp16, products on tensor cores."""
    torch.manual_seed(dim + group)
    table = ragged_table(2, kv_heads, 21, 200, [21, 9])
    metadata = channels.channel_metadata(torch.randn(200, 32, dim) * 2, FP8)
    chosen, scaled = channels.channel_queries(torch.randn(2, kv_heads * group, dim), kv_heads, read, dim**-0.5)
    expected = channels.block_logsumexp(scaled, chosen, metadata, table)
    got = triton_channels.block_logsumexp(
        scaled.to(DEVICE), chosen.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), tensor_cores=True
    )
    assert torch.equal(torch.isneginf(got).cpu(), torch.isneginf(expected))
    torch.testing.assert_close(got.cpu(), expected, atol=2e-2, rtol=2e-3)
