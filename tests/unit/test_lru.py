"""The host-sync-free LRU bookkeeping (`cache.lru`) against its plain-Python reference, on random inputs."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf.cache import lru
from sparseserve_hf.cache.block_cache import HbmBlockCache
from sparseserve_hf.cache.dram_pool import DramPool

SHAPE = (2, 4, 8)  # (K/V, S, D)


def tables(num_slots: int, num_blocks: int) -> dict[str, torch.Tensor]:
    """Empty tables with their dump entries, as HbmBlockCache keeps them."""
    return dict(
        block_slot=torch.full((num_blocks + 1,), -1),
        slot_block=torch.full((num_slots + 1,), -1),
        slot_tick=torch.full((num_slots + 1,), -1),
        slot_order=torch.arange(num_slots),
        clock=torch.zeros(1, dtype=torch.long),
        slot_index=torch.arange(num_slots),
    )


def random_selection(gen: torch.Generator, shape: tuple[int, ...], num_blocks: int) -> torch.Tensor:
    """Ids drawn from a small hot set plus the whole range, with -1 padding and duplicates."""
    hot = torch.randint(0, num_blocks, (max(2, num_blocks // 4),), generator=gen)
    pick_hot = torch.rand(shape, generator=gen) < 0.6
    ids = torch.where(pick_hot, hot[torch.randint(0, hot.numel(), shape, generator=gen)], -1)
    ids = torch.where(pick_hot, ids, torch.randint(0, num_blocks, shape, generator=gen))
    return torch.where(torch.rand(shape, generator=gen) < 0.2, -1, ids)


def assert_same_state(t: dict[str, torch.Tensor], ref: lru.ReferenceLru) -> None:
    num_slots = t["slot_index"].numel()
    assert t["slot_block"][:num_slots].tolist() == ref.slot_block
    assert t["slot_tick"][:num_slots].tolist() == ref.slot_tick
    block_slot = t["block_slot"][:-1].tolist()
    assert {b: s for b, s in enumerate(block_slot) if s >= 0} == ref.block_slot
    assert int(t["clock"]) == ref.clock
    # the kept eviction order is the sorted one, so victims are the reference's (last use, slot) order
    assert torch.equal(t["slot_order"], lru.eviction_order(t["slot_tick"][:num_slots]))


@pytest.mark.core
@pytest.mark.parametrize("seed", range(6))
def test_lookup_matches_reference_on_random_selections(seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, num_slots, shape = 40, 24, (2, 3, 4)  # 24 entries: every lookup fits
    t, ref = tables(num_slots, num_blocks), lru.ReferenceLru(num_slots)
    for step in range(30):
        ids = random_selection(gen, shape, num_blocks)
        out = lru.lookup_(ids, **t)
        slots, num_unique, num_misses = ref.lookup(ids.flatten().tolist())
        assert out.slots.shape == ids.shape and out.slots.flatten().tolist() == slots, step
        assert (int(out.num_unique), int(out.num_misses)) == (num_unique, num_misses)
        loads = out.load_ids >= 0
        assert int(loads.sum()) == num_misses and torch.equal(loads, out.load_slots >= 0)
        assert_same_state(t, ref)
        if step % 7 == 6:  # blocks freed in between: their ids will be reused
            gone = torch.randint(-1, num_blocks, (5,), generator=gen)
            lru.invalidate_(
                gone, *(t[k] for k in ("block_slot", "slot_block", "slot_tick", "slot_order", "slot_index"))
            )
            ref.invalidate([i for i in gone.tolist() if i >= 0])
            assert_same_state(t, ref)


@pytest.mark.core
def test_dedupe_marks_first_copies_only():
    ids, first = lru.dedupe(torch.tensor([5, -1, 3, 5, 3, -1, 0]))
    assert ids.tolist() == [-1, -1, 0, 3, 3, 5, 5]
    assert first.tolist() == [False, False, True, True, False, True, False]


@pytest.mark.core
def test_victims_are_free_slots_then_least_recently_used_never_current():
    tick = torch.tensor([4, -1, 2, 7, 2, -1])
    order = lru.eviction_order(tick)
    assert order.tolist() == [1, 5, 2, 4, 0, 3]
    victims = lru.lru_victims(order, tick, torch.tensor([7]), 5)
    assert victims.tolist() == [1, 5, 2, 4, 0]  # slot 3 was used by this lookup (tick 7)
    assert lru.lru_victims(order, tick, torch.tensor([7]), 2).tolist() == [1, 5]


@pytest.mark.core
@pytest.mark.parametrize("to_front", [False, True])
def test_moving_slots_keeps_the_others_in_order_and_the_moved_by_slot(to_front):
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        order = torch.randperm(9, generator=gen)
        moved = torch.rand(9, generator=gen) < 0.4
        kept = [s for s in order.tolist() if not moved[s]]
        expected = (
            (torch.nonzero(moved).flatten().tolist() + kept)
            if to_front
            else kept + torch.nonzero(moved).flatten().tolist()
        )
        lru.move_slots_(order, moved, torch.arange(9), to_front)
        assert order.tolist() == expected


@pytest.mark.core
def test_hbm_cache_loads_the_right_blocks_and_counts_on_the_device():
    pool = DramPool(SHAPE, torch.float32, None, pin=False)
    ids = pool.allocate(30)
    blocks = torch.randn(30, *SHAPE)
    pool.write(ids, blocks)
    cache = HbmBlockCache(12, SHAPE, torch.float32, torch.device("cpu"))
    cache.track_blocks(pool.capacity)
    gen = torch.Generator().manual_seed(3)
    selected = misses = 0
    for _ in range(20):
        want = random_selection(gen, (3, 4), 30)
        slots, missed = cache.lookup(want, pool)
        used = want >= 0
        assert torch.equal(cache.pool[slots[used]], blocks[want[used]])  # every entry sees its block
        assert torch.equal(slots >= 0, used)
        selected += want[used].unique().numel()
        misses += int(missed)
    assert cache.counts() == (selected, misses)
    assert cache.counts() == (0, 0)  # read and zeroed


@pytest.mark.core
@pytest.mark.parametrize("built_under_inference_mode", [False, True])
def test_counts_reset_the_same_counter_tensor(built_under_inference_mode):
    """A captured decode step keeps adding into the counter tensor it saw: reading must zero it in place."""
    pool = DramPool(SHAPE, torch.float32, None, pin=False)
    ids = pool.allocate(4)
    with torch.inference_mode(built_under_inference_mode):
        cache = HbmBlockCache(8, SHAPE, torch.float32, torch.device("cpu"))
        cache.track_blocks(pool.capacity)
        cache.lookup(ids.view(2, 2), pool)
    counter = cache._counts
    assert cache.counts() == (4, 4)
    assert cache._counts is counter and counter.tolist() == [0, 0]
    with torch.inference_mode(built_under_inference_mode):
        cache.lookup(ids.view(2, 2), pool)  # all hits now
    assert cache.counts() == (4, 0) and cache._counts is counter


@pytest.mark.gpu
def test_lookup_on_cuda_matches_reference():
    gen = torch.Generator().manual_seed(7)
    num_blocks, num_slots, shape = 300, 200, (4, 2, 24)  # 192 entries
    t = {k: v.cuda() for k, v in tables(num_slots, num_blocks).items()}
    ref = lru.ReferenceLru(num_slots)
    for step in range(40):
        ids = random_selection(gen, shape, num_blocks)
        out = lru.lookup_(ids.cuda(), **t)
        slots, _, num_misses = ref.lookup(ids.flatten().tolist())
        assert out.slots.flatten().tolist() == slots and int(out.num_misses) == num_misses, step
        assert_same_state({k: v.cpu() for k, v in t.items()}, ref)
