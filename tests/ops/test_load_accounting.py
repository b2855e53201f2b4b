"""What a budget costs: the decode step's load counters (`reference.account_loads`) and what
`SparseServeCache.stats()` and the Generator report from them."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.ops import reference
from tiny_models import greedy, random_ids, tiny_model

BLOCK = 16


def test_account_loads_counts_blocks_tail_context_and_live_rows():
    totals = torch.zeros(2, reference.LOAD_COUNTERS, dtype=torch.long)
    valid = torch.tensor(
        [
            [[True, True, False], [True, False, False]],  # row 0: head 0 loads 2 blocks, head 1 one
            [[True, True, True], [False, False, False]],  # row 1 (padding flags beyond its blocks are ignored)
            [[True, True, True], [True, True, True]],  # row 2 holds no token: it never counts
        ]
    )  # (B=3, Hkv=2, U=3)
    num_blocks, tail_len = torch.tensor([5, 1, 0]), torch.tensor([3, 4, 0])
    reference.account_loads(totals, valid, num_blocks, tail_len, block_size=4)
    reference.account_loads(totals, valid, num_blocks, tail_len, block_size=4)
    # head 0: (2*4 + 3) + (3*4 + 4) = 27; head 1: (1*4 + 3) + (0 + 4) = 11; context (5*4+3) + (1*4+4) = 31
    step = torch.tensor([[27, 31, 2, 6], [11, 31, 2, 6]])
    assert torch.equal(totals[:, :4], 2 * step)
    assert totals[:, 4].tolist() == [2, 2]


def run(budget: int, new_tokens: int = 8, **fields) -> SparseServeCache:
    model = tiny_model("llama", "sparseserve")
    cache = SparseServeCache(model.config, SparseServeConfig(block_size=BLOCK, token_budget=budget, **fields))
    greedy(model, random_ids(2, 90), cache, max_new_tokens=new_tokens)
    return cache


def test_a_budget_covering_the_sequence_reads_every_token():
    stats = run(1024).stats()
    assert stats["decode_steps"] == 7  # the first new token comes from the prefill
    assert stats["loaded_fraction"] == 1.0
    assert stats["loaded_tokens_per_kv_head"] == pytest.approx(90 + 4)  # contexts 91 .. 97 over 7 steps
    assert stats["loaded_tokens_p95_over_heads"] == pytest.approx(94)


def test_a_small_budget_reads_what_its_picks_load():
    config_budget = 4 * BLOCK
    cache = run(config_budget, new_tokens=2)  # one decode step: its picks are the layers' last_pick
    stats = cache.stats()
    loaded = 0
    for layer in cache.layers:
        _, valid, _, _ = layer.last_pick
        loaded += (valid.sum(-1) * BLOCK + layer.tail_len.view(-1, 1)).sum()
    rows_heads = len(cache.layers) * 2 * cache.layers[0].tail.shape[1]
    assert stats["decode_steps"] == 1
    assert stats["loaded_tokens_per_kv_head"] == pytest.approx(float(loaded) / rows_heads)
    assert 0 < stats["loaded_fraction"] < 1


def test_metadata_bytes_read_per_step_and_its_fraction():
    cache = run(1024, new_tokens=2, metadata="quest", metadata_dtype="kv")
    stats, store = cache.stats(), cache.store
    kv_heads, dim = cache.layers[0].tail.shape[1], store.metadata.shape[2]
    blocks = 2 * (91 // BLOCK)  # two rows, full blocks at the decode step
    per_block = 2 * dim * store.metadata.element_size()  # quest: (min, max)
    assert stats["metadata_bytes_read_per_step"] == blocks * kv_heads * len(cache.layers) * per_block
    # quest min/max is 2 of the 2 * block_size vectors of a block's K and V, less the tails' share
    assert stats["metadata_fraction"] == pytest.approx(2 / (2 * BLOCK) * blocks * BLOCK / (2 * 91), rel=1e-6)


def test_reset_starts_the_counters_afresh():
    cache = run(64)
    assert cache.stats()["decode_steps"] == 7
    cache.reset()
    stats = cache.stats()
    assert stats["decode_steps"] == 0 and stats["loaded_tokens_per_kv_head"] == 0.0
