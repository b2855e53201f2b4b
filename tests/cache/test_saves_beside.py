"""Saves beside compute (`TieredBlockStore.save(..., beside_compute=True)`): a side stream copies the
blocks to pinned DRAM while the current stream goes on, and every reader of the pool sees them."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf import SparseServeConfig
from sparseserve_hf.cache.store import TieredBlockStore
from sparseserve_hf.ops import get_ops

SIZE, DIM = 32, 128


def cpu_store() -> TieredBlockStore:
    cpu = torch.device("cpu")
    return TieredBlockStore(SparseServeConfig(block_size=SIZE), get_ops("torch", cpu), DIM, torch.float32, cpu)


def cuda_store() -> TieredBlockStore:
    cuda = torch.device("cuda")
    config = SparseServeConfig(block_size=SIZE, hbm_cache_bytes=64 << 20)
    return TieredBlockStore(config, get_ops("triton", cuda), DIM, torch.bfloat16, cuda)


def slow_blocks(count: int, seed: int) -> torch.Tensor:
    """(count, 2, S, D) bf16 blocks that come out of a long chain of matmuls on the current stream:
    a copy that started before the chain ended would read unwritten memory."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(4096, 4096, device="cuda", generator=generator)
    for _ in range(40):
        x = torch.tanh(x @ x.T / 64)
    flat = x.flatten()[: count * 2 * SIZE * DIM]
    return flat.view(count, 2, SIZE, DIM).to(torch.bfloat16)


def test_a_save_beside_compute_on_cpu_is_an_ordinary_save():
    store, blocks = cpu_store(), torch.randn(5, 2, SIZE, DIM)
    ids = store.save(blocks, beside_compute=True)
    assert torch.equal(store.read(ids), blocks)
    assert store._save_stream is None


@pytest.mark.gpu
def test_blocks_saved_beside_compute_are_what_a_read_right_after_returns():
    store = cuda_store()
    blocks = slow_blocks(2048, seed=0)  # 32 MiB: the copy runs long after the call returns
    ids = store.save(blocks, beside_compute=True)
    assert store._save_stream is not None
    got = store.read(ids)  # queued at once on the current stream: it must wait for the side stream
    torch.cuda.synchronize()
    assert torch.equal(got, blocks)


@pytest.mark.gpu
def test_a_lookup_after_a_save_beside_compute_loads_the_saved_blocks():
    store = cuda_store()
    blocks = slow_blocks(256, seed=1)
    ids = store.save(blocks, beside_compute=True)
    slots = store.fetch(ids[:64].view(1, 1, 64))  # misses load through FlashH2D from the pool
    torch.cuda.synchronize()
    assert torch.equal(store.hbm.pool[slots.flatten()], blocks[:64])


@pytest.mark.gpu
def test_ids_freed_while_their_save_beside_runs_take_the_next_save_on_top():
    """A save on the current stream of ids freed from a side-stream save still in flight lands after
    it: the pool holds the newer blocks."""
    store = cuda_store()
    first = slow_blocks(2048, seed=2)
    ids = store.save(first, beside_compute=True)
    store.free(ids)
    second = torch.full_like(first, 3.0)
    again = store.save(second)
    assert set(again.tolist()) == set(ids.tolist())  # the freed ids came back
    got = store.read(again)
    torch.cuda.synchronize()
    assert torch.equal(got, second)
