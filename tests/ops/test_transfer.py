"""FlashH2D gather and UVA scatter kernels against `reference.gather_blocks` / `scatter_blocks`."""

from __future__ import annotations

import pytest
import torch

from kernel_support import DEVICE, DTYPES, ON_GPU
from sparseserve_hf.ops import reference, triton_transfer

BLOCK_SHAPES = [(2, 8, 16), (2, 4, 6), (2, 32, 128)]  # (2, S, D); D=6 fp16 = 12-byte rows: int32 words still divide
SENTINEL = 7.0


def host_pool(num: int, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """A random host pool, pinned when a GPU is there (the kernel then reads it through UVA)."""
    pool = torch.randn((num, *shape)).to(dtype)
    return pool.pin_memory() if ON_GPU else pool


def random_ids(num: int, high: int, unused: int) -> torch.Tensor:
    """`num` distinct ids below `high`, the first `unused` of them replaced by -1."""
    ids = torch.randperm(high)[:num]
    ids[:unused] = -1
    return ids[torch.randperm(num)]


@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16], ids=str)  # words are copied: bf16 works interpreted
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=str)
@pytest.mark.parametrize("unused", [0, 3])
def test_gather_blocks_matches_reference(dtype, shape, unused):
    src = host_pool(37, shape, dtype)
    src_ids = random_ids(11, 37, unused)
    dst_slots = random_ids(11, 23, unused)
    expected = torch.full((23, *shape), SENTINEL, dtype=dtype, device=DEVICE)  # poisoned: unwritten slots stay
    got = expected.clone()
    reference.gather_blocks(src, src_ids, expected, dst_slots)
    triton_transfer.gather_blocks(src, src_ids.to(DEVICE), got, dst_slots.to(DEVICE))
    assert torch.equal(got, expected)
    written = dst_slots[(src_ids >= 0) & (dst_slots >= 0)]
    assert torch.equal(got[written.to(DEVICE)].cpu(), src[src_ids[(src_ids >= 0) & (dst_slots >= 0)]].cpu())


def test_gather_and_scatter_take_strided_id_views():
    """A column of a block table, (Hkv,) over (B, Hkv, N), is a view of stride N (as is a flattened
    (Hkv, 1) slice): the kernels read its entries, not the table's next columns."""
    src = host_pool(37, BLOCK_SHAPES[0], torch.float32)
    table = random_ids(12, 37, 0).view(1, 4, 3).to(DEVICE)  # (B, Hkv, N)
    column, slots = table[0, :, 1], torch.arange(4, device=DEVICE)
    assert column.stride() == (3,)
    got = torch.full((4, *BLOCK_SHAPES[0]), SENTINEL, device=DEVICE)
    triton_transfer.gather_blocks(src, column, got, slots)
    assert torch.equal(got.cpu(), src[column.cpu()].cpu())
    pool = torch.full((37, *BLOCK_SHAPES[0]), SENTINEL, device=DEVICE)
    triton_transfer.scatter_blocks(got, pool, column, max_programs=None)
    assert torch.equal(pool[column].cpu(), got.cpu())


@pytest.mark.parametrize("count", [0, 1, 6, 11])
def test_gather_blocks_with_device_count_copies_only_the_first_entries(count):
    shape, dtype = (2, 8, 16), torch.float16
    src = host_pool(30, shape, dtype)
    src_ids, dst_slots = random_ids(11, 30, 2), random_ids(11, 16, 0)
    expected = torch.full((16, *shape), SENTINEL, dtype=dtype, device=DEVICE)
    got = expected.clone()
    number = torch.tensor([count], dtype=torch.int32)
    reference.gather_blocks(src, src_ids, expected, dst_slots, number)
    triton_transfer.gather_blocks(src, src_ids.to(DEVICE), got, dst_slots.to(DEVICE), number.to(DEVICE))
    assert torch.equal(got, expected)
    assert int((got != SENTINEL).flatten(1).any(1).sum()) == int((src_ids[:count] >= 0).sum())


