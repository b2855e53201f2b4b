"""DRAM pool and HBM block cache bookkeeping: exact ids, LRU order, bit-exact round trips."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf.cache.block_cache import HbmBlockCache
from sparseserve_hf.cache.block_pool import BlockPool

SHAPE = (2, 4, 8)  # (K/V, S, D)
BLOCK_BYTES = 2 * 4 * 8 * 4


def filled_pool(count: int) -> tuple[BlockPool, torch.Tensor, torch.Tensor]:
    pool = BlockPool(SHAPE, torch.float32, None, pin=False)
    ids = pool.allocate(count)
    blocks = torch.randn(count, *SHAPE)
    pool.storage[ids] = blocks
    return pool, ids, blocks


@pytest.mark.core
def test_dram_ids_are_ascending_and_reused_lowest_first():
    pool = BlockPool(SHAPE, torch.float32, 6 * BLOCK_BYTES, pin=False)
    assert pool.allocate(3).tolist() == [0, 1, 2]
    assert pool.allocate(2).tolist() == [3, 4]
    pool.free(torch.tensor([1, 0]))
    assert pool.allocate(3).tolist() == [0, 1, 5]
    assert pool.allocate(1) is None  # a fixed pool says no instead of raising
    assert pool.num_used == 6


@pytest.mark.core
def test_dram_grows_and_keeps_data_bit_exact():
    pool, ids, blocks = filled_pool(200)
    more = pool.allocate(300)  # past the initial capacity
    assert more.tolist() == list(range(200, 500))
    assert torch.equal(pool.storage[ids], blocks)
    bf16 = BlockPool(SHAPE, torch.bfloat16, None, pin=False)
    data = torch.randn(5, *SHAPE).to(torch.bfloat16)
    bf16.storage[bf16.allocate(5)] = data
    assert torch.equal(bf16.storage[:5], data)


def lookup(cache: HbmBlockCache, pool: BlockPool, ids: list[int]) -> tuple[torch.Tensor, int]:
    """Slots of one row's ids (one KV head) and the misses of that lookup."""
    slots = cache.lookup(torch.tensor(ids).view(1, 1, -1), pool).view(-1)
    return slots, cache.counts()[1]


@pytest.mark.core
def test_hbm_cache_hits_misses_and_lru_victims():
    pool, _, blocks = filled_pool(10)
    cache = HbmBlockCache(3, SHAPE, torch.float32, torch.device("cpu"))
    cache.track_blocks(pool.capacity)
    slots, misses = lookup(cache, pool, [0, 1, 2])
    assert misses == 3 and torch.equal(cache.pool[slots], blocks[[0, 1, 2]])
    _, misses = lookup(cache, pool, [1])  # touch 1: now 0 is least recently used, then 2
    assert misses == 0
    slots, misses = lookup(cache, pool, [5, 6])
    assert misses == 2
    assert sorted(cache.slot_block.tolist()) == [1, 5, 6]
    assert torch.equal(cache.pool[slots], blocks[[5, 6]])
    assert cache.block_slot[[0, 2]].tolist() == [-1, -1]


@pytest.mark.core
def test_hbm_cache_never_evicts_what_this_lookup_uses():
    pool, _, _ = filled_pool(10)
    cache = HbmBlockCache(2, SHAPE, torch.float32, torch.device("cpu"))
    cache.track_blocks(pool.capacity)
    with pytest.raises(ValueError, match="hbm_cache_bytes"):
        lookup(cache, pool, [0, 1, 2])


