"""The HBM block cache's tensor LRU (`ops.lru`) against its plain-Python reference, on random inputs."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf.cache.block_cache import HbmBlockCache
from sparseserve_hf.cache.block_pool import BlockPool
from sparseserve_hf.ops import lru

SHAPE = (2, 4, 8)  # (K/V, S, D)


def random_selection(gen: torch.Generator, shape: tuple[int, int, int], per_head: int, first_head: int) -> torch.Tensor:
    """(B, H, U) ids, head h's from its own range: hot blocks, the whole range, -1 padding, duplicates."""
    hot = torch.randint(0, per_head, (max(2, per_head // 4),), generator=gen)
    local = torch.where(
        torch.rand(shape, generator=gen) < 0.6,
        hot[torch.randint(0, hot.numel(), shape, generator=gen)],
        torch.randint(0, per_head, shape, generator=gen),
    )
    ids = local + (first_head + torch.arange(shape[1]))[None, :, None] * per_head
    return torch.where(torch.rand(shape, generator=gen) < 0.2, -1, ids)


def assert_same_state(tables: lru.LruTables, refs: list[lru.ReferenceLru]) -> None:
    resident = {b: s for b, s in enumerate(tables.block_slot[:-1].tolist()) if s >= 0}
    assert resident == {b: s for ref in refs for b, s in ref.block_slot.items()}
    for part, ref in enumerate(refs):
        assert [tables.slot_block[s].item() for s in ref.slots] == [ref.slot_block[s] for s in ref.slots]
        assert [tables.slot_tick[s].item() for s in ref.slots] == [ref.slot_tick[s] for s in ref.slots]
        assert int(tables.clock[part]) == ref.clock
        assert tables.slot_order[part].tolist() == ref.eviction_order()  # kept sorted without a sort


@pytest.mark.core
@pytest.mark.parametrize("seed", range(6))
def test_resolve_matches_reference_partition_by_partition(seed):
    gen = torch.Generator().manual_seed(seed)
    partitions, per, per_head, shape = 4, 12, 20, (2, 2, 5)  # 10 entries per head: every lookup fits
    tables = lru.empty_tables(partitions, per, partitions * per_head, torch.device("cpu"))
    refs = [lru.ReferenceLru(range(p * per, (p + 1) * per)) for p in range(partitions)]
    counts = torch.zeros(2, dtype=torch.long)
    want_counts = [0, 0]
    for step in range(40):
        first = int(torch.randint(0, partitions - 1, (1,), generator=gen))
        ids = random_selection(gen, shape, per_head, first)
        slots, load_ids, load_slots, load_counts = lru.resolve_(ids, first, tables, counts)
        for head in range(shape[1]):
            row = ids[:, head].flatten().tolist()
            want_slots, loads, distinct = refs[first + head].lookup(row)
            assert slots[:, head].flatten().tolist() == want_slots, step
            n = len(loads)
            assert list(zip(load_ids[head, :n].tolist(), load_slots[head, :n].tolist())) == loads
            assert (load_ids[head, n:] == -1).all() and (load_slots[head, n:] == -1).all()
            assert int(load_counts[head]) == n
            want_counts[0] += distinct
            want_counts[1] += n
        assert counts.tolist() == want_counts
        assert_same_state(tables, refs)
        if step % 7 == 6:  # blocks freed in between: their ids will be reused
            gone = torch.randint(-1, partitions * per_head, (6,), generator=gen)
            lru.forget_(gone, tables)
            for ref in refs:
                ref.forget([i for i in gone.tolist() if i >= 0])
            assert_same_state(tables, refs)


@pytest.mark.core
def test_first_copies_mark_the_first_entry_of_each_id_in_row_order():
    first = lru.first_copies(torch.tensor([[5, -1, 3, 5, 3, -1, 0], [2, 2, 2, -1, 1, 1, 0]]))
    assert first.int().tolist() == [[1, 0, 1, 0, 0, 0, 1], [1, 0, 0, 0, 1, 0, 1]]


@pytest.mark.core
def test_misses_take_free_slots_then_least_recently_used_in_first_appearance_order():
    tables = lru.empty_tables(1, 3, 10, torch.device("cpu"))
    counts = torch.zeros(2, dtype=torch.long)
    lru.resolve_(torch.tensor([[[4, 1, 7]]]), 0, tables, counts)  # free slots 0, 1, 2 in order
    assert tables.slot_block[:3].tolist() == [4, 1, 7]
    lru.resolve_(torch.tensor([[[1]]]), 0, tables, counts)  # touch 1: 4 then 7 are the oldest
    slots, load_ids, load_slots, _ = lru.resolve_(torch.tensor([[[9, 1, 8]]]), 0, tables, counts)
    assert load_ids[0].tolist() == [9, 8, -1] and load_slots[0].tolist() == [0, 2, -1]
    assert slots.tolist() == [[[0, 1, 2]]] and counts.tolist() == [3 + 1 + 3, 3 + 0 + 2]


@pytest.mark.core
def test_hbm_cache_loads_the_right_blocks_and_counts_on_the_device():
    heads, per_head = 2, 15
    pool = BlockPool(SHAPE, torch.float32, None, pin=False)
    ids = pool.allocate(heads * per_head)
    blocks = torch.randn(heads * per_head, *SHAPE)
    pool.storage[ids] = blocks
    cache = HbmBlockCache(2 * 12, SHAPE, torch.float32, torch.device("cpu"), partitions=2)
    cache.track_blocks(pool.capacity)
    gen = torch.Generator().manual_seed(3)
    selected = 0
    for _ in range(20):
        want = random_selection(gen, (3, heads, 4), per_head, 0)
        slots = cache.lookup(want, pool, 0)
        used = want >= 0
        assert torch.equal(cache.pool[slots[used]], blocks[want[used]])  # every entry sees its block
        assert torch.equal(slots >= 0, used)
        assert (slots[:, 1][used[:, 1]] >= 12).all()  # head 1's blocks live in partition 1
        selected += want[used].unique().numel()
    looked_up, misses = cache.counts()
    assert looked_up == selected and 0 < misses < selected
    assert cache.counts() == (0, 0)  # read and zeroed


@pytest.mark.core
@pytest.mark.parametrize("built_under_inference_mode", [False, True])
def test_counts_reset_the_same_counter_tensor(built_under_inference_mode):
    """A captured decode step keeps adding into the counter tensor it saw: reading must zero it in place."""
    pool = BlockPool(SHAPE, torch.float32, None, pin=False)
    ids = pool.allocate(4)
    with torch.inference_mode(built_under_inference_mode):
        cache = HbmBlockCache(8, SHAPE, torch.float32, torch.device("cpu"))
        cache.track_blocks(pool.capacity)
        cache.lookup(ids.view(2, 1, 2), pool, 0)
    counter = cache._counts
    assert cache.counts() == (4, 4)
    assert cache._counts is counter and counter.tolist() == [0, 0]
    with torch.inference_mode(built_under_inference_mode):
        cache.lookup(ids.view(2, 1, 2), pool, 0)  # all hits now
    assert cache.counts() == (4, 0) and cache._counts is counter


@pytest.mark.gpu
def test_resolve_on_cuda_matches_reference():
    gen = torch.Generator().manual_seed(7)
    partitions, per, per_head, shape = 3, 200, 300, (4, 2, 24)  # 96 entries per head
    tables = lru.empty_tables(partitions, per, partitions * per_head, torch.device("cuda"))
    refs = [lru.ReferenceLru(range(p * per, (p + 1) * per)) for p in range(partitions)]
    counts = torch.zeros(2, dtype=torch.long, device="cuda")
    for step in range(40):
        first = step % 2
        ids = random_selection(gen, shape, per_head, first)
        slots, *_ = lru.resolve_(ids.cuda(), first, tables, counts)
        for head in range(shape[1]):
            want, _, _ = refs[first + head].lookup(ids[:, head].flatten().tolist())
            assert slots[:, head].flatten().tolist() == want, step
        assert_same_state(lru.LruTables(*(t.cpu() for t in vars(tables).values())), refs)


@pytest.mark.core
@pytest.mark.parametrize("free_ahead", [1, 4, 12])
def test_resolve_keeps_slots_free_ahead_as_the_reference_does(free_ahead):
    """With `free_ahead` R every lookup leaves R slots of its partitions free (the least recently
    used it did not touch), so the next lookup's first R misses land in the order's first slots."""
    gen = torch.Generator().manual_seed(free_ahead)
    partitions, per, per_head, shape = 3, 12, 24, (2, 2, 4)
    tables = lru.empty_tables(partitions, per, partitions * per_head, torch.device("cpu"))
    refs = [lru.ReferenceLru(range(p * per, (p + 1) * per), free_ahead) for p in range(partitions)]
    counts = torch.zeros(2, dtype=torch.long)
    for step in range(30):
        first = int(torch.randint(0, partitions - 1, (1,), generator=gen))
        ids = random_selection(gen, shape, per_head, first)
        front = tables.slot_order[first : first + 2].clone()
        slots, load_ids, load_slots, _ = lru.resolve_(ids, first, tables, counts, free_ahead)
        for head in range(shape[1]):
            want_slots, loads, _ = refs[first + head].lookup(ids[:, head].flatten().tolist())
            assert slots[:, head].flatten().tolist() == want_slots, step
            n = len(loads)
            assert list(zip(load_ids[head, :n].tolist(), load_slots[head, :n].tolist())) == loads
            early = min(n, free_ahead) if step else n  # the first lookup starts from an empty partition
            assert load_slots[head, :early].tolist() == front[head, :early].tolist()
        assert_same_state(tables, refs)
        ticks = tables.slot_tick[tables.slot_order[first : first + 2]]
        assert bool((ticks[:, : min(free_ahead, per - 8)] == -1).all())  # <= 8 slots used per lookup
