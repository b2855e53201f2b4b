"""Triton block scoring with all G heads of a group in one tile, and hybrid fused into one pass."""

from __future__ import annotations

import pytest
import torch

from kernel_support import DEVICE, DTYPES, ON_GPU, tolerance
from sparseserve_hf.ops import reference, triton_score


def table_with_gaps(batch: int, kv_heads: int, width: int, pool_size: int) -> torch.Tensor:
    """(B, Hkv, N) distinct random ids; row 0 ragged (odd length), row 1 all -1, one head of row 2 all -1."""
    ids = torch.randperm(pool_size)[: batch * kv_heads * width].view(batch, kv_heads, width)
    ids[0, :, width // 2 + 1 :] = -1
    ids[1] = -1
    ids[2, 0] = -1
    return ids


def metadata_pool(kind: str, sub_blocks: int, dtype: torch.dtype, pool_size: int = 300, dim: int = 32) -> torch.Tensor:
    """(C, M, D) metadata of random keys, as rows of a wider pool (strided rows, each (M, D) contiguous)."""
    metadata = reference.block_metadata(torch.randn(pool_size, 8, dim), kind, sub_blocks).to(dtype)
    wide = torch.zeros(pool_size, metadata.shape[1] + 1, dim, dtype=dtype)
    wide[:, 1:] = metadata
    return wide[:, 1:]


def assert_scores_match(got: torch.Tensor, expected: torch.Tensor, kind: str, dtype: torch.dtype) -> None:
    if kind == "hybrid":  # ranks: exact, unless two fp16 scores are within rounding of each other
        assert (got != expected).float().mean() < (0.02 if dtype != torch.float32 else 1e-9)
    else:
        torch.testing.assert_close(got, expected, **tolerance(dtype))


@pytest.mark.parametrize("kind", ["quest", "cuboid", "hybrid"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads,group", [(2, 3), (1, 1), (1, 8)])
def test_group_tile_matches_reference(poisoned, kind, dtype, kv_heads, group):
    """G = 3 pads to a 4-head tile; G = 1 and 8 fill it. Empty rows and heads score -inf."""
    metadata = metadata_pool(kind, 2, dtype)
    table = table_with_gaps(3, kv_heads, 37, metadata.shape[0])
    query = torch.randn(3, kv_heads * group, metadata.shape[-1]).to(dtype)
    expected = reference.score_table(query, metadata, table, kind)
    got = triton_score.score_table(query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), kind).cpu()
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(torch.isneginf(got), table.repeat_interleave(group, 1) < 0)
    assert_scores_match(got, expected, kind, dtype)


@pytest.mark.parametrize("sub_blocks", [2, 4])
@pytest.mark.parametrize("depth", [None, 5])
def test_fused_hybrid_equals_quest_and_cuboid_scored_apart(poisoned, sub_blocks, depth):
    """One pass over (min, max, means) == quest over the pool's first 2 vectors + cuboid over the
    rest (two launches on strided views), combined by rank."""
    metadata = metadata_pool("hybrid", sub_blocks, torch.float32).to(DEVICE)
    table = table_with_gaps(3, 2, 37, metadata.shape[0]).to(DEVICE)
    query = torch.randn(3, 6, metadata.shape[-1], device=DEVICE)
    parts = [triton_score.score_table(query, part, table, k) for k, part in reference.hybrid_parts(metadata)]
    fused = triton_score.score_table(query, metadata, table, "hybrid", depth)
    assert torch.equal(fused, reference.combine_by_rank(*parts, depth=depth))


@pytest.mark.parametrize("kind", ["quest", "cuboid", "hybrid"])
def test_launch_knobs_give_the_same_scores(kind):
    """Blocks per program and warps (the `eval.bench.score_tuning` sweep) only change the launch."""
    metadata = metadata_pool(kind, 4 if kind == "hybrid" else 1, torch.float32, pool_size=1000).to(DEVICE)
    table = table_with_gaps(3, 2, 150, metadata.shape[0]).to(DEVICE)  # 150: 3 programs of 64, 10 of 16
    query = torch.randn(3, 8, metadata.shape[-1], device=DEVICE)
    default = triton_score.score_table(query, metadata, table, kind)
    for block_n, warps in [(16, 2), (32, 4), (64, 8)]:
        got = triton_score.score_table(query, metadata, table, kind, block_n=block_n, num_warps=warps)
        torch.testing.assert_close(got, default, atol=1e-6, rtol=1e-6)


def test_empty_table_returns_empty_scores():
    for kind, vectors in (("quest", 2), ("cuboid", 1), ("hybrid", 3)):
        got = triton_score.score_table(
            torch.zeros(2, 4, 16), torch.zeros(5, vectors, 16), torch.zeros(2, 2, 0, dtype=torch.long), kind, 4
        )
        assert got.shape == (2, 4, 0)


def test_hybrid_rejects_rows_without_a_mean():
    with pytest.raises(ValueError, match="hybrid metadata holds"):
        triton_score.score_table(
            torch.zeros(1, 1, 16), torch.zeros(1, 2, 16), torch.zeros(1, 1, 1, dtype=torch.long), "hybrid"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("group", [4, 8])
def test_fused_hybrid_at_llama_shape_bf16(group):
    """Llama-3-8B (G = 4) / 70B-like (G = 8) heads, D = 128, 4 sub-block means: the default launch."""
    assert ON_GPU
    metadata = reference.block_metadata(torch.randn(20000, 32, 128), "hybrid", 4).bfloat16().cuda()
    table = table_with_gaps(4, 8, 1000, metadata.shape[0]).cuda()
    query = torch.randn(4, 8 * group, 128).bfloat16().cuda()
    for kind, part in reference.hybrid_parts(metadata):  # each part against the reference
        got = triton_score.score_table(query, part, table, kind)
        torch.testing.assert_close(got, reference.score_table(query, part, table, kind), atol=1e-2, rtol=1e-3)
    parts = [triton_score.score_table(query, part, table, k) for k, part in reference.hybrid_parts(metadata)]
    for depth in (None, 64):  # fused == apart, but for ranks of scores a rounding apart
        fused = triton_score.score_table(query, metadata, table, "hybrid", depth)
        assert (fused != reference.combine_by_rank(*parts, depth=depth)).float().mean() < 1e-3
