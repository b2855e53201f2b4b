"""BlockPool: every full KV head-block lives here: in host DRAM (pinned when CUDA is present), the
store's DRAM tier, or, with `offload=False` (the no-offload ablation), in device memory.
"""

from __future__ import annotations

import functools
import logging

import torch

from .. import host_memory
from ..host_memory import HOST_MEMORY_HEADROOM, check_host_bytes
from ..pinned import pinned_empty
from .grow import grown
from .plain import plain_tensors

logger = logging.getLogger(__name__)
INITIAL_BLOCKS = 256


class BlockPool:
    """A growable array of head-blocks with a free list (in host memory unless `device` says otherwise).

    A head-block is (2, S, D): the keys and values of `S` tokens of one KV head. Block ids
    are handed out lowest first, so the blocks a prefilled layer saves in one call are
    contiguous (one large copy per layer for the GPU save path). Blocks are reference counted,
    so rows that share a past (beam search, repeated rows) share its blocks.

    Args:
        block_shape: (2, S, D).
        dtype: storage dtype (the model's KV dtype).
        capacity_bytes: fixed size in bytes, or None to grow on demand.
        pin: allocate page-locked memory (needed for fast and asynchronous H2D/D2H).
        device: where the blocks live: "cpu" (host DRAM), or the model's device when nothing is
            offloaded. Bookkeeping (free list, reference counts) always stays on the host.
        numa_node: the NUMA node a pinned pool's pages come from (`numa.device_node` of the GPU
            that reads them; None = the host's choice).
    """

    @plain_tensors
    def __init__(
        self,
        block_shape: tuple[int, int, int],
        dtype: torch.dtype,
        capacity_bytes: int | None,
        pin: bool,
        device: torch.device | str = "cpu",
        numa_node: int | None = None,
    ) -> None:
        self.block_shape = block_shape
        self.dtype = dtype
        self.device = torch.device(device)
        if pin and self.device.type != "cpu":
            raise ValueError(f"pin=True pins host memory; a pool on {self.device} cannot be pinned")
        self.pin = pin
        self.numa_node = numa_node if pin else None
        self.block_bytes = block_shape[0] * block_shape[1] * block_shape[2] * dtype.itemsize
        self.fixed = capacity_bytes is not None
        self.capacity_bytes = capacity_bytes
        capacity = capacity_bytes // self.block_bytes if capacity_bytes is not None else INITIAL_BLOCKS
        self.storage = self._empty(capacity)  # (C, 2, S, D)
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # a stack: lowest id on top
        self.refcount = torch.zeros(capacity, dtype=torch.int32)

    @property
    def capacity(self) -> int:
        """Head-blocks the pool holds now (a growable pool may hold more later)."""
        return self.storage.shape[0]

    @property
    def num_used(self) -> int:
        """Block ids allocated and not yet freed."""
        return self.capacity - len(self._free)

    @plain_tensors
    def allocate(self, count: int) -> torch.Tensor | None:
        """`count` free block ids (ascending), or None when a fixed-size pool cannot hold them."""
        if count > len(self._free):
            if self.fixed:
                return None
            self._grow(self.num_used + count)
        ids = torch.tensor(self._free[len(self._free) - count :][::-1], dtype=torch.long)
        self.refcount.index_fill_(0, ids, 1)
        del self._free[len(self._free) - count :]  # last: nothing above can leave ids taken but unreferenced
        return ids

    @plain_tensors
    def retain(self, ids: torch.Tensor) -> None:
        """Add one reference per occurrence of each id (a row now shares these blocks)."""
        self.refcount.index_add_(0, ids.flatten().cpu(), torch.ones(ids.numel(), dtype=torch.int32))

    def releasing(self, ids: torch.Tensor) -> torch.Tensor:
        """The ids that `free(ids)` would release (their last references), changing nothing."""
        ids = ids.flatten().cpu()
        if ids.numel() == 0:
            return ids
        unique, counts = ids.unique(return_counts=True)
        return unique[self.refcount[unique] == counts.to(self.refcount.dtype)]

    @plain_tensors
    def free(self, ids: torch.Tensor) -> torch.Tensor:
        """Drop one reference per occurrence; returns the ids that reached zero and are free again."""
        ids = ids.flatten().cpu()
        if ids.numel() == 0:
            return ids
        self.refcount.index_add_(0, ids, torch.full((ids.numel(),), -1, dtype=torch.int32))
        released = ids.unique()
        released = released[self.refcount[released] == 0]
        if released.numel():  # beam search reorders every step, mostly releasing nothing
            self._free.extend(released.tolist())
            self._free.sort(reverse=True)
        return released

    def reserve(self, count: int) -> bool:
        """Make room for `count` more blocks in one growth (a growable pool); True when it grew.

        A prompt's blocks arrive layer by layer: grown block by block, the pool would double
        (pin, copy) several times during one prefill."""
        if not self.must_grow_for(count):
            return False
        self._grow(self.num_used + count)
        return True

    def must_grow_for(self, count: int) -> bool:
        """True when `count` more blocks do not fit and the pool can grow (it is not fixed)."""
        return not self.fixed and self.capacity - self.num_used < count

    def _grow(self, needed: int) -> None:
        """Reallocate at twice the size (or `needed`; less than twice where the host's available
        memory would not hold that, but never less than `needed`) and copy every block over.

        Deliberately simple, and costly for a pinned pool: pinning costs about half a second
        per GiB, the old and new pools are both pinned during the copy, and torch's pinned-memory
        caching allocator keeps the old one cached afterwards. Growing in place would need either a
        chunked pool, which the FlashH2D/UVA kernels cannot address (they take one base pointer and
        index blocks from it; a chunk table would add a lookup per block and a second pointer to
        every launch and to the CUDA graph's static inputs), or a reserved virtual range pinned piece
        by piece (cudaHostRegister over mmap), which has to be proven on the GPU machine for UVA
        reads first. So the fixed-size pool is the fast path: set `dram_bytes` (eval.common's
        `sized_dram_pool` does) and the pool is pinned once; growth is for convenience and CPU runs.
        """
        old = self.capacity
        new = max(2 * old, needed)
        if self.device.type == "cpu":  # a host pool: short of doubling rather than past the host's memory
            available = host_memory.available_host_bytes()
            if available is not None:
                new = max(needed, min(new, int(available * (1 - HOST_MEMORY_HEADROOM)) // self.block_bytes))
        storage = self._empty(new)
        storage[:old] = self.storage
        refcount = grown(self.refcount, new)
        # Nothing is replaced before everything is allocated: a failed growth leaves the pool as it was.
        self.storage, self.refcount = storage, refcount
        # New ids go below the stack top so the lowest free ids are still handed out first.
        self._free[:0] = range(new - 1, old - 1, -1)

    def _empty(self, capacity: int) -> torch.Tensor:
        if self.device.type == "cpu":
            nbytes = capacity * self.block_bytes
            if self.fixed:
                check_host_bytes(nbytes, f"dram_bytes={self.capacity_bytes}", "lower dram_bytes")
            else:
                check_host_bytes(nbytes, "the growing DRAM pool (dram_bytes=None)", "shorten the context")
        shape = (capacity, *self.block_shape)
        if self.pin:  # exactly its size: PyTorch's pinned allocator would round it up to a power of two
            try:
                return pinned_empty(shape, self.dtype, numa_node=self.numa_node)
            except (RuntimeError, AttributeError, TypeError) as exc:  # a runtime that cannot register host memory
                _warn_pinning_fallback(f"{type(exc).__name__}: {exc}")
                return torch.empty(shape, dtype=self.dtype, pin_memory=True)
        return torch.empty(shape, dtype=self.dtype, device=self.device)


@functools.cache
def _warn_pinning_fallback(reason: str) -> None:
    logger.warning("pinning host memory in place failed (%s); using PyTorch's pinned allocator", reason)
