"""Triton block scoring against `reference.score_table` / `reference.score_blocks`."""

from __future__ import annotations

import pytest
import torch

from kernel_support import DEVICE, DTYPES, ON_GPU, tolerance
from sparseserve_hf.ops import reference, triton_score


def ragged_table(batch: int, kv_heads: int, width: int, pool_size: int, counts: list[int]) -> torch.Tensor:
    """(B, Hkv, N) distinct random DRAM ids, row b using its first counts[b] entries, -1 after."""
    ids = torch.randperm(pool_size)[: batch * kv_heads * width].view(batch, kv_heads, width)
    unused = torch.arange(width) >= torch.tensor(counts)[:, None, None]
    return ids.masked_fill(unused, -1)


@pytest.mark.parametrize("kind", ["quest", "cuboid"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 4), (1, 8)])
@pytest.mark.parametrize("dim", [16, 64])
def test_score_table_matches_reference(poisoned, kind, dtype, kv_heads, group, dim):
    counts = [37, 5, 0]  # odd, short and empty rows; N = 37 spans two 32/64-block tiles
    table = ragged_table(3, kv_heads, 37, 400, counts)
    keys = torch.randn(400, 8, dim)
    metadata = reference.block_metadata(keys, kind).to(dtype)  # (C, M, D)
    query = torch.randn(3, kv_heads * group, dim).to(dtype)
    expected = reference.score_table(query, metadata, table, kind)
    got = triton_score.score_table(query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), kind)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(torch.isinf(got).cpu(), table.repeat_interleave(group, 1) < 0)
    torch.testing.assert_close(
        got.cpu(), expected, **tolerance(torch.float32 if dtype == torch.float32 else torch.float16)
    )


@pytest.mark.parametrize("kind", ["quest", "cuboid"])
def test_score_blocks_on_gathered_metadata_matches_reference(poisoned, kind):
    metadata = reference.block_metadata(torch.randn(2, 3, 11, 8, 32), kind).half()  # (B, Hkv, N, M, D)
    query = torch.randn(2, 12, 32).half()
    expected = reference.score_blocks(query, metadata, kind)
    pool = metadata.reshape(-1, *metadata.shape[3:])  # (B*Hkv*N, M, D): the gathered table as a pool
    table = torch.arange(pool.shape[0]).view(metadata.shape[:3])
    got = triton_score.score_table(query.to(DEVICE), pool.to(DEVICE), table.to(DEVICE), kind)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.float16))


def test_score_table_of_a_strided_query():
    metadata = reference.block_metadata(torch.randn(40, 8, 16), "quest")
    query = torch.randn(2, 4, 3, 16)[:, :, 1]  # (B, Hq, D) view with a non-trivial head stride
    table = ragged_table(2, 2, 9, 40, [9, 4])
    expected = reference.score_table(query, metadata, table, "quest")
    torch.testing.assert_close(
        triton_score.score_table(query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), "quest").cpu(), expected
    )


def test_score_table_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown metadata kind"):
        triton_score.score_table(
            torch.zeros(1, 1, 16), torch.zeros(1, 2, 16), torch.zeros(1, 1, 1, dtype=torch.long), "x"
        )


@pytest.mark.gpu
def test_score_table_at_llama_shape_bf16():
    table = ragged_table(4, 8, 1000, 40000, [1000, 999, 17, 500])
    metadata = reference.block_metadata(torch.randn(40000, 32, 128), "quest").bfloat16()
    query = torch.randn(4, 32, 128).bfloat16()
    expected = reference.score_table(query, metadata, table, "quest")
    got = triton_score.score_table(query.cuda(), metadata.cuda(), table.cuda(), "quest")
    torch.testing.assert_close(got.cpu(), expected, atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("kind", ["quest", "cuboid", "hybrid"])
def test_score_table_of_an_fp32_query_over_half_metadata(kind):
    """A query in another dtype than the metadata is scored in fp32, not rounded to the metadata's dtype."""
    table = ragged_table(2, 2, 21, 100, [21, 8])
    metadata = reference.block_metadata(torch.randn(100, 8, 32), kind, 2 if kind == "hybrid" else 1).half()
    query = torch.randn(2, 6, 32)
    expected = reference.score_table(query, metadata, table, kind)
    got = triton_score.score_table(query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), kind)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.float32))


@pytest.mark.parametrize("kind", ["quest", "cuboid", "hybrid"])
@pytest.mark.parametrize("query_dtype", [torch.float16, torch.float32] + ([torch.bfloat16] if ON_GPU else []), ids=str)
def test_score_table_over_float8_metadata(kind, query_dtype):
    """8-bit metadata widens exactly to the query's dtype: only the summation order differs."""
    table = ragged_table(2, 2, 37, 160, [37, 9])
    keys = torch.randn(160, 8, 32) * 4
    metadata = reference.block_metadata(keys, kind, 2 if kind == "hybrid" else 1, torch.float8_e4m3fn)
    query = torch.randn(2, 8, 32).to(query_dtype)
    expected = reference.score_table(query, metadata, table, kind)
    got = triton_score.score_table(query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), kind)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.float32 if kind == "hybrid" else query_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["quest", "cuboid"])
def test_a_bf16_query_of_wide_range_over_float8_metadata_scores_as_in_fp32(kind):
    """The fp16 products of a bf16 query over 8-bit metadata: a query spanning seven decades (and a
    zero one) scores as the fp32 reference does, up to fp32 summation order (far inside bf16 rounding)."""
    table = ragged_table(3, 2, 37, 240, [37, 9, 20])
    keys = torch.randn(240, 8, 32) * 4
    metadata = reference.block_metadata(keys, kind, 1, torch.float8_e4m3fn)
    magnitude = 10.0 ** torch.empty(3, 8, 32).uniform_(-4, 3)
    query = (torch.randn(3, 8, 32) * magnitude).bfloat16()
    query[2] = 0.0
    expected = reference.score_table(query, metadata, table, kind)
    got = triton_score.score_table(query.cuda(), metadata.cuda(), table.cuda(), kind)
    largest = float(expected[expected.isfinite()].abs().max())
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4 * largest, rtol=1e-5)
    assert (got.cpu()[2][expected[2].isfinite()] == 0).all()


@pytest.mark.parametrize("kind", ["hybrid", "quest", "cuboid"])
@pytest.mark.parametrize("eight_bit", [False, True], ids=["kv_dtype", "float8"])
def test_scores_stored_last_are_the_same_scores(kind, eight_bit, monkeypatch):
    """The `STORES_LAST` launch knob moves the stores, not the arithmetic: bit-equal parts."""
    counts = [37, 5]
    table = ragged_table(2, 2, 37, 400, counts)
    keys = torch.randn(400, 8, 16)
    dtype = DTYPES[-1]  # bf16 on the GPU
    metadata = reference.block_metadata(
        keys, kind, 2 if kind == "hybrid" else 1, torch.float8_e4m3fn if eight_bit else dtype
    )
    query = torch.randn(2, 8, 16).to(dtype if dtype != torch.float32 else torch.float16)
    args = (query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), kind)
    before = triton_score.score_parts(*args)
    monkeypatch.setattr(triton_score, "STORES_LAST", True)
    after = triton_score.score_parts(*args)
    assert len(before) == len(after) == (2 if kind == "hybrid" else 1)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
