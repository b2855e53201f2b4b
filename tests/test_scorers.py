"""Every registered scorer (`scoring.SCORERS`) against the same contract: the metadata it declares is
what it makes, its scores have the table's shape with -inf exactly where the table is unused, and a
budget covering the sequence gives dense attention's tokens through the cache."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.ops import TORCH_OPS
from sparseserve_hf.scoring import SCORERS
from tiny_models import greedy, random_ids, tiny_model

# Each kind with the selection it is meant for (channel scores: one pick per KV head by summed mass).
SELECTION = {"channels": dict(selection="kv_head", group_aggregation="sum")}
FP8 = torch.float8_e4m3fn


def config_for(kind: str, **overrides) -> SparseServeConfig:
    return SparseServeConfig(block_size=16, metadata=kind, **SELECTION.get(kind, {}), **overrides)


@pytest.mark.parametrize("kind", list(SCORERS))
def test_metadata_has_the_declared_rows_in_the_stored_dtype(kind):
    config, scorer = config_for(kind), SCORERS[kind]
    metadata = scorer.summarize(TORCH_OPS, torch.randn(5, 16, 24), config, FP8)
    assert metadata.shape == (5, config.metadata_vectors, 24) == (5, scorer.metadata_rows(config), 24)
    assert metadata.dtype == FP8


@pytest.mark.parametrize("kind", list(SCORERS))
def test_scores_cover_the_table_and_mark_unused_entries(kind):
    torch.manual_seed(0)
    config, scorer = config_for(kind), SCORERS[kind]
    metadata = scorer.summarize(TORCH_OPS, torch.randn(30, 16, 24), config, FP8)  # (C, M, D)
    table = torch.randperm(30)[:24].view(2, 2, 6)  # (B, Hkv, N)
    table[1, :, 4:] = -1
    scores = scorer.score(TORCH_OPS, torch.randn(2, 6, 24), metadata, table, config, 24**-0.5)
    assert scores.shape == (2, 6, 6) and scores.dtype == torch.float32
    assert torch.equal(torch.isneginf(scores), (table < 0).repeat_interleave(3, dim=1))
    assert torch.isfinite(scores[table.repeat_interleave(3, dim=1) >= 0]).all()


@pytest.mark.parametrize("kind", list(SCORERS))
def test_each_kind_says_what_it_stores_in(kind):
    scorer, cpu = SCORERS[kind], torch.device("cpu")
    assert scorer.stored_dtype("float8_e4m3fn", torch.bfloat16, cpu) == FP8  # every kind stores in 8 bits
    assert scorer.stored_dtype("auto", torch.bfloat16, cpu) == FP8
    if kind == "channels":  # bytes whatever the KV dtype and the device
        with pytest.raises(ValueError, match="bytes"):
            scorer.stored_dtype("kv", torch.bfloat16, cpu)
    else:
        assert scorer.stored_dtype("kv", torch.bfloat16, cpu) == torch.bfloat16


@pytest.mark.core
@pytest.mark.parametrize("kind", list(SCORERS))
def test_budget_covering_the_sequence_equals_sdpa(kind):
    model = tiny_model("llama", num_heads=6, num_kv_heads=2)
    ids = random_ids(1, 77)
    expected = greedy(tiny_model("llama", "sdpa", num_heads=6, num_kv_heads=2), ids)
    cache = SparseServeCache(model.config, config_for(kind, token_budget=1024))
    assert torch.equal(greedy(model, ids, cache), expected)
    assert cache.stats()["metadata_bytes_read_per_step"] > 0