def test_gather_blocks_over_counted_lists_copies_each_lists_live_prefix():
    """A lookup's load lists: one per KV head, live entries first, -1 after, the count per list on the device."""
    shape, dtype = (2, 8, 16), torch.float16
    src = host_pool(60, shape, dtype)
    lengths = [0, 5, 9, 2]
    src_ids = torch.randperm(60)[:36].view(4, 9)
    dst_slots = torch.randperm(39)[:36].view(4, 9)  # slot 39 stays free for the entry past a count
    for lst, n in enumerate(lengths):
        src_ids[lst, n:] = dst_slots[lst, n:] = -1
    src_ids[2, 3] = -1  # a skipped entry inside a live prefix
    src_ids[3, 7] = 11  # past its list's count: not copied, though its ids are valid
    dst_slots[3, 7] = 39
    counts = torch.tensor(lengths)
    expected = torch.full((40, *shape), SENTINEL, dtype=dtype, device=DEVICE)
    got = expected.clone()
    reference.gather_blocks(src, src_ids, expected, dst_slots, counts)
    triton_transfer.gather_blocks(src, src_ids.to(DEVICE), got, dst_slots.to(DEVICE), counts.to(DEVICE))
    assert torch.equal(got, expected)
    assert int((got != SENTINEL).flatten(1).any(1).sum()) == sum(lengths) - 1 and (got[39] == SENTINEL).all()


def test_gather_blocks_empty_is_a_no_op():
    pool = torch.zeros(4, 2, 8, 16, device=DEVICE)
    triton_transfer.gather_blocks(
        pool, torch.zeros(0, dtype=torch.long, device=DEVICE), pool, torch.zeros(0, dtype=torch.long, device=DEVICE)
    )


def test_gather_blocks_rejects_mismatched_pools():
    with pytest.raises(ValueError, match="block shapes/dtypes differ"):
        triton_transfer.gather_blocks(
            torch.zeros(4, 2, 8, 16),
            torch.zeros(1, dtype=torch.long),
            torch.zeros(4, 2, 8, 8),
            torch.zeros(1, dtype=torch.long),
        )


@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=str)
@pytest.mark.parametrize("unused", [0, 2])
def test_scatter_blocks_matches_reference(dtype, shape, unused):
    blocks = torch.randn((9, *shape)).to(dtype).to(DEVICE)
    dst_ids = random_ids(9, 29, unused)
    expected = torch.full((29, *shape), SENTINEL, dtype=dtype)
    got = expected.pin_memory() if ON_GPU else expected.clone()
    reference.scatter_blocks(blocks, expected, dst_ids)
    triton_transfer.scatter_blocks(blocks, got, dst_ids.to(DEVICE))
    if ON_GPU:
        torch.cuda.synchronize()  # UVA writes land asynchronously
    assert torch.equal(got, expected)


@pytest.mark.parametrize("max_programs", [1, 3, 9, 64])
def test_scatter_with_a_capped_grid_saves_every_block(max_programs):
    shape, dtype = (2, 8, 16), torch.float16
    blocks = torch.randn((9, *shape)).to(dtype).to(DEVICE)
    dst_ids = random_ids(9, 29, 2)
    expected = torch.full((29, *shape), SENTINEL, dtype=dtype)
    got = expected.pin_memory() if ON_GPU else expected.clone()
    reference.scatter_blocks(blocks, expected, dst_ids)
    triton_transfer.scatter_blocks(blocks, got, dst_ids.to(DEVICE), max_programs=max_programs)
    if ON_GPU:
        torch.cuda.synchronize()
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="max_programs"):
        triton_transfer.scatter_blocks(blocks, got, dst_ids.to(DEVICE), max_programs=0)


def test_scatter_then_gather_round_trips_every_block():
    shape, dtype = (2, 16, 32), torch.float16
    blocks = torch.randn((13, *shape)).to(dtype).to(DEVICE)
    pool = host_pool(40, shape, dtype)
    ids = torch.randperm(40)[:13].to(DEVICE)
    triton_transfer.scatter_blocks(blocks, pool, ids)
    back = torch.full_like(blocks, SENTINEL)
    triton_transfer.gather_blocks(pool, ids, back, torch.arange(13, device=DEVICE))
    assert torch.equal(back, blocks)


@pytest.mark.gpu
def test_gather_from_pinned_host_is_a_uva_read_on_the_gpu():
    src = host_pool(64, (2, 32, 128), torch.bfloat16)
    assert src.is_pinned() and not src.is_cuda
    got = torch.zeros((64, 2, 32, 128), dtype=torch.bfloat16, device="cuda")
    triton_transfer.gather_blocks(src, torch.arange(64, device="cuda").flip(0), got, torch.arange(64, device="cuda"))
    assert torch.equal(got.cpu(), src.flip(0))
