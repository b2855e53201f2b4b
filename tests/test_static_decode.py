"""The decode step split for CUDA-graph capture, on CPU.

A capturable step cannot decide on the host which rows' tail blocks are full. So the full tails
are saved before the step, for all layers in one store call (`SparseServeCache.roll_full_tails`,
`TieredBlockStore.save_many`), and the step only appends (`ops.append_token`).
These tests check that the split stores and decodes exactly what the eager step does, with rows
whose blocks fill at different steps.
"""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.cache.store import TieredBlockStore
from sparseserve_hf.compat import cache_kwarg
from sparseserve_hf.ops import get_ops
from tiny_models import HEAD_DIM, random_ids

BLOCK = 16
BLOCK_BYTES = 2 * BLOCK * HEAD_DIM * 4  # fp32 head-block
LENGTHS = (160, 150, 144)  # tails of 16 (full), 6 and 16 (full) tokens: blocks fill at different steps
CPU = torch.device("cpu")


def static_config(**overrides) -> SparseServeConfig:
    """Fixed pools, as graph mode needs; an HBM cache tight enough to evict (3 rows x 2 KV heads x 6 blocks)."""
    values = dict(
        block_size=BLOCK, token_budget=4 * BLOCK, hbm_cache_bytes=2 * 36 * BLOCK_BYTES, dram_bytes=1024 * BLOCK_BYTES
    )
    return SparseServeConfig(**(values | overrides))


def batch_cache(model, config: SparseServeConfig, lengths=LENGTHS) -> tuple[SparseServeCache, torch.Tensor]:
    """Rows of `lengths` prompt tokens, each prefilled alone, then joined in one cache (as the Generator does).

    Returns the cache and each row's first greedy token (B, 1). Pools on the model's device, in its dtype.
    """
    weight = next(model.parameters())
    store = TieredBlockStore(config, get_ops(config.backend, weight.device), HEAD_DIM, weight.dtype, weight.device)
    batch = SparseServeCache(model.config, config, store=store)
    firsts = []
    for row, length in enumerate(lengths):
        cache = SparseServeCache(model.config, config, store=store)
        with torch.no_grad():
            ids = random_ids(1, length, seed=row + 1).to(weight.device)
            logits = model(ids, **{cache_kwarg(model): cache}).logits
        firsts.append(logits[:, -1].argmax(-1, keepdim=True))
        batch.append_rows(cache)
    return batch, torch.cat(firsts)


def eager_step(model, cache: SparseServeCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One decode step down the ordinary eager path; returns the logits (B, V)."""
    with torch.no_grad():
        out = model(input_ids=tokens, position_ids=positions, **{cache_kwarg(model): cache}, use_cache=True)
    return out.logits[:, -1]


def stored(cache: SparseServeCache) -> list[tuple[torch.Tensor, ...]]:
    """Per layer: every row's stored keys/values (left-aligned), validity, block ids and counts."""
    out = []
    for layer in cache.layers:
        keys, values, valid = layer.past()
        out.append((keys, values, valid, layer.block_ids[:, :, : int(layer.num_blocks.max())], layer.num_blocks))
    return out


@pytest.mark.core
def test_save_many_gives_the_ids_and_metadata_of_consecutive_saves():
    config = static_config()
    stores = [TieredBlockStore(config, get_ops("torch", CPU), HEAD_DIM, torch.float32, CPU) for _ in range(2)]
    groups = [torch.randn(n, 2, BLOCK, HEAD_DIM) for n in (4, 2, 6)]
    one_by_one = [stores[0].save(group) for group in groups]
    at_once = stores[1].save_many(groups)
    for a, b in zip(one_by_one, at_once):
        assert torch.equal(a, b)
    assert torch.equal(stores[0].metadata, stores[1].metadata)
    assert torch.equal(stores[0].read(torch.cat(one_by_one)), stores[1].read(torch.cat(at_once)))
    assert stores[0].read_stats().d2h_bytes == stores[1].read_stats().d2h_bytes == 12 * BLOCK_BYTES


@pytest.mark.core
def test_store_epoch_moves_exactly_when_a_pool_is_reallocated():
    fixed = TieredBlockStore(static_config(), get_ops("torch", CPU), HEAD_DIM, torch.float32, CPU)
    epoch = fixed.epoch
    ids = fixed.save(torch.randn(300, 2, BLOCK, HEAD_DIM))
    fixed.fetch(ids[:30].view(3, 1, 10))
    fixed.free(ids[:100])
    fixed.read_stats()
    assert fixed.epoch == epoch  # a fixed pool never moves
    growing = TieredBlockStore(SparseServeConfig(block_size=BLOCK), get_ops("torch", CPU), HEAD_DIM, torch.float32, CPU)
    epoch, storage = growing.epoch, growing.dram.storage
    growing.save(torch.randn(300, 2, BLOCK, HEAD_DIM))  # past the initial 256 blocks
    assert growing.dram.storage is not storage and growing.epoch != epoch
    epoch, pool = growing.epoch, growing.hbm.pool
    growing.fetch(torch.arange(300).view(1, 1, 300))  # the unlimited HBM cache grows its 256 slots
    assert growing.hbm.pool is not pool and growing.epoch != epoch


@pytest.mark.core
def test_rolling_before_the_step_stores_and_decodes_what_the_eager_step_does(llama):
    """roll_full_tails (all layers, one save) + an append-only step == the eager step's own roll."""
    config = static_config()
    eager, tokens = batch_cache(llama, config)
    split, _ = batch_cache(llama, config)
    positions = torch.tensor(LENGTHS).view(-1, 1)
    full = [row for row, length in enumerate(split.layers[0].tail_len.tolist()) if length == BLOCK]
    assert full == [0, 2]
    expected = eager_step(llama, eager, tokens, positions)
    split.roll_full_tails(full)
    with split.static_step():
        got = eager_step(llama, split, tokens, positions)
    assert torch.equal(got, expected)
    for mine, theirs in zip(stored(split), stored(eager)):
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b)
    assert split.store.dram.num_used == eager.store.dram.num_used
    assert [layer.tail_len.tolist() for layer in split.layers] == [[1, 7, 1]] * len(split.layers)


@pytest.mark.core
def test_table_width_is_set_once_and_kept_by_rolls(llama):
    cache, _ = batch_cache(llama, static_config())
    for layer in cache.layers:
        layer.set_table_width(12)
    tables = [layer.block_ids for layer in cache.layers]
    cache.roll_full_tails([0, 2], table_width=11)  # the caller's host count: no read-back, no regrowth
    assert all(layer.block_ids is table for layer, table in zip(cache.layers, tables))
    assert cache.layers[0].num_blocks.tolist() == [10, 9, 9] and cache.layers[0].block_ids.shape[2] == 12
    cache.layers[0].set_table_width(10)  # narrower: only unused (-1) columns go
    assert torch.equal(cache.layers[0].block_ids, tables[0][:, :, :10])
    assert bool((tables[0][:, :, 10:] == -1).all())
