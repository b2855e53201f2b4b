"""The fused RMSNorm kernel against `reference.rms_norm`, and the reference against Llama's own module."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernel_support import DEVICE, DTYPES, tolerance
from sparseserve_hf.ops import reference, triton_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 1, 4096), (3, 5, 96), (1, 1, 1000)])  # a decode step, a prefill, H not 2^k
def test_kernel_matches_the_reference(shape, dtype):
    gen = torch.Generator().manual_seed(shape[-1])
    hidden = (torch.randn(shape, generator=gen) * 3).to(dtype)
    weight = (1 + torch.randn(shape[-1], generator=gen) / 4).to(dtype)
    want = reference.rms_norm(hidden, weight, 1e-5)
    got = triton_norm.rms_norm(hidden.to(DEVICE), weight.to(DEVICE), 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.cpu().float(), want.float(), **tolerance(dtype))


def test_kernel_reads_a_strided_input_and_promotes_to_the_weights_dtype():
    hidden = torch.randn(4, 2, 64)[:, 1]  # rows 128 elements apart
    weight = torch.rand(64, dtype=torch.float32) + 0.5
    want = reference.rms_norm(hidden.half(), weight, 1e-6)
    got = triton_norm.rms_norm(hidden.half().to(DEVICE), weight.to(DEVICE), 1e-6)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want, **tolerance(torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_llamas_norm_bit_for_bit(dtype):
    norm = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    hidden = torch.randn(5, 3, 48).to(dtype)
    assert torch.equal(reference.rms_norm(hidden, norm.weight, norm.variance_epsilon), norm(hidden))
