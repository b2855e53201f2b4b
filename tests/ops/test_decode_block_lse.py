"""Each loaded block's exact log-sum-exp per query head, written beside the sparse decode's output
(`block_lse`): the reference against the logits themselves, the kernels against the reference."""

from __future__ import annotations

import pytest
import torch
from test_decode import decode_inputs, ids_for_slots

from kernel_support import DEVICE, DTYPES, tolerance
from sparseserve_hf.ops import reference, triton_decode


def brute_force_lse(query, pool, slots, head_mask, scaling):
    """(B, Hq, U): logsumexp over each entry's S keys of q . k * scaling, one (row, head, entry) at a time."""
    batch, num_q_heads, _ = query.shape
    num_kv_heads, loaded = slots.shape[1], slots.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.full((batch, num_q_heads, loaded), float("-inf"))
    for b in range(batch):
        for head in range(num_q_heads):
            for u in range(loaded):
                slot = int(slots[b, head // group, u])
                if slot < 0 or (head_mask is not None and not head_mask[b, head, u]):
                    continue
                logits = pool[slot, 0].double() @ query[b, head].double() * scaling  # (S,)
                out[b, head, u] = torch.logsumexp(logits, 0).float()
    return out


@pytest.mark.parametrize("masked", [False, True], ids=["all_heads", "head_mask"])
def test_reference_writes_each_entrys_log_sum_exp(masked):
    query, pool, slots, head_mask, tail_k, tail_v, tail_len = decode_inputs(
        2, 2, 4, 8, 16, 7, torch.float32, masked=masked
    )
    block_lse = torch.empty(2, 8, 7)
    out = reference.sparse_decode(query, pool, slots, head_mask, tail_k, tail_v, tail_len, 0.3, block_lse=block_lse)
    torch.testing.assert_close(block_lse, brute_force_lse(query, pool, slots, head_mask, 0.3))
    assert torch.equal(out, reference.sparse_decode(query, pool, slots, head_mask, tail_k, tail_v, tail_len, 0.3))
    assert block_lse.isneginf().any()  # unused entries (and masked heads) know nothing


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 4)])
@pytest.mark.parametrize("masked", [False, True], ids=["all_heads", "head_mask"])
def test_kernel_writes_the_references_log_sum_exps(poisoned, dtype, kv_heads, group, masked):
    inputs = decode_inputs(3, kv_heads, group, 8, 16, 11, dtype, masked=masked)
    want = torch.empty(3, kv_heads * group, 11)
    expected = reference.sparse_decode(*inputs, 0.3, block_lse=want)
    got_lse = torch.full((3, kv_heads * group, 11), 7.0, device=DEVICE)  # stale values: every entry is written
    on_device = [x.to(DEVICE) if x is not None else None for x in inputs]
    got = triton_decode.sparse_decode(*on_device, 0.3, num_splits=3, block_lse=got_lse)
    torch.testing.assert_close(got.cpu(), expected, **tolerance(dtype))
    assert torch.equal(got_lse.isneginf().cpu(), want.isneginf())
    torch.testing.assert_close(got_lse.cpu(), want, **tolerance(dtype))


def test_the_same_tokens_with_and_without_the_log_sum_exps(poisoned):
    inputs = [x.to(DEVICE) if x is not None else None for x in decode_inputs(2, 2, 4, 8, 16, 9, torch.float32)]
    plain = triton_decode.sparse_decode(*inputs, 0.3, num_splits=2)
    with_lse = triton_decode.sparse_decode(*inputs, 0.3, num_splits=2, block_lse=torch.empty(2, 8, 9, device=DEVICE))
    assert torch.equal(plain, with_lse)


@pytest.mark.parametrize("late_share", [0.0, 0.4, 1.0], ids=["none_late", "some_late", "all_late"])
def test_two_halves_write_every_entry_once_it_is_attended(poisoned, late_share):
    """The resident half writes the resident entries' numbers, the late half the late ones': together
    the reference's, whatever the split."""
    gen = torch.Generator().manual_seed(int(late_share * 10))
    query, pool, slots, head_mask, tail_k, tail_v, tail_len = decode_inputs(
        3, 2, 4, 8, 16, 11, torch.float16, masked=True
    )
    late = (torch.rand(slots.shape, generator=gen) < late_share) & (slots >= 0)
    resident = torch.where(late, -1, slots)
    want = torch.empty(3, 8, 11)
    reference.sparse_decode(query, pool, slots, head_mask, tail_k, tail_v, tail_len, 0.3, block_lse=want)
    block_ids, block_slot = ids_for_slots(slots, pool.shape[0], gen)
    halves = torch.empty(3, 8, 11)
    reference.finish_decode(
        reference.begin_decode(query, pool, resident, head_mask, tail_k, tail_v, tail_len, 0.3, block_lse=halves),
        block_ids,
        block_slot,
    )
    assert torch.equal(halves, want)
    q, p, mask, tk, tv, tlen = (x.to(DEVICE) for x in (query, pool, head_mask, tail_k, tail_v, tail_len))
    got_lse = torch.empty(3, 8, 11, device=DEVICE)
    pending = triton_decode.begin_decode(
        q, p, resident.to(DEVICE), mask, tk, tv, tlen, 0.3, num_splits=3, block_lse=got_lse
    )
    triton_decode.finish_decode(pending, block_ids.to(DEVICE), block_slot.to(DEVICE))
    assert torch.equal(got_lse.isneginf().cpu(), want.isneginf())
    torch.testing.assert_close(got_lse.cpu(), want, **tolerance(torch.float16))


def test_over_8bit_blocks_the_numbers_are_the_dequantized_blocks(poisoned):
    query, pool, slots, _, tail_k, tail_v, tail_len = decode_inputs(2, 2, 4, 8, 16, 6, torch.float16, unused=0)
    stored, block_scales = reference.quantize_blocks(pool.float() * 3, torch.float8_e4m3fn)
    scales = block_scales[slots.clamp(min=0)]
    want = torch.empty(2, 8, 6)
    dequantized = reference.dequantize_blocks(stored, block_scales, torch.float16)
    reference.sparse_decode(query, dequantized, slots, None, tail_k, tail_v, tail_len, 0.3, block_lse=want)
    got_lse = torch.empty(2, 8, 6, device=DEVICE)
    q, tk, tv, tlen = (x.to(DEVICE) for x in (query, tail_k, tail_v, tail_len))
    triton_decode.sparse_decode(
        q, stored.to(DEVICE), slots.to(DEVICE), None, tk, tv, tlen, 0.3, scales=scales.to(DEVICE), block_lse=got_lse
    )
    torch.testing.assert_close(got_lse.cpu(), want, **tolerance(torch.float16))
