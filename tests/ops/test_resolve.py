"""The block-cache lookup kernels (claim, then install) against `ops.lru.resolve_` (the tensor spec), on random selections."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_support import DEVICE
from sparseserve_hf.ops import lru, reference, triton_resolve, triton_transfer
from sparseserve_hf.ops.reference import LOAD_COUNTERS


def random_selection(
    gen: torch.Generator, shape: tuple[int, int, int], num_blocks: int, heads_total: int, first_head: int
) -> torch.Tensor:
    """(B, H, U) ids: head h draws from its own id range (a block belongs to one partition), from a
    hot set and the whole range, with -1 padding and duplicates across rows."""
    heads = shape[1]
    per_head = num_blocks // heads_total
    hot = torch.randint(0, per_head, (max(2, per_head // 4),), generator=gen)
    local = torch.where(
        torch.rand(shape, generator=gen) < 0.6,
        hot[torch.randint(0, hot.numel(), shape, generator=gen)],
        torch.randint(0, per_head, shape, generator=gen),
    )
    ids = local + (first_head + torch.arange(heads))[None, :, None] * per_head
    return torch.where(torch.rand(shape, generator=gen) < 0.2, -1, ids)


def copy_tables(tables: lru.LruTables, device: torch.device) -> lru.LruTables:
    return lru.LruTables(*(getattr(tables, f.name).clone().to(device) for f in dataclasses.fields(tables)))


def assert_tables_equal(got: lru.LruTables, want: lru.LruTables) -> None:
    """Equal everywhere but in the dump entries (whose content is meaningless)."""
    for field in dataclasses.fields(want):
        a, b = getattr(got, field.name).cpu(), getattr(want, field.name)
        if field.name in ("block_slot", "slot_block", "slot_tick"):
            a, b = a[:-1], b[:-1]
        assert torch.equal(a, b), field.name


@pytest.mark.parametrize("max_tile", [4096, 16], ids=["one_tile", "tiled"])  # both at the same sizes
@pytest.mark.parametrize("free_ahead", [0, 6])
@pytest.mark.parametrize("batch,heads,width,partitions,per", [(3, 2, 5, 4, 24), (1, 3, 37, 3, 40), (4, 1, 9, 2, 64)])
@pytest.mark.parametrize("entries_per_program", [256, 16], ids=["entries_together", "entries_spread"])
def test_kernel_matches_the_tensor_spec_step_by_step(
    batch, heads, width, partitions, per, free_ahead, max_tile, entries_per_program, monkeypatch
):
    """Spread: a partition's hits, claims and slots come from several programs (duplicates across them)."""
    monkeypatch.setattr(triton_resolve, "ENTRIES_PER_PROGRAM", entries_per_program)
    gen = torch.Generator().manual_seed(batch * 100 + width)
    num_blocks = 40 * partitions
    want = lru.empty_tables(partitions, per, num_blocks, torch.device("cpu"))
    got = copy_tables(want, DEVICE)
    want_counts, got_counts = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long, device=DEVICE)
    for step in range(25):
        first = int(torch.randint(0, partitions - heads + 1, (1,), generator=gen))
        ids = random_selection(gen, (batch, heads, width), num_blocks, partitions, first)
        slots, load_ids, load_slots, load_counts = lru.resolve_(ids, first, want, want_counts, free_ahead)
        k_slots, k_ids, k_slots_loaded, k_counts = triton_resolve.resolve_(
            ids.to(DEVICE), first, got, got_counts, free_ahead, max_tile=max_tile
        )
        assert torch.equal(k_slots.cpu(), slots), step
        assert torch.equal(k_ids.cpu(), load_ids) and torch.equal(k_slots_loaded.cpu(), load_slots), step
        assert torch.equal(k_counts.cpu(), load_counts), step
        assert_tables_equal(got, want)
        assert torch.equal(got_counts.cpu(), want_counts)
        if step % 6 == 5:  # freed blocks: both sides forget them the same way (the tensor op)
            gone = torch.randint(-1, num_blocks, (7,), generator=gen)
            lru.forget_(gone, want)
            lru.forget_(gone.to(DEVICE), got)
            assert_tables_equal(got, want)


