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


def three_rows(model) -> tuple[TieredBlockStore, list[SparseServeCache], list, int]:
    """Three one-row caches of 40, 70 and 17 tokens over one store, each row's tokens, the DRAM blocks in use."""
    store = shared_store(model)
    caches = [prefilled(model, store, n, seed=n) for n in (40, 70, 17)]
    return store, caches, [rows_of(c) for c in caches], store.dram.num_used


@pytest.mark.core
def test_append_and_pop_move_rows_without_touching_the_store(llama):
    store, caches, alone, used = three_rows(llama)
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
    store.read_stats().hits = 5  # the counters the read returns are the store's own
    # 70 tokens: 4 full blocks (the tail keeps 1..16) x 2 KV heads x 2 layers
    before = store.dram.num_used
    batch.pop_rows([1]).reset()
    assert before - store.dram.num_used == 4 * 2 * 2
    assert store.read_stats().hits == 5  # a cache over a shared store does not reset the owner's counters
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


def addresses(cache: SparseServeCache) -> list[int]:
    return [t.data_ptr() for layer in cache.layers for t in layer.graph_tensors().values()]


@pytest.mark.core
def test_a_row_taken_out_leaves_its_slot_vacant_and_the_other_rows_where_they_were(llama):
    store, caches, alone, used = three_rows(llama)
    batch = SparseServeCache(llama.config, CONFIG, store=store)
    for slot, cache in enumerate(caches):
        batch.place_rows(cache, [slot])
        assert not cache.layers[0].is_initialized  # moved, not shared
    assert batch.num_rows == 3 and batch.vacant_slots == [] and store.dram.num_used == used
    before = addresses(batch)
    middle = batch.take_rows([1])
    assert batch.vacant_slots == [1] and batch.layers[0].row_lengths().tolist() == [40, 0, 17]
    assert addresses(batch) == before, "the rows that stay keep their tensors"
    assert middle.get_seq_length() == 70 and store.dram.num_used == used
    assert torch.equal(rows_of(middle)[0][0][0], alone[1][0][0][0])
    kept = rows_of(batch)
    assert torch.equal(kept[1][2][0], alone[2][1][0][0]) and torch.equal(kept[0][0][1], alone[0][0][0][1])
    batch.place_rows(prefilled(llama, store, 25, seed=25), [1])  # the vacant slot is filled in place
    assert batch.layers[0].row_lengths().tolist() == [40, 25, 17] and addresses(batch) == before
    middle.reset()
    batch.take_rows([2]).reset()
    assert batch.num_rows == 2  # no row past slot 1 holds anything: the cache shrinks to 2 rows
    batch.take_rows([0]).reset()
    batch.take_rows([1]).reset()
    assert batch.num_rows == 0 and store.dram.num_used == 0 and int(store.dram.refcount.sum()) == 0


@pytest.mark.core
def test_placing_past_the_last_row_grows_the_cache_to_a_geometric_size_of_vacant_rows(llama):
    store = shared_store(llama)
    batch = SparseServeCache(llama.config, CONFIG, store=store)
    batch.place_rows(prefilled(llama, store, 30, seed=1), [4])
    assert batch.num_rows == 6 and batch.vacant_slots == [0, 1, 2, 3, 5]  # 1, 2, 3, 4, 6, 8, ... rows
    assert batch.layers[0].row_lengths().tolist() == [0, 0, 0, 0, 30, 0]
    capped = SparseServeCache(llama.config, CONFIG, store=store)
    capped.place_rows(prefilled(llama, store, 30, seed=2), [4], max_rows=5)
    assert capped.num_rows == 5 and capped.vacant_slots == [0, 1, 2, 3]


@pytest.mark.core
def test_bad_slot_moves_raise_and_change_nothing(llama):
    store = shared_store(llama)
    batch = SparseServeCache(llama.config, CONFIG, store=store)
    for slot, n in enumerate((40, 70, 17)):
        batch.place_rows(prefilled(llama, store, n, seed=n), [slot])
    batch.take_rows([1]).reset()
    extra = prefilled(llama, store, 20, seed=3)
    lengths, used = batch.layers[0].row_lengths().tolist(), store.dram.num_used
    with pytest.raises(ValueError, match=r"slots \[0\] hold rows"):
        batch.place_rows(extra, [0])
    with pytest.raises(ValueError, match="hold no row"):
        batch.take_rows([1])
    with pytest.raises(ValueError, match="hold no row"):
        batch.take_rows([7])
    with pytest.raises(ValueError, match="distinct"):
        batch.take_rows([0, 0])
    with pytest.raises(ValueError, match="1 distinct"):
        batch.place_rows(extra, [1, 3])
    with pytest.raises(TypeError, match="list"):
        batch.take_rows(2)
    with pytest.raises(ValueError, match="vacant slots"):
        batch.append_rows(extra)
    with pytest.raises(ValueError, match="vacant slots"):
        batch.pop_rows([0])
    with pytest.raises(ValueError, match="shared"):
        batch.place_rows(prefilled(llama, shared_store(llama), 20, seed=4), [1])
    assert batch.layers[0].row_lengths().tolist() == lengths and batch.vacant_slots == [1]
    assert store.dram.num_used == used and extra.get_seq_length() == 20
