"""Page-locked host tensors of exactly the size asked for, zero-filled.

`torch.empty(..., pin_memory=True)` goes through PyTorch's caching host allocator, which rounds every
allocation up to a power of two and keeps freed blocks for reuse: a 34 GB DRAM pool (two 128K-token
rows of an 8B model) pins 64 GiB of host memory and takes twice as long to pin. Here ordinary host
memory is allocated and page-locked in place (`cudaHostRegister`), and unlocked just before it is
freed, when the last tensor viewing it is gone. The GPU reads it as any pinned memory: copies run
asynchronously and kernels address it directly (UVA).
"""

from __future__ import annotations

import math
import mmap
import weakref
from typing import Protocol

import numpy as np
import torch

from .numa import bind_to_node

PAGE_BYTES = 4096


class Registrar(Protocol):
    """Page-locks and unlocks host address ranges (the CUDA runtime; a stand-in in CPU tests)."""

    def register(self, address: int, nbytes: int) -> None:
        """Page-lock `nbytes` at `address`, or raise."""
        ...

    def unregister(self, address: int) -> None:
        """Unlock the range registered at `address`."""
        ...


class CudaRegistrar:
    """`cudaHostRegister` / `cudaHostUnregister` through PyTorch's CUDA runtime bindings."""

    def register(self, address: int, nbytes: int) -> None:
        """Page-lock `nbytes` at `address`; raises RuntimeError naming the CUDA error."""
        status = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
        code = int(getattr(status, "value", status))  # a cudaError enum: 0 is cudaSuccess
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {code}")

    def unregister(self, address: int) -> None:
        """Unlock the range registered at `address` (errors ignored: it runs as memory is freed)."""
        torch.cuda.cudart().cudaHostUnregister(address)


def pinned_empty(
    shape: tuple[int, ...], dtype: torch.dtype, registrar: Registrar | None = None, numa_node: int | None = None
) -> torch.Tensor:
    """A zero-filled, page-locked host tensor of `shape` and `dtype`, holding exactly its bytes
    (rounded up to a page). `registrar`: None = the CUDA runtime. `numa_node`: the NUMA node its
    pages should come from (`numa.device_node` of the GPU that reads them), None = the host's choice.

    The pages are faulted in by zero-filling them on PyTorch's intra-op threads before the range is
    locked, so that the locking call does not fault them one by one on one thread. The memory
    belongs to a numpy array that the tensor keeps alive; the array's finalizer unlocks the range
    before numpy frees it, so the lock lives exactly as long as some view of the memory.
    """
    registrar = registrar if registrar is not None else CudaRegistrar()
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    locked = max(-(-nbytes // PAGE_BYTES) * PAGE_BYTES, PAGE_BYTES)
    owner = _host_pages(locked, numa_node)
    address = owner.ctypes.data
    torch.from_numpy(owner).zero_()  # every page faulted in, in parallel
    registrar.register(address, locked)
    weakref.finalize(owner, registrar.unregister, address)
    return torch.from_numpy(owner)[:nbytes].view(dtype).view(shape)


def _host_pages(nbytes: int, numa_node: int | None) -> np.ndarray:
    """`nbytes` (a page multiple) of untouched host memory starting on a page, as a uint8 array that
    owns it. With a node, the pages are a mapping of their own, preferring the node from their
    first touch on: a policy set on a range of the malloc heap would outlive this memory and pass
    to whatever the heap later puts there."""
    if numa_node is None:
        raw = np.empty(nbytes + PAGE_BYTES, dtype=np.uint8)  # one spare page to start on a page boundary
        start = -raw.ctypes.data % PAGE_BYTES
        return raw[start : start + nbytes]  # a view: `raw` stays alive through it
    pages = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)  # unmapped with its last view
    bind_to_node(pages.ctypes.data, nbytes, numa_node)
    return pages
