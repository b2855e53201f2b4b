"""FlashD2HSaver (D2H staging copy + CPU-thread scatter) and the store's transfer paths."""

from __future__ import annotations

import pytest
import torch

from kernel_support import DEVICE, ON_GPU
from sparseserve_hf import SparseServeConfig
from sparseserve_hf.cache.store import TieredBlockStore
from sparseserve_hf.ops import get_ops, reference
from sparseserve_hf.ops.flash_d2h import FlashD2HSaver

SHAPE = (2, 8, 16)


@pytest.fixture
def saver():
    saver = FlashD2HSaver(DEVICE, num_threads=2)
    yield saver
    saver.close()


def host_pool(num: int) -> torch.Tensor:
    pool = torch.full((num, *SHAPE), float("nan"))
    return pool.pin_memory() if ON_GPU else pool


@pytest.mark.parametrize("num", [1, 5, 40])  # 40 > one job's minimum: several scatter threads
def test_saver_matches_reference_scatter(saver, num):
    blocks = torch.randn((num, *SHAPE), device=DEVICE)
    ids = torch.randperm(64)[:num]
    ids[0] = -1  # skipped
    expected, got = host_pool(64), host_pool(64)
    reference.scatter_blocks(blocks, expected, ids)
    saver.save(blocks, got, ids)
    saver.wait()
    assert torch.equal(got.nan_to_num(-7), expected.nan_to_num(-7))
    assert saver.num_pending == 0


def test_many_saves_in_flight_reuse_staging_buffers_safely(saver):
    pool = host_pool(200)
    expected = host_pool(200)
    for step in range(12):  # more saves than staging buffers, each with new contents
        blocks = torch.full((16, *SHAPE), float(step), device=DEVICE)
        ids = torch.arange(step * 16, step * 16 + 16) % 200
        saver.save(blocks, pool, ids)
        reference.scatter_blocks(blocks, expected, ids)
    saver.wait()
    assert torch.equal(pool.nan_to_num(-7), expected.nan_to_num(-7))


def test_a_failed_scatter_is_reported_by_wait(saver):
    saver.save(torch.zeros((2, *SHAPE), device=DEVICE), host_pool(4), torch.tensor([1, 9]))  # 9 is out of range
    with pytest.raises(IndexError):
        saver.wait()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("save_path", ["scatter", "flash_d2h"])
def test_store_saves_reads_and_fetches_through_the_backend(backend, save_path):
    config = SparseServeConfig(
        block_size=SHAPE[1], token_budget=64, hbm_cache_bytes=6 * 2 * 8 * 16 * 4, save_path=save_path
    )
    ops = get_ops(backend, DEVICE)
    store = TieredBlockStore(config, ops, SHAPE[2], torch.float32, DEVICE)
    blocks = torch.randn((300, *SHAPE), device=DEVICE)  # > the pool's initial 256 blocks: it grows mid-run
    ids = torch.cat([store.save(blocks[i : i + 50]) for i in range(0, 300, 50)])
    assert torch.equal(store.read(ids), blocks)
    chosen = ids[torch.tensor([[3, 250, -1], [7, 3, 299]])]
    chosen[0, 2] = -1
    slots = store.fetch(chosen.view(2, 1, 3)).view(2, 3)
    assert slots[0, 2] == -1 and slots[0, 0] == slots[1, 1]
    used = chosen >= 0
    assert torch.equal(store.hbm.pool[slots[used]], blocks[torch.tensor([3, 250, 7, 3, 299], device=DEVICE)])
    if store.saver is not None:
        store.saver.close()
