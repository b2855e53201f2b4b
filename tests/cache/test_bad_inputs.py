"""Bad input gets a clear error and leaves the cache as it was, still usable."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GPT2Config

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
    # 2 layers x 2 KV heads, each partition 2 query heads x 3 selected blocks x 2 KiB fp32 head-blocks:
    # room for one request, not four.
    config = SparseServeConfig(block_size=16, token_budget=64, hbm_cache_bytes=4 * 6 * 2048)
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


# ---- the cache's arguments -----------------------------------------------------------------------


@pytest.mark.core
@pytest.mark.parametrize("bad", [None, {"model_type": "llama"}, "llama", 3], ids=["none", "dict", "str", "int"])
def test_model_config_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="model_config"):
        SparseServeCache(bad, SparseServeConfig())


@pytest.mark.core
def test_a_model_in_place_of_its_config_is_taken_by_its_config(llama):
    cache = SparseServeCache(llama, SparseServeConfig(block_size=16, token_budget=64))
    assert cache.model_config is llama.config
    assert greedy(llama, random_ids(1, 40), cache).shape == (1, 24)


@pytest.mark.core
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(config={"token_budget": 64}), "config"),
        (dict(config="default"), "config"),
        (dict(store=object()), "store"),
    ],
)
def test_config_and_store_of_the_wrong_type_are_type_errors(kwargs, name):
    with pytest.raises(TypeError, match=name):
        SparseServeCache(tiny_config(), **kwargs)


@pytest.mark.core
def test_dram_bytes_below_one_head_block_is_refused_up_front():
    with pytest.raises(ValueError, match="dram_bytes"):
        SparseServeCache(tiny_config(), SparseServeConfig(dram_bytes=100))


# ---- host memory ---------------------------------------------------------------------------------


def host_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))


@pytest.mark.core
def test_dram_bytes_beyond_the_host_memory_is_refused_at_construction():
    """Refused before anything is allocated: a pinned pool that size would meet the OOM killer, not an error."""
    config = SparseServeConfig(dram_bytes=2 * host_bytes())
    with pytest.raises(ValueError, match="dram_bytes"):
        SparseServeCache(tiny_config(), config)


def test_dram_bytes_beyond_the_host_memory_is_refused_by_the_generator(llama):
    from sparseserve_hf.generation import Generator

    with pytest.raises(ValueError, match="dram_bytes"):
        Generator(llama, None, SparseServeConfig(block_size=16, token_budget=64, dram_bytes=2 * host_bytes()))


def test_a_growing_pool_refuses_to_outgrow_the_host(llama, monkeypatch):
    """dram_bytes=None grows the pool: growth past the available memory is an error, and the cache stays as it was."""
    cache = SparseServeCache(llama.config, SparseServeConfig(block_size=16, token_budget=64))
    with torch.no_grad():
        llama(random_ids(1, 100), past_key_values=cache)
    before = snapshot(cache)
    pool_bytes = cache.store.dram.capacity * cache.store.dram.block_bytes
    monkeypatch.setattr("sparseserve_hf.host_memory.available_host_bytes", lambda: pool_bytes)  # no room to double
    with pytest.raises(ValueError, match="growing DRAM pool"), torch.no_grad():
        llama(random_ids(1, 1500, seed=2), past_key_values=cache)
    assert snapshot(cache) == before
    monkeypatch.undo()
    with torch.no_grad():
        llama(random_ids(1, 5), past_key_values=cache)
    assert cache.get_seq_length() == 105


# ---- a cache built for another model ---------------------------------------------------------------


def model_with(**fields):
    """The tiny Llama with config fields changed (a model the `llama` fixture's cache was not built for)."""
    config = tiny_config()
    for name, value in fields.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sparseserve").eval()


@pytest.mark.core
@pytest.mark.parametrize("used", [False, True], ids=["fresh", "used"])
@pytest.mark.parametrize("dense", [(), (0,)], ids=["sparse", "dense-layer-0"])
@pytest.mark.parametrize(
    "fields",
    [
        dict(num_hidden_layers=3),  # a model deeper than the cache: transformers' IndexError at layer 2 before
        dict(num_key_value_heads=4),
        dict(head_dim=32),
        dict(max_position_embeddings=4096),  # the cache would refuse prompts by the wrong limit
    ],
    ids=lambda fields: next(iter(fields)),
)
def test_a_model_of_another_shape_is_refused_at_layer_0_and_the_cache_keeps_working(llama, fields, dense, used):
    config = SparseServeConfig(block_size=16, token_budget=1024, dense_layers=dense)  # every block: tokens are dense
    cache = SparseServeCache(llama.config, config)
    if used:
        greedy(llama, random_ids(1, 60), cache, max_new_tokens=4)
    before = (cache.get_seq_length(), cache.stats()["dram_bytes"], [layer.is_initialized for layer in cache.layers])
    name = next(iter(fields))
    with pytest.raises(ValueError, match=f"{name}|KV heads"):
        greedy(model_with(**fields), random_ids(1, 100, seed=2), cache, max_new_tokens=2)  # continues the past
    assert (cache.get_seq_length(), cache.stats()["dram_bytes"], [layer.is_initialized for layer in cache.layers]) == (
        before
    )
    cache.reset()
    stats = cache.stats()
    assert (stats["dram_bytes"], stats["hbm_bytes"]) == (0, 0)
    ids = random_ids(1, 70, seed=3)
    expected = greedy(llama, ids, DynamicCache(config=llama.config), max_new_tokens=6)
    assert torch.equal(greedy(llama, ids, cache, max_new_tokens=6), expected)  # still right


def test_a_refused_forward_leaves_a_sliding_window_layer_0_as_it_was():
    """Gemma-3's layer 0 is a sliding-window layer (a DynamicSlidingWindowLayer): it takes the new keys
    before the attention function can look at the model; the refusal puts its window back."""
    gemma = tiny_model("gemma3", num_layers=3)
    cache = SparseServeCache(gemma.config, SparseServeConfig(block_size=16, token_budget=1024))
    ids = random_ids(1, 60)
    greedy(gemma, ids, cache, max_new_tokens=4)
    window = cache.layers[0]
    before = (cache.get_seq_length(), window.keys, window.values, cache.stats()["dram_bytes"])
    with pytest.raises(ValueError, match="num_hidden_layers"):
        greedy(tiny_model("gemma3", num_layers=5), random_ids(1, 100, seed=2), cache)
    assert (cache.get_seq_length(), window.keys, window.values, cache.stats()["dram_bytes"]) == before
    cache.reset()
    assert torch.equal(greedy(gemma, ids, cache), greedy(tiny_model("gemma3", "sdpa", num_layers=3), ids))


# ---- max_position_embeddings ----------------------------------------------------------------------


@pytest.mark.core
def test_decode_runs_past_max_position_embeddings_as_stock_does_with_one_warning(caplog):
    """Nothing the cache stores is sized by max_position_embeddings: decode goes on past it, as stock does."""
    model = model_with(max_position_embeddings=64)
    ids = random_ids(1, 62)  # 62 + 10 new tokens: the last steps sit at positions 64..71
    expected = greedy(model, ids, DynamicCache(config=model.config), max_new_tokens=10)
    cache = SparseServeCache(model.config, SparseServeConfig(block_size=16, token_budget=1024))
    with caplog.at_level(logging.WARNING, logger="sparseserve_hf"):
        got = greedy(model, ids, cache, max_new_tokens=10)
    assert torch.equal(got, expected)
    ours = [r for r in caplog.records if r.name.startswith("sparseserve_hf") and "max_position_embeddings" in r.message]
    assert len(ours) == 1
    with pytest.raises(ValueError, match="max_position_embeddings"), torch.no_grad():
        model(random_ids(1, 4, seed=2), past_key_values=cache)  # a prompt past the limit: refused before any work
    assert cache.get_seq_length() == 71
