"""FlashH2D gather and UVA scatter of head-blocks: one Triton program per block.

A pinned host tensor can be handed to a Triton kernel as a plain pointer: the GPU reads and
writes host memory through unified virtual addressing (UVA), so one launch moves every
scattered 16 KiB block of a layer without a `cudaMemcpy` per block (SparseServe's FlashH2D:
a per-block copy loop reaches a few GB/s, this kernel close to bulk PCIe bandwidth).

Blocks are copied as opaque words (int32 where the block size allows), which makes the kernel
dtype-agnostic and lets the compiler emit 16-byte vector accesses: the pools' base pointers are
16-byte aligned and a block's word count is a compile-time constant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TILE_WORDS = 4096  # 16 KiB of int32 per tile: a whole Llama-class head-block in flight per program
# Grid of a save: a handful of programs already keeps PCIe busy writing pinned memory, and leaves the
# SMs to the compute running beside the save (one program per block would fill every SM).
SAVE_PROGRAMS = 8
# Programs of a gather over counted lists (a lookup's misses, one list per KV head): enough
# blocks in flight to keep PCIe busy when every entry misses, few enough that launching them is
# cheap when almost every entry hits (one program per entry would launch B x U per KV head).
COUNTED_PROGRAMS = 1024


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    src_ids_ptr,
    dst_ptr,
    dst_ids_ptr,
    count_ptr,
    num,
    WORDS: tl.constexpr,
    TILE: tl.constexpr,
    HAS_SRC_IDS: tl.constexpr,
    HAS_COUNT: tl.constexpr,
):
    """Entry i of list l goes src[src_ids[l, i]] (or src[i]) -> dst[dst_ids[l, i]]; -1 ids skip.

    Grid (programs per list, lists). Program p of list l copies its entries p, p + grid, ...:
    one block each with a full grid, or a strided share with a capped grid (a save that leaves
    most SMs to the compute beside it, or a lookup's load lists, whose live prefix `count[l]`
    only the device knows: the loop stops there, so the rest of a list costs nothing).
    """
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    lst = tl.program_id(1).to(tl.int64)
    src_ids_ptr += lst * num
    dst_ids_ptr += lst * num
    end = num
    if HAS_COUNT:
        end = tl.load(count_ptr + lst).to(tl.int32)
    for i in range(pid, end, step):
        if HAS_SRC_IDS:
            src = tl.load(src_ids_ptr + i).to(tl.int64)
        else:
            src = tl.cast(i, tl.int64)
        dst = tl.load(dst_ids_ptr + i).to(tl.int64)
        live = (src >= 0) & (dst >= 0)
        # A dead block copies nothing: its word limit is 0 (a scalar bound, not a broadcast bool).
        limit = live.to(tl.int32) * WORDS
        src_base = src_ptr + src * WORDS  # int64 offsets: DRAM pools exceed 2**31 words
        dst_base = dst_ptr + dst * WORDS
        for start in tl.static_range(0, WORDS, TILE):
            offsets = start + tl.arange(0, TILE)
            mask = offsets < limit
            tl.store(dst_base + offsets, tl.load(src_base + offsets, mask=mask), mask=mask)


def _as_words(pool: torch.Tensor) -> torch.Tensor:
    """A contiguous pool viewed as a flat array of the widest word dividing one block."""
    assert pool.is_contiguous(), "block pools must be contiguous"
    block_bytes = pool[0].numel() * pool.element_size()
    offset_bytes = pool.storage_offset() * pool.element_size()
    for word in (torch.int32, torch.int16):
        divides = block_bytes % word.itemsize == 0 and offset_bytes % word.itemsize == 0
        if divides and word.itemsize >= pool.element_size():
            return pool.reshape(-1).view(word)
    return pool.reshape(-1).view(torch.uint8)


def _launch(
    src_words: torch.Tensor,
    src_ids: torch.Tensor | None,
    dst_words: torch.Tensor,
    dst_ids: torch.Tensor,
    count: torch.Tensor | None,
    block_words: int,
    max_programs: int | None = None,
) -> None:
    """Copy (L, n) id lists (L = 1 without `count`); `max_programs` caps the programs per list."""
    lists = 1 if count is None else count.numel()
    num = dst_ids.numel() // lists
    if num == 0:
        return
    tile = min(triton.next_power_of_2(block_words), MAX_TILE_WORDS)
    grid = num if max_programs is None else max(1, min(num, max_programs))
    _copy_blocks_kernel[(grid, lists)](
        src_words,
        src_ids if src_ids is not None else dst_ids,  # unused when HAS_SRC_IDS is False
        dst_words,
        dst_ids,
        count if count is not None else dst_ids,  # unused when HAS_COUNT is False
        num,
        WORDS=block_words,
        TILE=tile,
        HAS_SRC_IDS=src_ids is not None,
        HAS_COUNT=count is not None,
        num_warps=8 if tile >= MAX_TILE_WORDS else 4,
    )


def _check_pair(src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise ValueError(
            f"block shapes/dtypes differ: {tuple(src.shape[1:])} {src.dtype} vs {tuple(dst.shape[1:])} {dst.dtype}"
        )


def gather_blocks(
    pool_src: torch.Tensor,
    src_ids: torch.Tensor,
    pool_dst: torch.Tensor,
    dst_slots: torch.Tensor,
    count: torch.Tensor | None = None,
) -> None:
    """FlashH2D: copy `pool_src[src_ids[i]] -> pool_dst[dst_slots[i]]` in one launch.

    Same contract as `reference.gather_blocks`. `pool_src` (C, 2, S, D) may be pinned host memory
    (read through UVA) or device memory; `pool_dst` (P, 2, S, D) is device memory. `src_ids`,
    `dst_slots` ((n,) or (L, n)) and `count` ((L,)) must be on the device that runs the kernel.
    With `count` the grid is fixed by the lists' shape (`COUNTED_PROGRAMS` programs in all) and
    the kernel reads how many entries of each list are live: no host sync, so the launch can be
    captured in a CUDA graph, and the unused tail of a list launches nothing.
    """
    _check_pair(pool_src, pool_dst)
    assert src_ids.numel() == dst_slots.numel() and src_ids.device == dst_slots.device
    if src_ids.numel() == 0:
        return
    src_words = _as_words(pool_src)
    per_list = None if count is None else max(1, COUNTED_PROGRAMS // count.numel())
    _launch(
        src_words,
        src_ids.reshape(-1).contiguous(),  # a view's ids may be strided (a size-1 dim keeps any stride)
        _as_words(pool_dst),
        dst_slots.reshape(-1).contiguous(),
        count,
        src_words.numel() // pool_src.shape[0],
        per_list,
    )


def scatter_blocks(
    src_blocks: torch.Tensor,
    pool_dst: torch.Tensor,
    dst_ids: torch.Tensor,
    max_programs: int | None = SAVE_PROGRAMS,
) -> None:
    """GPU-direct save: copy `src_blocks[i] -> pool_dst[dst_ids[i]]` in one launch.

    Same contract as `reference.scatter_blocks`. `src_blocks` (n, 2, S, D) is device memory,
    `pool_dst` (C, 2, S, D) pinned host memory written through UVA (or device memory);
    `dst_ids` (n,) lives on the kernel's device. The writes are ordered on the current stream:
    synchronize it before the host reads the pool. `max_programs` caps the grid (each program
    then saves every max_programs-th block): a save beside prefill compute holds at most that
    many SMs' worth of thread blocks instead of one per block, so it steals little compute.
    None: one program per block.
    """
    _check_pair(src_blocks, pool_dst)
    assert src_blocks.shape[0] == dst_ids.numel()
    if max_programs is not None and max_programs < 1:
        raise ValueError(f"max_programs must be >= 1 or None, got {max_programs}")
    if dst_ids.numel() == 0:
        return
    src_words = _as_words(src_blocks.contiguous())
    block_words = src_words.numel() // src_blocks.shape[0]
    _launch(src_words, None, _as_words(pool_dst), dst_ids.reshape(-1).contiguous(), None, block_words, max_programs)
