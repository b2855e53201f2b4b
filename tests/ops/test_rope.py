"""The fused rotary-embedding kernel against `reference.rope`, bit for bit, and the reference against Llama's."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kernel_support import DEVICE, DTYPES
from sparseserve_hf.fused_ops import rope_fusable
from sparseserve_hf.ops import reference, triton_rope


def inputs(batch, q_heads, k_heads, tokens, width, dtype, seed=0, broadcast=False):
    gen = torch.Generator().manual_seed(seed)
    # q and k as the attention module makes them: projections viewed (B, T, H, D), then transposed
    q = torch.randn(batch, tokens, q_heads, width, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(batch, tokens, k_heads, width, generator=gen).to(dtype).transpose(1, 2)
    angles = torch.rand(1 if broadcast else batch, tokens, width // 2, generator=gen) * 100
    angles = torch.cat((angles, angles), dim=-1)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "batch,q_heads,k_heads,tokens,width,broadcast",
    [(16, 32, 8, 1, 128, False), (2, 4, 2, 7, 64, False), (3, 6, 3, 5, 32, True)],  # decode, prefill, shared cos
)
def test_kernel_equals_the_reference_bit_for_bit(batch, q_heads, k_heads, tokens, width, broadcast, dtype):
    q, k, cos, sin = inputs(batch, q_heads, k_heads, tokens, width, dtype, seed=tokens, broadcast=broadcast)
    assert rope_fusable(q, k, cos, sin, 1)
    want_q, want_k = reference.rope(q, k, cos, sin)
    got_q, got_k = triton_rope.rope(*(t.to(DEVICE) for t in (q, k, cos, sin)))
    assert torch.equal(got_q.cpu(), want_q) and torch.equal(got_k.cpu(), want_k)
    laid_out = [(s, n) for s, n in zip(got_q.stride(), got_q.shape) if n > 1]  # a size-1 dim's stride is free
    assert laid_out == [(s, n) for s, n in zip(want_q.stride(), want_q.shape) if n > 1]  # as PyTorch lays it out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_llamas_rotary_embedding_bit_for_bit(dtype):
    q, k, cos, sin = inputs(2, 4, 2, 3, 64, dtype)
    for got, want in zip(reference.rope(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(got, want)


def test_calls_the_kernel_does_not_take_are_refused():
    q, k, cos, sin = inputs(1, 2, 1, 2, 64, torch.float32)
    assert not rope_fusable(q, k, cos, sin, 2)  # the (B, T, H, D) layout
    assert not rope_fusable(q, k, cos.half(), sin.half(), 1)  # mixed dtypes promote
    q6, k6, cos6, sin6 = inputs(1, 2, 1, 2, 96, torch.float32)
    assert not rope_fusable(q6, k6, cos6, sin6, 1)  # D not a power of two
