"""Triton sparse decode attention against `reference.sparse_decode`."""

from __future__ import annotations

import pytest
import torch

from kernel_support import DEVICE, DTYPES, tolerance
from sparseserve_hf.ops import reference, triton_decode


def decode_inputs(batch, kv_heads, group, size, dim, loaded, dtype, unused=2, masked=False):
    """Random decode inputs: a pool, ragged slot lists (-1 padded), tails of odd lengths, an optional head mask."""
    num_slots = batch * kv_heads * loaded + 3
    pool = torch.randn(num_slots, 2, size, dim).to(dtype)
    slots = torch.randperm(num_slots)[: batch * kv_heads * loaded].view(batch, kv_heads, loaded)
    if loaded:
        slots[0, 0, loaded - min(unused, loaded) :] = -1  # a shorter list
        slots[-1, -1, :] = torch.where(torch.arange(loaded) % 2 == 1, -1, slots[-1, -1, :])  # holes
    head_mask = torch.rand(batch, kv_heads * group, loaded) > 0.4 if masked else None
    tail = torch.randn(batch, kv_heads, 2, size, dim).to(dtype)
    tail_len = torch.randint(1, size + 1, (batch,))
    tail_len[0] = size  # a full tail
    query = torch.randn(batch, kv_heads * group, dim).to(dtype)
    return query, pool, slots, head_mask, tail[:, :, 0], tail[:, :, 1], tail_len


def run_both(inputs, scaling=0.3, num_splits=None):
    expected = reference.sparse_decode(*inputs, scaling)
    on_device = [x.to(DEVICE) if x is not None else None for x in inputs]
    got = triton_decode.sparse_decode(*on_device, scaling, num_splits=num_splits)
    return got, expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 4), (1, 8)])
@pytest.mark.parametrize("masked", [False, True], ids=["all_heads", "head_mask"])
def test_sparse_decode_matches_reference(poisoned, dtype, kv_heads, group, masked):
    inputs = decode_inputs(3, kv_heads, group, 8, 16, 11, dtype, masked=masked)
    got, expected = run_both(inputs, num_splits=3)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.cpu(), expected, **tolerance(dtype))


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("size", [16, 32])
def test_sparse_decode_head_dims_and_block_sizes(poisoned, dim, size):
    inputs = decode_inputs(2, 2, 4, size, dim, 5, torch.float16, masked=True)
    got, expected = run_both(inputs, num_splits=2)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.float16))


@pytest.mark.parametrize("num_splits", [1, 2, 100])  # one, several, more than there are tiles
def test_split_count_does_not_change_the_result(poisoned, num_splits):
    inputs = decode_inputs(2, 1, 4, 8, 16, 19, torch.float32)
    got, expected = run_both(inputs, num_splits=num_splits)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.float32))


@pytest.mark.parametrize("used", [0, 1, 6, 33])
def test_splits_share_a_used_prefix_much_shorter_than_the_selection(poisoned, used):
    query, pool, slots, _, tail_k, tail_v, tail_len = decode_inputs(2, 2, 4, 8, 16, 40, torch.float32, unused=0)
    slots[:, :, used:] = -1  # each list's used blocks first, as selections hold them
    slots[1, 1, : used // 2] = -1  # and one with holes before its last used block
    inputs = (query, pool, slots, None, tail_k, tail_v, tail_len)
    got, expected = run_both(inputs, num_splits=5)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.float32))


def test_only_the_tail_when_nothing_is_loaded(poisoned):
    inputs = decode_inputs(2, 2, 2, 8, 16, 0, torch.float32)  # U = 0: budget above the sequence length
    got, expected = run_both(inputs)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.float32))


def test_blocks_a_head_may_not_see_are_ignored(poisoned):
    query, pool, slots, _, tail_k, tail_v, tail_len = decode_inputs(1, 1, 4, 8, 16, 6, torch.float32, unused=0)
    head_mask = torch.zeros(1, 4, 6, dtype=torch.bool)
    head_mask[0, 1, 2] = True
    pool_poisoned = pool.clone()
    seen = slots[0, 0, 2]
    pool_poisoned[torch.arange(pool.shape[0]) != seen] = 1e4  # every block but the one head 1 sees
    inputs = (query, pool_poisoned, slots, head_mask, tail_k, tail_v, tail_len)
    got, _ = run_both(inputs)
    expected = reference.sparse_decode(query, pool, slots, head_mask, tail_k, tail_v, tail_len, 0.3)
    # Heads 0, 2, 3 see only the tail, head 1 one block + tail: the poisoned blocks change nothing.
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.float32))


