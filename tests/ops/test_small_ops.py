"""The decode step's small fused ops against `ops.reference`: the tail append (exact on every
dtype) and the MLP activation (bit for bit PyTorch's own on a GPU; within a few roundings under
the CPU interpreter, whose exp is numpy's, not CUDA's)."""

from __future__ import annotations

import pytest
import torch

from kernel_support import DEVICE, DTYPES, ON_GPU
from sparseserve_hf.ops import reference, triton_activation, triton_append


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 8, 32, 128), (3, 3, 16, 64), (1, 1, 4, 16), (5, 2, 8, 48)])  # B, Hkv, S, D
def test_append_writes_each_row_at_its_length_and_counts_it(shape, dtype):
    batch, heads, size, dim = shape
    gen = torch.Generator().manual_seed(batch * size + dim)
    tail = torch.randn(batch, heads, 2, size, dim, generator=gen).to(DEVICE, dtype)
    lengths = torch.randint(0, size, (batch,), generator=gen).to(DEVICE)
    keys = torch.randn(batch, 1, heads, dim, generator=gen).to(DEVICE, dtype).transpose(1, 2)  # as a model makes them
    values = torch.randn(batch, heads, 1, dim, generator=gen).to(DEVICE, dtype)
    want_tail, want_lengths = tail.clone(), lengths.clone()
    reference.append_token(want_tail, want_lengths, keys, values)
    triton_append.append_token(tail, lengths, keys, values)
    assert torch.equal(tail, want_tail) and torch.equal(lengths, want_lengths)
    row = torch.arange(batch, device=DEVICE)
    assert torch.equal(tail[row, :, 0, want_lengths - 1], keys[:, :, 0]), "the token sits at the old length"


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_leaves_rows_that_hold_nothing_as_they_are(dtype):
    """Given the rows' block counts, a row with no block and an empty tail (an unused slot of a
    batch cache) takes no token; a row with blocks and an empty tail (just rolled) takes it."""
    batch, heads, size, dim = 6, 3, 8, 32
    gen = torch.Generator().manual_seed(7)
    tail = torch.randn(batch, heads, 2, size, dim, generator=gen).to(DEVICE, dtype)
    lengths = torch.tensor([0, 0, 3, 0, 7, 1], device=DEVICE)
    num_blocks = torch.tensor([0, 2, 0, 0, 5, 0], device=DEVICE)  # rows 0 and 3 hold nothing
    keys = torch.randn(batch, heads, 1, dim, generator=gen).to(DEVICE, dtype)
    values = torch.randn(batch, heads, 1, dim, generator=gen).to(DEVICE, dtype)
    want_tail, want_lengths, before = tail.clone(), lengths.clone(), tail.clone()
    reference.append_token(want_tail, want_lengths, keys, values, num_blocks)
    triton_append.append_token(tail, lengths, keys, values, num_blocks)
    assert torch.equal(tail, want_tail) and torch.equal(lengths, want_lengths)
    assert lengths.tolist() == [0, 1, 4, 0, 8, 2]
    assert torch.equal(tail[[0, 3]], before[[0, 3]]), "an empty row is not written"
    assert torch.equal(tail[1, :, 0, 0], keys[1, :, 0]) and torch.equal(tail[4, :, 1, 7], values[4, :, 0])


def test_append_of_an_empty_batch_is_a_no_op():
    tail, lengths = torch.zeros(0, 2, 2, 4, 16, device=DEVICE), torch.zeros(0, dtype=torch.long, device=DEVICE)
    triton_append.append_token(
        tail, lengths, torch.zeros(0, 2, 1, 16, device=DEVICE), torch.zeros(0, 2, 1, 16, device=DEVICE)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 1, 14336), (1, 1, 1536), (3, 5, 1000)])
def test_silu_mul_is_the_models_activation(shape, dtype):
    gen = torch.Generator().manual_seed(shape[-1])
    gate = (torch.randn(shape, generator=gen) * 8).to(DEVICE, dtype)  # past the SiLU's bend both ways
    up = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    got, want = triton_activation.silu_mul(gate, up), reference.silu_mul(gate, up)
    assert got.dtype == want.dtype and got.shape == want.shape
    if ON_GPU:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=4 * torch.finfo(dtype).eps, atol=torch.finfo(dtype).tiny)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="PyTorch's CUDA SiLU is the spec")
def test_silu_mul_equals_the_cuda_ops_in_bfloat16():
    gen = torch.Generator().manual_seed(1)
    gate = (torch.randn(16, 1, 14336, generator=gen) * 8).to("cuda", torch.bfloat16)
    up = torch.randn(16, 1, 14336, generator=gen).to("cuda", torch.bfloat16)
    assert torch.equal(triton_activation.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
