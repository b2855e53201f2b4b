"""Which layers a SparseServeCache makes sparse: transformers' own attention-type rules per config."""

from __future__ import annotations

import pytest
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.cache import SparseServeLayer
from sparseserve_hf.cache.cache import attention_layer_types
from tiny_models import tiny_config

FULL, SLIDING = "full_attention", "sliding_attention"


def qwen_config(arch: str, **overrides):
    """tiny_config(arch, num_layers=3) rebuilt with `overrides`, so the config class derives layer_types."""
    base = tiny_config(arch, num_layers=3)
    return type(base)(**(base.to_dict() | overrides))


def kinds(cache) -> list[str]:
    return [SLIDING if isinstance(layer, DynamicSlidingWindowLayer) else FULL for layer in cache.layers]


@pytest.mark.core
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_without_sliding_window_is_all_full_attention(arch):
    config = tiny_config(arch, num_layers=3)
    config.max_window_layers = 1  # would matter only with use_sliding_window=True
    assert config.use_sliding_window is False
    cache = SparseServeCache(config, SparseServeConfig(block_size=16))
    assert all(isinstance(layer, SparseServeLayer) for layer in cache.layers)
    assert attention_layer_types(config) == [FULL] * 3


@pytest.mark.core
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_sliding_window_starts_at_max_window_layers(arch):
    config = qwen_config(arch, use_sliding_window=True, sliding_window=24, max_window_layers=1, layer_types=None)
    assert attention_layer_types(config) == [FULL, SLIDING, SLIDING]
    cache = SparseServeCache(config, SparseServeConfig(block_size=16))
    assert kinds(cache) == kinds(DynamicCache(config=config)) == [FULL, SLIDING, SLIDING]
    config.layer_types = None  # a config written without the field: the same rule applies
    assert attention_layer_types(config) == [FULL, SLIDING, SLIDING]
    config.use_sliding_window = False
    assert attention_layer_types(config) == [FULL] * 3


@pytest.mark.core
def test_mistral_global_window_makes_every_layer_sliding_like_dynamic_cache():
    config = tiny_config("mistral", num_layers=3)
    assert attention_layer_types(config) == [FULL] * 3  # sliding_window=None: Mistral v0.2+
    config.sliding_window = 24
    cache = SparseServeCache(config, SparseServeConfig(block_size=16))
    assert kinds(cache) == kinds(DynamicCache(config=config)) == [SLIDING] * 3
    assert all(layer.sliding_window == 24 for layer in cache.layers)


@pytest.mark.core
def test_llama_and_gemma3_layer_types():
    assert attention_layer_types(tiny_config("llama", num_layers=2)) == [FULL, FULL]
    assert attention_layer_types(tiny_config("gemma3", num_layers=3)) == [SLIDING, FULL, SLIDING]
