"""Bad input gets a clear error and leaves the cache as it was, still usable."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config

from sparseserve_hf import SparseServeCache, SparseServeConfig
from tiny_models import greedy, random_ids, tiny_config, tiny_model


def snapshot(cache: SparseServeCache) -> tuple:
    stats = cache.stats()
    return cache.get_seq_length(), stats["dram_bytes"], stats["hbm_bytes"], cache.store.dram.num_used


@pytest.mark.core
def test_unsupported_architecture():
    with pytest.raises(NotImplementedError, match="gpt2"):
        SparseServeCache(GPT2Config(), SparseServeConfig())


@pytest.mark.core
def test_dense_layers_out_of_range():
    with pytest.raises(ValueError, match="dense_layers"):
        SparseServeCache(tiny_config(), SparseServeConfig(dense_layers=(5,)))


def test_backend_not_built_yet_fails_at_construction(monkeypatch):
    # tests/ops' conftest turns Triton's CPU interpreter on for the whole session, which would make
    # backend="triton" valid on CPU: this test is about the plain CPU machine.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(NotImplementedError, match="triton"):
        SparseServeCache(tiny_config(), SparseServeConfig(backend="triton"))


@pytest.mark.core
def test_hbm_cache_smaller_than_one_selection():
    with pytest.raises(ValueError, match="hbm_cache_bytes"):
        SparseServeCache(tiny_config(), SparseServeConfig(block_size=16, token_budget=64, hbm_cache_bytes=4096))


def test_batch_too_large_for_the_hbm_cache_is_rejected_before_any_change(llama):
    # 4 query heads x 3 selected blocks x 2 KiB fp32 head-blocks: room for one request, not four.
    config = SparseServeConfig(block_size=16, token_budget=64, hbm_cache_bytes=12 * 2048)
    cache = SparseServeCache(llama.config, config)
    with pytest.raises(ValueError, match="4 request"):
        greedy(llama, random_ids(4, 100), cache)
    assert cache.get_seq_length() == 0
    assert greedy(llama, random_ids(1, 100), cache).shape == (1, 24)


@pytest.mark.core
def test_prompt_past_max_position_embeddings(llama):
    cache = SparseServeCache(llama.config, SparseServeConfig(block_size=16, token_budget=64))
    ids = random_ids(1, 100)
    with torch.no_grad():
        llama(ids, past_key_values=cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="max_position_embeddings"), torch.no_grad():
        llama(random_ids(1, 2000), past_key_values=cache)
    assert snapshot(cache) == before
    with torch.no_grad():
        llama(random_ids(1, 5), past_key_values=cache)  # still usable
    assert cache.get_seq_length() == 105


@pytest.mark.core
def test_dtype_mix_is_rejected_and_the_cache_keeps_working(llama):
    cache = SparseServeCache(llama.config, SparseServeConfig(block_size=16, token_budget=64))
    with torch.no_grad():
        llama(random_ids(1, 60), past_key_values=cache)
    before = snapshot(cache)
    half = tiny_model("llama").to(torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"), torch.no_grad():
        half(random_ids(1, 4), past_key_values=cache)
    assert snapshot(cache) == before
    with torch.no_grad():
        llama(random_ids(1, 4), past_key_values=cache)
    assert cache.get_seq_length() == 64


def test_cache_with_a_non_sparseserve_model_fails_loudly():
    model = tiny_model("llama", "sdpa")
    cache = SparseServeCache(model.config, SparseServeConfig(block_size=16, token_budget=64))
    with torch.no_grad():
        model(random_ids(1, 40), past_key_values=cache)
        with pytest.raises(RuntimeError, match="attn_implementation='sparseserve'"):
            model(random_ids(1, 1), past_key_values=cache)