@pytest.mark.parametrize("budget_blocks", [3, 7, 12])  # below, equal to, above the row's 7 full blocks
def test_selected_blocks_from_select_blocks(poisoned, budget_blocks):
    """End to end on one layer: select -> union -> decode equals the reference chain."""
    batch, kv_heads, group, size, dim, full = 2, 2, 4, 8, 16, 7
    keys = torch.randn(batch, kv_heads, full, 2, size, dim)
    metadata = reference.block_metadata(keys[:, :, :, 0], "quest")
    query = torch.randn(batch, kv_heads * group, dim)
    scores = reference.score_blocks(query, metadata, "quest")
    picked, valid = reference.select_blocks(scores, torch.tensor([full, 5]), budget_blocks, 1, 1)
    union, union_valid, head_mask = reference.union_over_group(picked, valid, kv_heads, full)
    pool = keys.reshape(-1, 2, size, dim)  # slot of block n of (b, h) = (b*Hkv + h)*N + n
    base = (torch.arange(batch)[:, None, None] * kv_heads + torch.arange(kv_heads)[None, :, None]) * full
    slots = torch.where(union_valid, base + union, -1)
    tail = torch.randn(batch, kv_heads, 2, size, dim)
    inputs = (query, pool, slots, head_mask, tail[:, :, 0], tail[:, :, 1], torch.tensor([3, size]))
    got, expected = run_both(inputs)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sparse_decode_llama_shape_on_the_gpu(dtype):
    inputs = decode_inputs(4, 8, 4, 32, 128, 64, dtype, masked=False)
    got, expected = run_both(inputs)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["all_heads", "head_mask"])
def test_sparse_decode_over_8bit_blocks_matches_reference(poisoned, dtype, masked):
    """A pool of float8 blocks with per-block key/value scales, dequantized inside the kernel: the
    kernel attends what the pool holds, dequantized in the query's dtype."""
    query, pool, slots, head_mask, tail_k, tail_v, tail_len = decode_inputs(3, 2, 4, 8, 16, 11, dtype, masked=masked)
    stored, block_scales = reference.quantize_blocks(pool.float() * 3, torch.float8_e4m3fn)  # scales != 1
    scales = block_scales[slots.clamp(min=0)]  # (B, Hkv, U, 2)
    inputs = (query, stored, slots, head_mask, tail_k, tail_v, tail_len)
    on_device = [x.to(DEVICE) if x is not None else None for x in inputs]
    got = triton_decode.sparse_decode(*on_device, 0.3, num_splits=3, scales=scales.to(DEVICE))
    assert got.dtype == dtype and not got.isnan().any()
    dequantized = reference.dequantize_blocks(stored, block_scales, dtype)
    expected = reference.sparse_decode(query, dequantized, slots, head_mask, tail_k, tail_v, tail_len, 0.3)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(dtype))


