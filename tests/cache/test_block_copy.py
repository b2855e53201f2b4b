"""Per-block copy transfers (`transfer="copy"`) against the reference gather/scatter, and the device pool."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf.cache.block_pool import BlockPool
from sparseserve_hf.ops import TORCH_OPS, block_copy, reference

SHAPE = (2, 8, 16)
SENTINEL = 7.0


def ids_with_unused(num: int, high: int, unused: int) -> torch.Tensor:
    ids = torch.randperm(high)[:num]
    ids[:unused] = -1
    return ids[torch.randperm(num)]


@pytest.mark.core
@pytest.mark.parametrize("count", [None, 0, 4, 9])
def test_gather_matches_reference(count):
    src = torch.randn((30, *SHAPE))
    src_ids, dst_slots = ids_with_unused(9, 30, 2), ids_with_unused(9, 12, 1)
    number = None if count is None else torch.tensor([count])
    expected = torch.full((12, *SHAPE), SENTINEL)
    got = expected.clone()
    reference.gather_blocks(src, src_ids, expected, dst_slots, number)
    block_copy.gather_blocks(src, src_ids, got, dst_slots, number)
    assert torch.equal(got, expected)


@pytest.mark.core
def test_scatter_matches_reference():
    blocks = torch.randn((7, *SHAPE))
    dst_ids = ids_with_unused(7, 20, 3)
    expected = torch.full((20, *SHAPE), SENTINEL)
    got = expected.clone()
    reference.scatter_blocks(blocks, expected, dst_ids)
    block_copy.scatter_blocks(blocks, got, dst_ids)
    assert torch.equal(got, expected)


@pytest.mark.core
def test_with_copy_transfers_swaps_only_the_transfers():
    ops = block_copy.with_copy_transfers(TORCH_OPS)
    assert ops.name == "torch+copy"
    assert ops.gather_blocks is block_copy.gather_blocks and ops.scatter_blocks is block_copy.scatter_blocks
    assert ops.sparse_decode is TORCH_OPS.sparse_decode and ops.score_table is TORCH_OPS.score_table


@pytest.mark.core
def test_pool_on_a_device_grows_there_and_refuses_pinning():
    pool = BlockPool(SHAPE, torch.float32, None, pin=False, device="cpu")
    ids = pool.allocate(300)  # past the initial 256 blocks: grows
    blocks = torch.randn((300, *SHAPE))
    pool.storage[ids] = blocks
    assert pool.storage.device == pool.device and torch.equal(pool.storage[ids], blocks)
    with pytest.raises(ValueError, match="pin"):
        BlockPool(SHAPE, torch.float32, None, pin=True, device="meta")


@pytest.mark.gpu
def test_pool_on_cuda():
    pool = BlockPool(SHAPE, torch.float16, 1 << 16, pin=False, device="cuda")
    assert pool.storage.is_cuda and not pool.storage.is_pinned()