@pytest.mark.parametrize("free_ahead", [0, 8, 40])
def test_claims_list_the_early_loads_in_free_slots_and_install_lists_the_rest(free_ahead):
    """Split at the claims: the early loads (their slots written before `install_` runs) are the
    first of the spec's load lists and sit in free slots; the late lists hold the rest, from 0."""
    heads, per, batch, width = 2, 64, 3, 12
    num_blocks = heads * 150
    want = lru.empty_tables(heads, per, num_blocks, torch.device("cpu"))
    got = copy_tables(want, DEVICE)
    want_counts, got_counts = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long, device=DEVICE)
    gen = torch.Generator().manual_seed(free_ahead)
    early_total = late_total = 0
    for step in range(12):
        ids = random_selection(gen, (batch, heads, width), num_blocks, heads, 0)
        _, load_ids, load_slots, load_counts = lru.resolve_(ids, 0, want, want_counts, free_ahead)
        free_before = got.slot_tick.cpu()[:-1] < 0
        claims = triton_resolve.claim_(ids.to(DEVICE), 0, got, got_counts)
        early_slots = claims.load_slots.cpu()
        installed = triton_resolve.install_(ids.to(DEVICE), 0, got, claims, free_ahead)
        assert_tables_equal(got, want)
        for head in range(heads):
            early, misses = int(claims.early_counts[head]), int(load_counts[head])
            late = int(installed.late_counts[head])
            assert early + late == misses == int(claims.load_counts[head]), step
            assert torch.equal(early_slots[head, :early], load_slots[head, :early])
            assert bool(free_before[load_slots[head, :early]].all())
            assert torch.equal(installed.late_ids[head, :late].cpu(), load_ids[head, early:misses])
            assert torch.equal(installed.late_slots[head, :late].cpu(), load_slots[head, early:misses])
            early_total, late_total = early_total + early, late_total + late
    assert early_total > 0
    # a lookup has at most batch * width misses per head: when that many slots are kept free, none is late
    assert (late_total == 0) == (free_ahead >= batch * width)


@pytest.mark.parametrize("max_tile", [4096, 16], ids=["one_tile", "tiled"])
@pytest.mark.parametrize("free_ahead", [0, 6])
def test_install_without_its_reorder_returns_the_same_and_reorder_finishes_the_tables(free_ahead, max_tile):
    """`install_(..., reorder=False)` returns the whole install's slots and late loads, leaving the
    eviction order to `reorder_`, after which the tables are the spec's, lookup after lookup."""
    heads, partitions, per, batch, width = 2, 3, 40, 3, 7
    num_blocks = 40 * partitions
    want = lru.empty_tables(partitions, per, num_blocks, torch.device("cpu"))
    got = copy_tables(want, DEVICE)
    want_counts, got_counts = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long, device=DEVICE)
    gen = torch.Generator().manual_seed(free_ahead + max_tile)
    for step in range(16):
        first = int(torch.randint(0, partitions - heads + 1, (1,), generator=gen))
        ids = random_selection(gen, (batch, heads, width), num_blocks, partitions, first)
        slots, load_ids, load_slots, load_counts = lru.resolve_(ids, first, want, want_counts, free_ahead)
        order_before_lookup = got.slot_order.cpu().clone()
        claims = triton_resolve.claim_(ids.to(DEVICE), first, got, got_counts)
        installed = triton_resolve.install_(
            ids.to(DEVICE), first, got, claims, free_ahead, reorder=False, max_tile=max_tile
        )
        assert torch.equal(got.slot_order.cpu(), order_before_lookup), step  # the order is reorder_'s to keep
        assert torch.equal(installed.slots.cpu(), slots), step
        for head in range(heads):
            early, misses = int(claims.early_counts[head]), int(load_counts[head])
            late = int(installed.late_counts[head])
            assert early + late == misses, step
            assert torch.equal(installed.late_ids[head, :late].cpu(), load_ids[head, early:misses]), step
            assert torch.equal(installed.late_slots[head, :late].cpu(), load_slots[head, early:misses]), step
        untouched = [p for p in range(partitions) if not first <= p < first + heads]
        order_before = got.slot_order.view(partitions, per).cpu()[untouched].clone()
        triton_resolve.reorder_(first, heads, got, free_ahead, max_tile=max_tile)
        assert_tables_equal(got, want)
        assert torch.equal(got.slot_order.view(partitions, per).cpu()[untouched], order_before), step


@pytest.mark.parametrize("max_tile", [4096, 32], ids=["one_tile", "tiled"])
def test_a_lookup_that_fills_a_partition_over_several_steps(max_tile):
    """A decode step's shape in small: every slot of the partitions used, evictions every step."""
    heads, per, batch, width = 2, 64, 4, 16  # 64 entries per head: exactly one partition
    num_blocks = heads * 200
    want = lru.empty_tables(heads, per, num_blocks, torch.device("cpu"))
    got = copy_tables(want, DEVICE)
    want_counts, got_counts = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long, device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    for step in range(8):
        ids = random_selection(gen, (batch, heads, width), num_blocks, heads, 0)
        want_out = lru.resolve_(ids, 0, want, want_counts)
        got_out = triton_resolve.resolve_(ids.to(DEVICE), 0, got, got_counts, max_tile=max_tile)
        for a, b in zip(got_out, want_out):
            assert torch.equal(a.cpu(), b), step
        assert_tables_equal(got, want)
    assert torch.equal(got_counts.cpu(), want_counts) and int(want_counts[1]) > per  # it evicted


