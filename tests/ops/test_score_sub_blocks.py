"""Triton block scoring with sub-block metadata (`metadata_sub_blocks`) against `reference.score_table`."""

from __future__ import annotations

import pytest
import torch

from kernel_support import DEVICE, DTYPES, tolerance
from sparseserve_hf.ops import reference, triton_score


@pytest.mark.parametrize("kind", ["quest", "cuboid", "hybrid"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sub_blocks", [2, 4])
def test_score_table_with_sub_blocks_matches_reference(poisoned, kind, dtype, sub_blocks):
    kv_heads, group, dim, pool_size = 2, 3, 16, 200
    keys = torch.randn(pool_size, 8, dim)
    metadata = reference.block_metadata(keys, kind, sub_blocks).to(dtype)  # (C, M * sub, D)
    table = torch.randperm(pool_size)[: 2 * kv_heads * 37].view(2, kv_heads, 37)
    table[1, :, 5:] = -1  # a short row
    query = torch.randn(2, kv_heads * group, dim).to(dtype)
    expected = reference.score_table(query, metadata, table, kind)
    got = triton_score.score_table(query.to(DEVICE), metadata.to(DEVICE), table.to(DEVICE), kind)
    assert torch.equal(torch.isinf(got).cpu(), table.repeat_interleave(group, 1) < 0)
    if kind == "hybrid":  # ranks: exact, unless two fp16 scores are within rounding of each other
        assert (got.cpu() != expected).float().mean() < (0.02 if dtype == torch.float16 else 1e-9)
        return
    torch.testing.assert_close(
        got.cpu(), expected, **tolerance(torch.float32 if dtype == torch.float32 else torch.float16)
    )


def test_score_table_rejects_an_odd_quest_vector_count():
    with pytest.raises(ValueError, match=r"quest metadata holds \(min, max\) pairs"):
        triton_score.score_table(
            torch.zeros(1, 1, 16), torch.zeros(1, 3, 16), torch.zeros(1, 1, 1, dtype=torch.long), "quest"
        )


def test_small_budget_triton_equals_torch_backend_with_hybrid_sub_blocks():
    """Below the length, hybrid metadata (Quest per block + means per 4-token sub-block: both kernel
    paths, SUB = 1 and 4): the Triton path selects as the reference path. Kept short: interpreted."""
    from test_triton_ladder import random_ids, tiny_llama

    from sparseserve_hf import SparseServeCache, SparseServeConfig
    from tiny_models import greedy

    model = tiny_llama("sparseserve")
    ids = random_ids(1, 100)
    caches = {
        backend: SparseServeCache(
            model.config,
            SparseServeConfig(
                block_size=16, token_budget=64, backend=backend, metadata="hybrid", metadata_sub_blocks=4
            ),
        )
        for backend in ("torch", "triton")
    }
    tokens = {backend: greedy(model, ids, cache, max_new_tokens=3) for backend, cache in caches.items()}
    assert torch.equal(tokens["triton"], tokens["torch"])
    for torch_layer, triton_layer in zip(caches["torch"].layers, caches["triton"].layers):
        assert torch.equal(torch_layer.last_selection, triton_layer.last_selection)
