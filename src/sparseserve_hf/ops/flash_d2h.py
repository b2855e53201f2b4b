"""FlashD2H: the CPU-assisted save path of SparseServe (section 4.1).

New full blocks leave the GPU as ONE contiguous device-to-host copy into a pinned staging
buffer, issued on a side stream so it overlaps compute; a small pool of CPU threads then
scatters the staged blocks into their DRAM pool rows with `index_copy_`. The GPU spends no SMs
on the scatter (a UVA scatter kernel does), which is what the paper's Fig. 14b measures.

Every save returns a handle; readers of the DRAM pool call `wait()` first so nothing reads a
block before it is saved. Pure PyTorch plus threads: on CPU the copy is synchronous and the
scatter still runs on the thread pool, so the logic is tested without a GPU.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..host_memory import check_host_bytes

MIN_BLOCKS_PER_JOB = 16  # below ~256 KiB a thread hand-off costs more than the copy it saves
NUM_STAGING_BUFFERS = 2  # double buffering: save k+1 stages while save k is still scattering


class FlashD2HSaver:
    """Saves (n, 2, S, D) device blocks into rows of a host pool without GPU-side scattering.

    Args:
        device: the device the blocks come from (CUDA: side stream + event; CPU: plain copies).
        num_threads: CPU threads scattering staged blocks into the pool.

    Example:
        >>> saver = FlashD2HSaver(torch.device("cpu"))
        >>> pool = torch.zeros(8, 2, 4, 16)
        >>> saver.save(torch.ones(2, 2, 4, 16), pool, torch.tensor([5, 1]))
        >>> saver.wait(); bool(pool[5].eq(1).all())
        True
    """

    def __init__(self, device: torch.device, num_threads: int = 4) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.num_threads = num_threads
        self.executor = ThreadPoolExecutor(num_threads, thread_name_prefix="flash_d2h")
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._staging: list[torch.Tensor | None] = [None] * NUM_STAGING_BUFFERS
        self._staging_jobs: list[list[Future]] = [[] for _ in range(NUM_STAGING_BUFFERS)]
        self._next = 0
        self._pending: list[Future] = []

    def save(self, blocks: torch.Tensor, pool: torch.Tensor, ids: torch.Tensor) -> list[Future]:
        """Start saving `blocks[i] -> pool[ids[i]]`; returns the scatter jobs' futures.

        Args:
            blocks: (n, 2, S, D) on `device`.
            pool: (C, 2, S, D) host pool (pinned for an asynchronous copy), same dtype.
            ids: (n,) host long ids; -1 entries are skipped.
        """
        ids = ids.reshape(-1).cpu()
        keep = ids >= 0
        if not bool(keep.all()):
            blocks, ids = blocks[keep.to(blocks.device)], ids[keep]
        if ids.numel() == 0:
            return []
        index = self._next
        self._next = (index + 1) % NUM_STAGING_BUFFERS
        staged, ready = self._stage(index, blocks)
        jobs = [
            self.executor.submit(_scatter, pool, ids[rows], staged[rows], ready)
            for rows in _chunks(ids.numel(), self.num_threads)
        ]
        self._staging_jobs[index] = jobs
        self._pending.extend(jobs)
        return jobs

    def wait(self) -> None:
        """Block until every save started so far is in the pool (re-raises a failed job's error)."""
        pending, self._pending = self._pending, []
        for job in pending:
            job.result()

    @property
    def num_pending(self) -> int:
        """Scatter jobs not yet finished."""
        self._pending = [job for job in self._pending if not job.done()]
        return len(self._pending)

    def close(self) -> None:
        """Finish pending saves and stop the threads."""
        self.wait()
        self.executor.shutdown(wait=True)

    def _stage(self, index: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """One contiguous D2H copy into staging buffer `index`; returns it and its ready event."""
        for job in self._staging_jobs[index]:  # the buffer's previous contents must be scattered first
            job.result()
        num = blocks.shape[0]
        buffer = self._staging[index]
        if (
            buffer is None
            or buffer.shape[0] < num
            or buffer.shape[1:] != blocks.shape[1:]
            or buffer.dtype != blocks.dtype
        ):
            capacity = max(num, 2 * buffer.shape[0]) if buffer is not None else num
            nbytes = capacity * blocks[0].numel() * blocks.element_size()
            check_host_bytes(nbytes, "the FlashD2H staging buffer (save_path='flash_d2h')", "use save_path='scatter'")
            buffer = torch.empty((capacity, *blocks.shape[1:]), dtype=blocks.dtype, pin_memory=self.cuda)
            self._staging[index] = buffer
        staged = buffer[:num]
        if not self.cuda:
            staged.copy_(blocks)
            return staged, None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # blocks are written on the main stream
        with torch.cuda.stream(self.stream):
            staged.copy_(blocks, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        blocks.record_stream(self.stream)  # keep the allocator from reusing them before the copy ran
        return staged, ready


def _chunks(num: int, num_threads: int) -> list[slice]:
    per_job = max(MIN_BLOCKS_PER_JOB, -(-num // num_threads))
    return [slice(start, min(start + per_job, num)) for start in range(0, num, per_job)]


def _scatter(pool: torch.Tensor, ids: torch.Tensor, staged: torch.Tensor, ready: torch.cuda.Event | None) -> None:
    if ready is not None:
        ready.synchronize()  # the D2H copy into staging has landed
    # As bytes: the same copy for every dtype (CPU `index_copy_` has no 8-bit float kernel).
    pool.view(torch.uint8).index_copy_(0, ids, staged.view(torch.uint8))