def test_kernel_with_strided_wide_selection_and_full_partition():
    """Every slot of a partition in use by one lookup (E == Pp) and more entries than one tile."""
    batch, heads, width, per = 2, 2, 2100, 4200
    tables = lru.empty_tables(heads, per, 2 * 5000, torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(5000, generator=gen)[: batch * width] + h * 5000 for h in range(heads)], 1)
    ids = ids.view(batch, width, heads).transpose(1, 2)  # (B, H, U), not contiguous
    got = copy_tables(tables, DEVICE)
    counts, got_counts = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long, device=DEVICE)
    want = lru.resolve_(ids, 0, tables, counts)
    out = triton_resolve.resolve_(ids.to(DEVICE), 0, got, got_counts)
    for a, b in zip(out, want):
        assert torch.equal(a.cpu(), b)
    assert_tables_equal(got, tables)
    assert counts.tolist() == [2 * batch * width, 2 * batch * width]


@pytest.mark.parametrize("max_tile", [4096, 8192], ids=["tiled", "one_wide_tile"])
def test_repeated_lookups_over_a_partition_wider_than_one_tile(max_tile):
    """Evictions and the eviction order's rewrite over a partition of more slots than one 4096-wide
    tile: the victims' scan and the order's compaction then run in several chunks (or in one
    8192-wide tile), over tables that earlier lookups filled."""
    heads, per, batch, width, step_count = 2, 4300, 3, 700, 6  # full from step 3 on: evictions
    num_blocks = heads * 9000
    want = lru.empty_tables(heads, per, num_blocks, torch.device("cpu"))
    got = copy_tables(want, DEVICE)
    want_counts, got_counts = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long, device=DEVICE)
    gen = torch.Generator().manual_seed(11)
    for step in range(step_count):
        ids = random_selection(gen, (batch, heads, width), num_blocks, heads, 0)
        want_out = lru.resolve_(ids, 0, want, want_counts)
        got_out = triton_resolve.resolve_(ids.to(DEVICE), 0, got, got_counts, max_tile=max_tile)
        for a, b in zip(got_out, want_out):
            assert torch.equal(a.cpu(), b), step
        assert_tables_equal(got, want)
    assert (want.slot_block[:-1] >= 0).view(heads, per).all()  # every slot of both partitions in use


def test_picked_blocks_kernel_matches_the_spec_and_what_a_lookup_then_resolves():
    """Before each lookup: the kernel's ids and resident slots of a pick, and the reads it counts on
    every other step, equal the spec's, and every resident slot is the one the lookup itself then
    gives that entry (it never moves a block it hits)."""
    gen = torch.Generator().manual_seed(7)
    batch, heads, width, partitions, per, num_blocks = 3, 2, 6, 2, 24, 80
    tables = lru.empty_tables(partitions, per, num_blocks, torch.device("cpu"))
    counts = torch.zeros(2, dtype=torch.long)
    per_head = num_blocks // heads
    table = torch.stack([torch.randperm(per_head, generator=gen)[:20] + h * per_head for h in range(heads)])
    table = table[None].repeat(batch, 1, 2)[..., 4:36]  # (B, H, 32), strided rows: as a table view may be
    num_blocks, tail_len = torch.tensor([9, 0, 30]), torch.tensor([5, 0, 0])  # row 1 holds nothing: not live
    want_totals = torch.zeros((heads + 1, LOAD_COUNTERS), dtype=torch.long)
    got_totals = want_totals.to(DEVICE, copy=True)
    for step in range(12):
        picked = torch.randint(0, table.shape[2], (batch, heads, width), generator=gen)
        valid = torch.rand(picked.shape, generator=gen) < 0.8
        count = reference.LoadCount(want_totals[1:], num_blocks, tail_len, 32) if step % 2 else None
        ids, resident = lru.picked_blocks(table, picked, valid, tables, count)
        assert torch.equal(ids, torch.where(valid, torch.gather(table, 2, picked), -1))
        on_device = (
            None
            if count is None
            else reference.LoadCount(got_totals[1:], num_blocks.to(DEVICE), tail_len.to(DEVICE), 32)
        )
        got_ids, got_resident = triton_resolve.picked_blocks(
            table.to(DEVICE), picked.to(DEVICE), valid.to(DEVICE), copy_tables(tables, DEVICE), on_device
        )
        assert torch.equal(got_ids.cpu(), ids) and torch.equal(got_resident.cpu(), resident), step
        assert torch.equal(got_totals.cpu(), want_totals), step
        slots, *_ = lru.resolve_(ids, 0, tables, counts)
        assert bool(((resident == slots) | (resident == -1)).all()), step
        assert step == 0 or bool((resident >= 0).any())  # later steps hit what earlier ones loaded


