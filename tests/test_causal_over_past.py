"""`causal_attention_over_past` (prefill over a stored past, no mask built on CUDA) equals SDPA with
the explicit (T, L + T) mask it replaces, with grouped KV heads, on random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparseserve_hf import attention
from sparseserve_hf.attention import causal_attention_over_past


def masked_reference(query, keys, values, scaling):
    """Plain SDPA: KV heads repeated, query t sees keys [0, L + t]."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    num_new, total = query.shape[2], keys.shape[2]
    mask = torch.ones(num_new, total, dtype=torch.bool, device=query.device).tril(diagonal=total - num_new)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


def random_case(past: int, new: int, device: str, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    query = torch.randn(1, 4, new, 64, generator=gen, device=device, dtype=dtype)  # (B, Hq, T, D)
    keys = torch.randn(1, 2, past + new, 64, generator=gen, device=device, dtype=dtype)  # (B, Hkv, L + T, D)
    values = torch.randn(1, 2, past + new, 64, generator=gen, device=device, dtype=dtype)
    return query, keys, values


@pytest.mark.core
@pytest.mark.parametrize(("past", "new"), [(0, 7), (33, 7), (64, 64), (5, 130)])
def test_equals_the_masked_reference(past, new):
    query, keys, values = random_case(past, new, "cpu", torch.float32)
    out = causal_attention_over_past(query, keys, values, scaling=0.125)
    assert out.shape == (1, new, 4, 64)
    torch.testing.assert_close(out, masked_reference(query, keys, values, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.core
def test_grouped_kv_heads_unrepeated_equal_the_masked_reference(monkeypatch):
    """The branch flash takes on CUDA (`enable_gqa`: each KV head read for its query group, no
    repeated copy), run here by SDPA's math kernel."""
    monkeypatch.setattr(attention, "flash_takes_groups", lambda *args: True)
    query, keys, values = random_case(33, 7, "cpu", torch.float32)
    out = causal_attention_over_past(query, keys, values, scaling=0.125)
    torch.testing.assert_close(out, masked_reference(query, keys, values, 0.125), atol=1e-5, rtol=1e-5)


def test_flash_takes_groups_only_on_cuda_with_fewer_kv_heads():
    query, keys, values = random_case(33, 7, "cpu", torch.float32)
    assert not attention.flash_takes_groups(query, keys, values, 0.0)  # CPU: repeated, as before


@pytest.mark.gpu
@pytest.mark.parametrize(("past", "new"), [(4096, 1000), (300, 2048)])
def test_equals_the_masked_reference_on_cuda_bf16(past, new):
    query, keys, values = random_case(past, new, "cuda", torch.bfloat16)
    assert attention.flash_takes_groups(query, keys, values, 0.0)  # KV heads not repeated
    out = causal_attention_over_past(query, keys, values, scaling=0.125)
    reference = masked_reference(query.float(), keys.float(), values.float(), 0.125)
    torch.testing.assert_close(out.float(), reference, atol=2e-2, rtol=2e-2)