def test_reference_over_8bit_blocks_is_attention_over_the_dequantized_pool():
    query, pool, slots, head_mask, tail_k, tail_v, tail_len = decode_inputs(
        2, 2, 4, 8, 16, 9, torch.float32, masked=True
    )
    stored, block_scales = reference.quantize_blocks(pool * 5, torch.float8_e4m3fn)
    inputs = (query, stored, slots, head_mask, tail_k, tail_v, tail_len)
    got = reference.sparse_decode(*inputs, 0.3, scales=block_scales[slots.clamp(min=0)])
    dequantized = reference.dequantize_blocks(stored, block_scales, torch.float32)
    expected = reference.sparse_decode(query, dequantized, slots, head_mask, tail_k, tail_v, tail_len, 0.3)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def ids_for_slots(slots: torch.Tensor, num_slots: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """DRAM ids for the entries' slots under a random one-to-one map, and the block -> slot table
    that undoes it: (B, Hkv, U) ids (-1 where the slot is), (num_slots,) table."""
    perm = torch.randperm(num_slots, generator=gen)
    block_slot = torch.empty(num_slots, dtype=torch.long)
    block_slot[perm] = torch.arange(num_slots)
    return torch.where(slots >= 0, perm[slots.clamp(min=0)], -1), block_slot


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["all_heads", "head_mask"])
@pytest.mark.parametrize("late_share", [0.0, 0.3, 1.0], ids=["none_late", "some_late", "all_late"])
def test_decode_in_two_halves_reads_late_blocks_only_after_they_arrive(poisoned, dtype, masked, late_share):
    """`begin_decode` attends the resident entries and the tails while the late entries' slots still
    hold garbage (NaN, as before a lookup's copy lands); `finish_decode` attends those once written,
    and the merge equals `reference.sparse_decode` over the final slots."""
    gen = torch.Generator().manual_seed(int(late_share * 10) + masked)
    query, pool, slots, head_mask, tail_k, tail_v, tail_len = decode_inputs(3, 2, 4, 8, 16, 11, dtype, masked=masked)
    late = (torch.rand(slots.shape, generator=gen) < late_share) & (slots >= 0)
    resident = torch.where(late, -1, slots)
    expected = reference.sparse_decode(query, pool, slots, head_mask, tail_k, tail_v, tail_len, 0.3)
    on_device = [x.to(DEVICE) if x is not None else None for x in (query, head_mask, tail_k, tail_v, tail_len)]
    q, mask, tk, tv, tlen = on_device
    arriving = pool.to(DEVICE, copy=True)
    arriving[slots[late].to(DEVICE)] = float("nan")
    pending = triton_decode.begin_decode(q, arriving, resident.to(DEVICE), mask, tk, tv, tlen, 0.3, num_splits=3)
    arriving[slots[late].to(DEVICE)] = pool[slots[late]].to(DEVICE)  # the lookup's copy lands
    block_ids, block_slot = ids_for_slots(slots, pool.shape[0], gen)
    got = triton_decode.finish_decode(pending, block_ids.to(DEVICE), block_slot.to(DEVICE))
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.cpu(), expected, **tolerance(dtype))
    halves = reference.finish_decode(
        reference.begin_decode(query, pool, resident, head_mask, tail_k, tail_v, tail_len, 0.3), block_ids, block_slot
    )
    torch.testing.assert_close(halves, expected, rtol=0, atol=0)


@pytest.mark.parametrize("loaded", [0, 40])
def test_decode_in_two_halves_over_8bit_blocks_and_long_late_lists(poisoned, loaded):
    """8-bit blocks with their scales; 40 entries per row all late, so a late program walks several tiles."""
    query, pool, slots, _, tail_k, tail_v, tail_len = decode_inputs(2, 2, 4, 8, 16, loaded, torch.float16, unused=0)
    stored, block_scales = reference.quantize_blocks(pool.float() * 3, torch.float8_e4m3fn)
    scales = block_scales[slots.clamp(min=0)]
    resident = torch.full_like(slots, -1)
    resident[0, 0, : loaded // 2] = slots[0, 0, : loaded // 2]
    dequantized = reference.dequantize_blocks(stored, block_scales, torch.float16)
    expected = reference.sparse_decode(query, dequantized, slots, None, tail_k, tail_v, tail_len, 0.3)
    q, tk, tv, tlen = (x.to(DEVICE) for x in (query, tail_k, tail_v, tail_len))
    pending = triton_decode.begin_decode(
        q, stored.to(DEVICE), resident.to(DEVICE), None, tk, tv, tlen, 0.3, num_splits=2, scales=scales.to(DEVICE)
    )
    block_ids, block_slot = ids_for_slots(slots, stored.shape[0], torch.Generator().manual_seed(loaded))
    got = triton_decode.finish_decode(pending, block_ids.to(DEVICE), block_slot.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.float16))


@pytest.mark.gpu
def test_decode_in_two_halves_llama_shape_on_the_gpu():
    query, pool, slots, _, tail_k, tail_v, tail_len = decode_inputs(4, 8, 4, 32, 128, 64, torch.bfloat16)
    resident = torch.where(torch.rand(slots.shape) < 0.2, -1, slots)
    expected = reference.sparse_decode(query, pool, slots, None, tail_k, tail_v, tail_len, 0.3)
    q, p, tk, tv, tlen = (x.to(DEVICE) for x in (query, pool, tail_k, tail_v, tail_len))
    block_ids, block_slot = ids_for_slots(slots, pool.shape[0], torch.Generator().manual_seed(0))
    got = triton_decode.finish_decode(
        triton_decode.begin_decode(q, p, resident.to(DEVICE), None, tk, tv, tlen, 0.3),
        block_ids.to(DEVICE),
        block_slot.to(DEVICE),
    )
    torch.testing.assert_close(got.cpu(), expected, **tolerance(torch.bfloat16))
