"""The exactness ladder with backend="triton".

On CPU it runs under Triton's interpreter with fp32 (tests/ops/conftest.py sets TRITON_INTERPRET);
on the GPU the kernels are compiled and bf16 is checked against SDPA in bf16 too.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import tiny_models
from kernel_support import DEVICE
from sparseserve_hf import SparseServeCache, SparseServeConfig
from tiny_models import greedy, tiny_model


def tiny_llama(attn: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A 2-layer llama with head_dim 16 and GQA 3 (6 query / 2 KV heads), fixed seed, on the kernels' device."""
    return tiny_model("llama", attn, num_heads=6, num_kv_heads=2).to(DEVICE, dtype)


def random_ids(batch: int, length: int) -> torch.Tensor:
    return tiny_models.random_ids(batch, length).to(DEVICE)


def triton_cache(model, **overrides) -> SparseServeCache:
    cache = SparseServeCache(model.config, SparseServeConfig(block_size=16, backend="triton", **overrides))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else []), ids=str)
def test_budget_covering_the_sequence_equals_sdpa(dtype):
    model, sdpa = tiny_llama("sparseserve", dtype), tiny_llama("sdpa", dtype)
    ids = random_ids(2, 45)  # not a block multiple
    cache = triton_cache(model, token_budget=1024)
    assert torch.equal(greedy(model, ids, cache, max_new_tokens=8), greedy(sdpa, ids, max_new_tokens=8))
    assert cache.store.ops.name == "triton" and cache.stats()["misses"] > 0


def test_unlimited_hbm_cache_equals_dynamic_cache():
    model, sdpa = tiny_llama("sparseserve"), tiny_llama("sdpa")
    ids = random_ids(1, 60)
    cache = triton_cache(model, token_budget=4096, hbm_cache_bytes=None)
    assert torch.equal(
        greedy(model, ids, cache, max_new_tokens=10),
        greedy(sdpa, ids, DynamicCache(config=sdpa.config), max_new_tokens=10),
    )


def test_small_budget_triton_equals_torch_backend():
    """Below the length: the Triton path selects and attends exactly as the reference path."""
    model = tiny_llama("sparseserve")
    ids = random_ids(1, 150)
    caches = {
        backend: SparseServeCache(
            model.config, SparseServeConfig(block_size=16, token_budget=64, backend=backend, hbm_cache_bytes=1 << 17)
        )
        for backend in ("torch", "triton")
    }
    tokens = {backend: greedy(model, ids, cache, max_new_tokens=6) for backend, cache in caches.items()}
    assert torch.equal(tokens["triton"], tokens["torch"])
    for torch_layer, triton_layer in zip(caches["torch"].layers, caches["triton"].layers):
        assert torch.equal(torch_layer.last_selection, triton_layer.last_selection)


def test_lookup_beside_attention_keeps_the_static_steps_tokens_and_counts(monkeypatch):
    """The static decode step (what a CUDA graph captures; run eagerly here) with the Triton kernels:
    attending the resident blocks while the lookup runs, then the misses, with the eviction order's
    upkeep in the install or in a launch of its own, gives the tokens and hit/miss counts of the step
    that looks up first (the first steps miss, later ones hit)."""
    from sparseserve_hf.cache import block_cache
    from sparseserve_hf.graph import StaticDecoder

    model = tiny_llama("sparseserve")
    ids = random_ids(2, 120)
    runs = []
    for beside, reorder_beside in ((True, False), (True, True), (False, False)):
        monkeypatch.setattr(block_cache, "REORDER_BESIDE", reorder_beside)
        cache = triton_cache(model, token_budget=48, hbm_cache_bytes=72 * 2048, lookup_beside_attention=beside)
        with torch.no_grad():
            first = model(ids, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        assert cache.store.lookup_beside == beside
        assert (cache.store.hbm.reorder is not None) == reorder_beside
        runner = StaticDecoder(model, cache, capture=False)
        runner.start(first)
        tokens = torch.cat([runner.step().clone() for _ in range(5)], dim=1)
        stats = cache.stats()
        runs.append((tokens, stats["hits"], stats["misses"]))
    assert all(torch.equal(run[0], runs[0][0]) and run[1:] == runs[0][1:] for run in runs[1:])
    assert 0 < runs[0][2] < runs[0][1]


CHANNELS = dict(metadata="channels", selection="kv_head", group_aggregation="sum")


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else []), ids=str)
def test_channel_scores_budget_covering_the_sequence_equals_sdpa(dtype):
    model, sdpa = tiny_llama("sparseserve", dtype), tiny_llama("sdpa", dtype)
    ids = random_ids(2, 45)
    cache = triton_cache(model, token_budget=1024, **CHANNELS)
    assert torch.equal(greedy(model, ids, cache, max_new_tokens=8), greedy(sdpa, ids, max_new_tokens=8))


@pytest.mark.parametrize("feedback", [False, True], ids=["estimates", "fed_back"])
def test_channel_scores_pick_what_the_torch_path_picks(feedback):
    """A small budget over a longer prompt: the Triton channel scores (and their chain: feedback, softmax,
    the KV head's top-k) select as the PyTorch ops do, so the tokens are the same."""
    model = tiny_llama("sparseserve")
    ids = random_ids(1, 200)
    fields = dict(CHANNELS, channel_feedback=feedback)
    triton_tokens = greedy(model, ids, triton_cache(model, token_budget=48, **fields), max_new_tokens=10)
    torch_cache = SparseServeCache(
        model.config, SparseServeConfig(block_size=16, backend="torch", token_budget=48, **fields)
    )
    assert torch.equal(triton_tokens, greedy(model, ids, torch_cache, max_new_tokens=10))
