"""`SparseServeLayer.past_with`: a row's past read from DRAM straight into token order, then the
new tokens, equals the stored past (`past()`) concatenated with them; and a prefill over a stored
past (a second turn) gives the logits of one prompt of both turns."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.cache.layer import SparseServeLayer
from sparseserve_hf.ops import reference
from tiny_models import random_ids

SIZE = 16
# The Triton kernels under the CPU interpreter; with CUDA present they take the GPU test below.
INTERPRETED_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU model's Triton ops: interpreter only")


def filled(model, length: int, **overrides) -> SparseServeCache:
    cache = SparseServeCache(model.config, SparseServeConfig(block_size=SIZE, **overrides))
    with torch.no_grad():
        model(random_ids(1, length, seed=length).to(model.device), past_key_values=cache)
    return cache


@pytest.mark.core
@pytest.mark.parametrize("length", [1, 16, 17, 64, 70])  # tails of 1..16 tokens, 0..4 full blocks
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        pytest.param({"backend": "triton"}, marks=INTERPRETED_ONLY),
        {"offload": False},
        {"kv_dtype": "float8_e4m3fn"},
    ],
    ids=["torch", "triton", "no_offload", "fp8_kv"],
)
def test_past_with_equals_the_past_then_the_new_tokens(llama, length, overrides):
    cache = filled(llama, length, **overrides)
    for layer in cache.layers:
        past_keys, past_values, valid = layer.past()
        assert valid.all()
        new_keys = torch.randn(1, past_keys.shape[1], 5, past_keys.shape[-1])
        new_values = torch.randn_like(new_keys)
        keys, values = layer.past_with(new_keys, new_values)
        assert keys.shape == values.shape == (1, past_keys.shape[1], length + 5, past_keys.shape[-1])
        assert torch.equal(keys, torch.cat((past_keys, new_keys), dim=2))
        assert torch.equal(values, torch.cat((past_values, new_values), dim=2))


def test_past_with_reads_one_row_only(llama):
    cache = SparseServeCache(llama.config, SparseServeConfig(block_size=SIZE))
    with torch.no_grad():
        llama(random_ids(2, 20), past_key_values=cache)
    layer = cache.layers[0]
    new = torch.zeros(2, layer.tail.shape[1], 1, layer.tail.shape[-1])
    with pytest.raises(ValueError, match="one row"):
        layer.past_with(new, new)


@pytest.mark.core
@pytest.mark.parametrize("first", [16, 37])
def test_a_second_turn_over_the_stored_past_gives_the_one_prompt_logits(llama, first):
    ids = random_ids(1, first + 11, seed=first)
    with torch.no_grad():
        whole = llama(ids).logits
        cache = SparseServeCache(llama.config, SparseServeConfig(block_size=SIZE))
        llama(ids[:, :first], past_key_values=cache)
        second = llama(ids[:, first:], past_key_values=cache).logits
    torch.testing.assert_close(second, whole[:, first:], atol=1e-5, rtol=1e-5)


def counting_reads(monkeypatch) -> list[int]:
    """The layers that read their block and tail counts back (a host sync on CUDA), as they do."""
    reads = []
    real = SparseServeLayer._read_counts
    monkeypatch.setattr(SparseServeLayer, "_read_counts", lambda layer: reads.append(layer.layer_idx) or real(layer))
    return reads


@pytest.mark.core
def test_a_prompt_after_a_prompt_reads_no_counts_back(llama, monkeypatch):
    """The first prompt's commit leaves each layer's counts known on the host: the second prompt's
    `past_with` and commit read nothing back."""
    reads = counting_reads(monkeypatch)
    cache, ids = SparseServeCache(llama.config, SparseServeConfig(block_size=SIZE)), random_ids(1, 90)
    with torch.no_grad():
        llama(ids[:, :50], past_key_values=cache)
        llama(ids[:, 50:], past_key_values=cache)
    assert reads == []
    assert [int(layer.row_lengths()[0]) for layer in cache.layers] == [90] * len(cache.layers)


@pytest.mark.core
@pytest.mark.parametrize("forget", [False, True], ids=["kept", "forgotten"])
def test_counts_after_kernel_appends(llama, monkeypatch, forget):
    """Decode appends through a kernel, which changes `tail_len` without a version bump (simulated
    here by writing through `.data`), across a block boundary: the layer records what the kernel
    did, so neither the decode steps nor the next prompt read counts back. Once forgotten (as after
    a graph replay), the next prompt reads them back once per layer. The logits are the one-pass
    logits either way."""
    reads = counting_reads(monkeypatch)
    cache = SparseServeCache(llama.config, SparseServeConfig(block_size=SIZE))
    ids = random_ids(1, 66, seed=5)
    first, last = 2 * SIZE - 2, 2 * SIZE + 3  # decode fills the second block and starts the third
    with torch.no_grad():
        whole = llama(ids).logits
        llama(ids[:, :first], past_key_values=cache)
        store = cache.layers[0].store
        store.ops = dataclasses.replace(store.ops, append_token=append_unversioned)
        for position in range(first, last):
            llama(ids[:, position : position + 1], past_key_values=cache)
        assert reads == []
        if forget:
            for layer in cache.layers:
                layer.forget_host_counts()
        tail = llama(ids[:, last:], past_key_values=cache).logits
    assert reads == (list(range(llama.config.num_hidden_layers)) if forget else [])
    torch.testing.assert_close(tail, whole[:, last:], atol=1e-5, rtol=1e-5)


def append_unversioned(tail, tail_len, keys, values) -> None:
    """`reference.append_token` writing as a kernel does: the tensors' version counters stay."""
    reference.append_token(tail.data, tail_len.data, keys, values)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_past_with_on_cuda_reads_pinned_dram_into_token_order(llama, dtype):
    model = llama.to("cuda", dtype)
    try:
        cache = filled(model, 70)
        for layer in cache.layers:
            past_keys, past_values, _ = layer.past()
            new = torch.randn(1, past_keys.shape[1], 3, past_keys.shape[-1], device="cuda", dtype=dtype)
            keys, values = layer.past_with(new, -new)
            assert torch.equal(keys, torch.cat((past_keys, new), dim=2))
            assert torch.equal(values, torch.cat((past_values, -new), dim=2))
    finally:
        llama.to("cpu", torch.float32)
