"""Caches sharing one store, and rows moved between them (what the batching Generator builds on)."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.cache.store import TieredBlockStore
from sparseserve_hf.ops import get_ops
from tiny_models import random_ids

CONFIG = SparseServeConfig(block_size=16, token_budget=48)


def shared_store(model) -> TieredBlockStore:
    return TieredBlockStore(CONFIG, get_ops("torch", torch.device("cpu")), 16, torch.float32, torch.device("cpu"))


def prefilled(model, store, length: int, seed: int) -> SparseServeCache:
    cache = SparseServeCache(model.config, CONFIG, store=store)
    with torch.no_grad():
        model(random_ids(1, length, seed=seed), past_key_values=cache)
    return cache


def rows_of(cache: SparseServeCache) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, per row: (keys, values) of the row's stored tokens."""
    out = []
    for layer in cache.layers:
        keys, values, valid = layer.past()
        out.append([(keys[r][:, valid[r]], values[r][:, valid[r]]) for r in range(keys.shape[0])])
    return out


@pytest.mark.core
def test_append_and_pop_move_rows_without_touching_the_store(llama):
    store = shared_store(llama)
    caches = [prefilled(llama, store, n, seed=n) for n in (40, 70, 17)]
    alone = [rows_of(c) for c in caches]
    used = store.dram.num_used
    batch = SparseServeCache(llama.config, CONFIG, store=store)
    for cache in caches:
        batch.append_rows(cache)
        assert not cache.layers[0].is_initialized  # moved, not shared
    assert store.dram.num_used == used and batch.layers[0].row_lengths().tolist() == [40, 70, 17]
    assert batch.get_seq_length() == 70
    joined = rows_of(batch)
    for layer in range(len(joined)):
        for row in range(3):
            assert torch.equal(joined[layer][row][0], alone[row][layer][0][0])
            assert torch.equal(joined[layer][row][1], alone[row][layer][0][1])
    middle = batch.pop_rows([1])
    assert batch.layers[0].row_lengths().tolist() == [40, 17] and batch.get_seq_length() == 40
    assert middle.get_seq_length() == 70 and store.dram.num_used == used
    assert torch.equal(rows_of(middle)[0][0][0], alone[1][0][0][0])


@pytest.mark.core
def test_freeing_a_popped_row_frees_exactly_its_blocks_and_keeps_shared_counters(llama):
    store = shared_store(llama)
    batch = SparseServeCache(llama.config, CONFIG, store=store)
    for n in (40, 70):
        batch.append_rows(prefilled(llama, store, n, seed=n))
    store.stats.hits = 5
    # 70 tokens: 4 full blocks (the tail keeps 1..16) x 2 KV heads x 2 layers
    before = store.dram.num_used
    batch.pop_rows([1]).reset()
    assert before - store.dram.num_used == 4 * 2 * 2
    assert store.stats.hits == 5  # a cache over a shared store does not reset the owner's counters
    batch.pop_rows([0]).reset()
    assert store.dram.num_used == 0 and int(store.dram.refcount.sum()) == 0
    assert not batch.layers[0].is_initialized


def test_rows_joined_at_different_lengths_decode_like_separate_caches(llama):
    """One batched decode over ragged rows (per-row positions, no mask) equals each row alone."""
    store = shared_store(llama)
    lengths = (40, 70, 17)
    batch = SparseServeCache(llama.config, CONFIG, store=store)
    for n in lengths:
        batch.append_rows(prefilled(llama, store, n, seed=n))
    tokens = torch.tensor([[5], [9], [200]])
    with torch.no_grad():
        joined = llama(tokens, position_ids=torch.tensor(lengths)[:, None], past_key_values=batch).logits[:, -1]
        for row, n in enumerate(lengths):
            alone = prefilled(llama, shared_store(llama), n, seed=n)
            logits = llama(tokens[row : row + 1], past_key_values=alone).logits[0, -1]
            torch.testing.assert_close(joined[row], logits, rtol=1e-5, atol=1e-5)


def test_bad_moves_raise(llama):
    store = shared_store(llama)
    cache = prefilled(llama, store, 20, seed=1)
    with pytest.raises(ValueError, match="shared"):
        SparseServeCache(llama.config, CONFIG).append_rows(cache)
    with pytest.raises(ValueError, match="rows"):
        cache.pop_rows([3])
    with pytest.raises(ValueError, match="SparseServeConfig"):
        SparseServeCache(llama.config, SparseServeConfig(), store=store)
    with pytest.raises(NotImplementedError, match="SparseServeLayer"):
        SparseServeCache(llama.config, SparseServeConfig(block_size=16, token_budget=48, dense_layers=(0,))).pop_rows(
            [0]
        )