@pytest.mark.core
def test_partitions_keep_each_heads_blocks_apart():
    """Head 1's lookups never evict head 0's blocks: each (layer, KV head) has its own LRU."""
    pool, _, blocks = filled_pool(20)
    cache = HbmBlockCache(8, SHAPE, torch.float32, torch.device("cpu"), partitions=4)  # 2 slots each
    cache.track_blocks(pool.capacity)
    cache.lookup(torch.tensor([[[0, 1], [10, 11]]]), pool, 2)  # heads 0, 1 -> partitions 2, 3
    cache.lookup(torch.tensor([[[-1, -1], [12, 13]]]), pool, 2)
    assert cache.counts() == (6, 6)
    slots = cache.lookup(torch.tensor([[[1, 0], [13, -1]]]), pool, 2)
    assert cache.counts() == (3, 0)  # 0 and 1 survived head 1's misses
    assert torch.equal(cache.pool[slots[0, 0]], blocks[[1, 0]]) and slots[0, 0].min() >= 4
    with pytest.raises(ValueError, match="partitions 3..4"):
        cache.lookup(torch.tensor([[[0], [1]]]), pool, 3)


def test_unlimited_hbm_cache_grows_instead_of_evicting():
    pool, ids, blocks = filled_pool(300)
    cache = HbmBlockCache(None, SHAPE, torch.float32, torch.device("cpu"), partitions=7)  # one partition
    cache.track_blocks(pool.capacity)
    slots, misses = lookup(cache, pool, ids.tolist())
    assert misses == 300 and cache.num_resident == 300
    assert torch.equal(cache.pool[slots], blocks)
    _, misses = lookup(cache, pool, ids[:10].tolist())
    assert misses == 0


def test_invalidate_frees_slots_of_freed_blocks():
    pool, _, _ = filled_pool(4)
    cache = HbmBlockCache(4, SHAPE, torch.float32, torch.device("cpu"))
    cache.track_blocks(pool.capacity)
    lookup(cache, pool, [0, 1])
    cache.invalidate(torch.tensor([0]))
    assert cache.num_resident == 1 and cache.block_slot[0] == -1


@pytest.mark.core
def test_dram_blocks_are_reference_counted():
    pool = BlockPool(SHAPE, torch.float32, None, pin=False)
    ids = pool.allocate(3)
    pool.retain(torch.tensor([1, 1, 2]))
    assert pool.free(ids).tolist() == [0]  # 1 and 2 are still referenced
    assert pool.free(torch.tensor([1, 2])).tolist() == [2]
    assert pool.free(torch.tensor([1])).tolist() == [1]
    assert pool.num_used == 0 and pool.allocate(1).tolist() == [0]


def test_a_growing_host_pool_grows_short_of_doubling_where_the_host_has_less(monkeypatch):
    """A full pool of C blocks would double to 2C; the host holds C + 100: it grows to that, and a
    growth the host cannot hold at all is still refused by name."""
    from sparseserve_hf import host_memory

    pool = BlockPool(SHAPE, torch.float32, None, pin=False)
    full = pool.capacity
    pool.allocate(full)
    usable = lambda blocks: int(blocks * pool.block_bytes / (1 - host_memory.HOST_MEMORY_HEADROOM)) + 1
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: usable(full + 100))
    assert pool.allocate(1) is not None and pool.capacity == full + 100
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: usable(10))
    with pytest.raises(ValueError, match="growing DRAM pool"):
        pool.allocate(200)
    assert pool.capacity == full + 100  # nothing changed


@pytest.mark.parametrize("offload", [True, False])
def test_both_device_tiers_are_device_blocks(offload):
    """The store reads blocks through `DeviceBlocks` with and without offload, and both tiers
    have every member it names (attributes and methods)."""
    from sparseserve_hf.cache.device_blocks import DeviceBlocks
    from sparseserve_hf.cache.store import TieredBlockStore
    from sparseserve_hf.config import SparseServeConfig
    from sparseserve_hf.ops import TORCH_OPS

    config = SparseServeConfig(block_size=4, offload=offload, hbm_cache_bytes=1 << 16 if offload else None)
    store = TieredBlockStore(config, TORCH_OPS, 8, torch.float32, torch.device("cpu"), hbm_partitions=2)
    assert isinstance(store.hbm, DeviceBlocks)
    members = [name for name in vars(DeviceBlocks) if not name.startswith("_")] + ["unlimited", "reallocations"]
    assert all(hasattr(store.hbm, name) for name in members)