@pytest.mark.parametrize("reorder_beside", [False, True], ids=["install_reorders", "reorder_beside"])
@pytest.mark.parametrize("per", [64, 24])  # free ahead: 8 slots, then 3 (an eighth of the partition)
def test_a_split_lookup_loads_every_block_and_decides_as_the_spec(per, reorder_beside, monkeypatch):
    """`HbmBlockCache` with the claim and install kernels (the early copy beside the install on
    CUDA, in turn here) and, with `REORDER_BESIDE`, the eviction order's launch beside the late
    copy (joined by `settle`, whichever way the lookup was asked to settle): every entry's slot
    holds its block, and the tables are the spec's with the cache's `free_ahead`, lookup after
    lookup, with blocks forgotten in between."""
    from sparseserve_hf.cache import block_cache
    from sparseserve_hf.cache.block_cache import HbmBlockCache
    from sparseserve_hf.cache.block_pool import BlockPool

    monkeypatch.setattr(block_cache, "REORDER_BESIDE", reorder_beside)

    heads, per_head, shape = 2, 60, (2, 4, 8)
    dram = BlockPool(shape, torch.float32, None, pin=False, device=DEVICE)
    ids = dram.allocate(heads * per_head)
    blocks = torch.randn(heads * per_head, *shape, device=DEVICE)
    dram.storage[ids] = blocks
    cache = HbmBlockCache(
        heads * per, shape, torch.float32, DEVICE, triton_transfer.gather_blocks, heads,
        triton_resolve.resolve_, triton_resolve.claim_, triton_resolve.install_, triton_resolve.reorder_,
    )  # fmt: skip
    assert (cache.reorder is not None) == reorder_beside
    cache.track_blocks(dram.capacity)
    assert cache.free_ahead == per // 8
    want = copy_tables(cache.tables, torch.device("cpu"))
    counts = torch.zeros(2, dtype=torch.long)
    gen = torch.Generator().manual_seed(per)
    for step in range(10):
        selection = random_selection(gen, (3, heads, 6), heads * per_head, heads, 0)
        want_slots, *_ = lru.resolve_(selection, 0, want, counts, cache.free_ahead)
        slots = cache.lookup(selection.to(DEVICE), dram, 0, settle=step % 2 == 0).cpu()
        cache.settle()
        used = selection >= 0
        assert torch.equal(slots, want_slots), step
        assert torch.equal(cache.pool[slots[used].to(DEVICE)], blocks[selection[used].to(DEVICE)]), step
        assert_tables_equal(cache.tables, want)
        if step % 4 == 3:
            gone = selection[0, 0, :2]
            cache.invalidate(gone.to(DEVICE))
            lru.forget_(gone, want)
    assert cache.counts() == tuple(counts.tolist()) and counts[1] > 0


@pytest.mark.parametrize("reorder_beside", [False, True], ids=["install_reorders", "reorder_beside"])
def test_a_split_lookup_whose_late_copy_fails_forgets_its_misses(reorder_beside, monkeypatch):
    """The late copy raises: the blocks the lookup claimed are forgotten (no slot claims a block it
    never received), and the same lookup again loads and serves every block."""
    from sparseserve_hf.cache import block_cache
    from sparseserve_hf.cache.block_cache import HbmBlockCache
    from sparseserve_hf.cache.block_pool import BlockPool

    monkeypatch.setattr(block_cache, "REORDER_BESIDE", reorder_beside)
    shape, per = (2, 4, 8), 24
    dram = BlockPool(shape, torch.float32, None, pin=False, device=DEVICE)
    ids = dram.allocate(2 * 40)
    blocks = torch.randn(ids.numel(), *shape, device=DEVICE)
    dram.storage[ids] = blocks
    copies = []

    def copy_then_fail(*args):
        copies.append(args)
        if len(copies) == 2:  # the late loads' copy
            raise RuntimeError("copy failed")
        triton_transfer.gather_blocks(*args)

    cache = HbmBlockCache(
        2 * per, shape, torch.float32, DEVICE, copy_then_fail, 2,
        triton_resolve.resolve_, triton_resolve.claim_, triton_resolve.install_, triton_resolve.reorder_,
    )  # fmt: skip
    cache.track_blocks(dram.capacity)
    selection = random_selection(torch.Generator().manual_seed(3), (3, 2, 6), 80, 2, 0).to(DEVICE)
    with pytest.raises(RuntimeError, match="copy failed"):
        cache.lookup(selection, dram, 0)
    used = selection[selection >= 0]
    assert bool((cache.tables.block_slot[used] == -1).all())  # nothing claims what never arrived
    slots = cache.lookup(selection, dram, 0)
    cache.settle()
    assert torch.equal(cache.pool[slots[selection >= 0]], blocks[used])
