"""Decode attention reading misses through from DRAM while the lookup runs beside it
(`TieredBlockStore.fetching`): same attention, the misses loaded for later steps, bounded loads."""

from __future__ import annotations

import pytest
import torch

from kernel_support import ON_GPU
from sparseserve_hf import SparseServeConfig
from sparseserve_hf.cache.store import LOADS_PER_ROW, TieredBlockStore
from sparseserve_hf.ops import get_ops, reference

SIZE, DIM = 4, 8


def store_with_blocks(count: int, device: torch.device, backend: str = "torch", dtype=torch.float32, **config):
    """A store with an HBM cache of 64 slots in one partition and `count` saved random blocks."""
    hbm_bytes = None if config.get("offload") is False else 64 * 2 * SIZE * DIM * dtype.itemsize
    cfg = SparseServeConfig(block_size=SIZE, hbm_cache_bytes=hbm_bytes, **config)
    store = TieredBlockStore(cfg, get_ops(backend, device), DIM, dtype, device)
    blocks = torch.randn(count, 2, SIZE, DIM, device=device).to(dtype)
    return store, store.save(blocks), blocks


def attend(store: TieredBlockStore, ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, D) attention of random queries over the blocks `ids` (B, 1, U) through `fetching`."""
    gen = torch.Generator().manual_seed(0)
    batch = ids.shape[0]
    query = torch.randn(batch, 2, DIM, generator=gen).to(store.device, store.dtype)
    tail = torch.randn(batch, 1, 2, SIZE, DIM, generator=gen).to(store.device, store.dtype)
    tail_len = torch.full((batch,), 2, device=store.device)
    with store.fetching(ids) as slots:
        through = {"dram": store.dram.storage, "block_ids": ids} if store.reads_through else {}
        return store.ops.sparse_decode(
            query, store.hbm.pool, slots, None, tail[:, :, 0], tail[:, :, 1], tail_len, 0.3, **through
        )


def expected_attention(ids: torch.Tensor, blocks: torch.Tensor, saved: torch.Tensor, device) -> torch.Tensor:
    """The same attention with every block resident (the spec): the pool is the blocks themselves."""
    position = {int(i): n for n, i in enumerate(saved.tolist())}
    local = torch.tensor([[[position.get(int(i), -1) for i in row[0]]] for row in ids.cpu()])
    gen = torch.Generator().manual_seed(0)
    batch = ids.shape[0]
    query = torch.randn(batch, 2, DIM, generator=gen).to(blocks.dtype)
    tail = torch.randn(batch, 1, 2, SIZE, DIM, generator=gen).to(blocks.dtype)
    tail_len = torch.full((batch,), 2)
    return reference.sparse_decode(query, blocks.cpu(), local, None, tail[:, :, 0], tail[:, :, 1], tail_len, 0.3)


@pytest.mark.core
def test_misses_are_attended_from_dram_then_resident():
    store, saved, blocks = store_with_blocks(12, torch.device("cpu"))
    assert store.reads_through
    ids = saved[:6].view(2, 1, 3)
    before = store.hbm.resident_slots(ids, store.dram)
    assert (before == -1).all()  # nothing resident yet: attention reads all six from DRAM
    torch.testing.assert_close(attend(store, ids), expected_attention(ids, blocks, saved, "cpu"))
    after = store.hbm.resident_slots(ids, store.dram)
    assert (after >= 0).all() and torch.equal(store.hbm.pool[after.view(-1)], blocks[:6])  # loaded for later
    torch.testing.assert_close(attend(store, ids), expected_attention(ids, blocks, saved, "cpu"))  # all hits now
    stats = store.stats
    assert (stats.misses, stats.blocks_loaded, stats.hits) == (6, 6, 6)
    assert stats.h2d_bytes == (6 + 6) * store.block_bytes  # each miss crossed once to attention, once to HBM


@pytest.mark.core
def test_one_lookup_loads_at_most_a_few_misses_per_row():
    store, saved, blocks = store_with_blocks(40, torch.device("cpu"))
    ids = saved[: 2 * 15].view(2, 1, 15)  # 30 misses, 2 rows: at most 2 * LOADS_PER_ROW load
    torch.testing.assert_close(attend(store, ids), expected_attention(ids, blocks, saved, "cpu"))
    resident = store.hbm.resident_slots(ids, store.dram)
    assert int((resident >= 0).sum()) == 2 * LOADS_PER_ROW
    first = ids.transpose(0, 1).reshape(-1)[: 2 * LOADS_PER_ROW]  # the first misses in row order load
    assert (store.hbm.resident_slots(first.view(1, 1, -1), store.dram) >= 0).all()
    torch.testing.assert_close(attend(store, ids), expected_attention(ids, blocks, saved, "cpu"))
    stats = store.stats
    assert stats.blocks_loaded == 4 * LOADS_PER_ROW and stats.misses == 30 + 30 - 2 * LOADS_PER_ROW


@pytest.mark.core
@pytest.mark.parametrize("config", [{"transfer": "copy"}, {"offload": False}], ids=["copy_transfers", "no_offload"])
def test_ablations_load_before_attention(config):
    """Slow transfers (the ablation) and a pool on the device never read through: every used entry has its slot."""
    store, saved, blocks = store_with_blocks(12, torch.device("cpu"), **config)
    assert not store.reads_through
    ids = saved[:6].view(2, 1, 3)
    with store.fetching(ids) as slots:
        assert (slots >= 0).all()
    torch.testing.assert_close(attend(store, ids), expected_attention(ids, blocks, saved, "cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_triton_reads_through_pinned_dram_with_the_lookup_on_a_side_stream():
    cuda = torch.device("cuda")
    store, saved, blocks = store_with_blocks(40, cuda, backend="triton", dtype=torch.bfloat16)
    assert store.reads_through and store.dram.storage.is_pinned()
    ids = saved[:24].view(2, 1, 12)
    for _ in range(3):  # misses, then hits and the loads the limit held back
        got = attend(store, ids)
        want = expected_attention(ids, blocks, saved, cuda).float()
        torch.testing.assert_close(got.cpu().float(), want, atol=2e-2, rtol=2e-2)
    torch.cuda.synchronize()
    assert store.stats.blocks_loaded == 24
