"""pinned_empty on CPU, with a stand-in for cudaHostRegister: exact sizes, and a lock that lives
exactly as long as some view of the memory (tests/test_cuda.py pins for real)."""

from __future__ import annotations

import gc

import pytest
import torch

from sparseserve_hf import pinned
from sparseserve_hf.cache.block_pool import BlockPool
from sparseserve_hf.pinned import PAGE_BYTES, pinned_empty


class Registrar:
    """Records what is locked; refuses when `fail` is set (as the CUDA runtime may)."""

    def __init__(self, fail: bool = False) -> None:
        self.locked: dict[int, int] = {}
        self.fail = fail

    def register(self, address: int, nbytes: int) -> None:
        if self.fail:
            raise RuntimeError("cudaHostRegister of 1 bytes failed with CUDA error 2")
        assert address not in self.locked
        self.locked[address] = nbytes

    def unregister(self, address: int) -> None:
        del self.locked[address]


@pytest.mark.core
def test_the_tensor_locks_its_own_pages_until_its_last_view_is_gone():
    registrar = Registrar()
    tensor = pinned_empty((3, 2, 32, 64), torch.bfloat16, registrar)
    assert tensor.shape == (3, 2, 32, 64) and tensor.dtype == torch.bfloat16 and not tensor.is_cuda
    assert list(registrar.locked.items()) == [(tensor.data_ptr(), 3 * 2 * 32 * 64 * 2)]  # a page multiple here
    assert tensor.data_ptr() % PAGE_BYTES == 0 and not tensor.any()  # zero-filled (its pages faulted in)
    tensor.copy_(torch.arange(tensor.numel()).view(tensor.shape))
    view = tensor[1:]
    del tensor
    gc.disable()  # no collection is needed: the lock goes with the last view
    try:
        assert registrar.locked and view[0, 0, 0, 0] == 2 * 32 * 64
        del view
        assert registrar.locked == {}
    finally:
        gc.enable()


def test_sizes_are_exact_up_to_a_page_not_a_power_of_two():
    registrar = Registrar()
    tensor = pinned_empty((1000, 3), torch.float32, registrar)  # 12,000 bytes: 3 pages, not 16 KiB
    assert list(registrar.locked.values()) == [3 * PAGE_BYTES] and tensor.numel() == 3000
    tiny = pinned_empty((1,), torch.float16, registrar)
    assert registrar.locked[tiny.data_ptr()] == PAGE_BYTES


def test_a_refused_registration_raises_and_locks_nothing():
    registrar = Registrar(fail=True)
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        pinned_empty((64,), torch.float32, registrar)
    assert registrar.locked == {}


def test_a_pinned_dram_pool_locks_exactly_its_blocks_and_unlocks_what_growth_replaced(monkeypatch):
    registrar = Registrar()
    monkeypatch.setattr(pinned, "CudaRegistrar", lambda: registrar)
    shape = (2, 16, 8)
    pool = BlockPool(shape, torch.float32, None, pin=True)  # growable: 256 blocks to start
    block_bytes = 2 * 16 * 8 * 4
    assert list(registrar.locked.values()) == [256 * block_bytes]
    ids = pool.allocate(300)  # grows: the new storage is locked, the old one let go
    assert ids is not None and list(registrar.locked.values()) == [pool.capacity * block_bytes]
    assert pool.storage.data_ptr() in registrar.locked
    del pool
    assert registrar.locked == {}


def test_a_pool_falls_back_to_pytorchs_pinned_allocator_when_registering_fails(monkeypatch, caplog):
    monkeypatch.setattr(pinned, "CudaRegistrar", lambda: Registrar(fail=True))
    pinned_by_torch = []
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        pinned_by_torch.append(pin_memory)
        return real_empty(*args, **kwargs)  # CPU-only torch cannot pin: record the request instead

    monkeypatch.setattr(torch, "empty", empty)
    pool = BlockPool((2, 16, 8), torch.float32, 1 << 16, pin=True)
    assert pool.capacity == (1 << 16) // (2 * 16 * 8 * 4) and pinned_by_torch[-1] is True
