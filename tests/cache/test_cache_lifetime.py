"""A SparseServeCache is no reference cycle: dropping it frees its store (and DRAM pool) at once.

The pool can be tens of GiB of pinned memory; released only by the cyclic collector, the pools of
a few finished batches would pile up until pinning fails. These tests run with the cyclic
collector off, so only reference counting can free the store.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from tiny_models import greedy, random_ids, tiny_model


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    gc.collect()  # start from a clean slate: nothing left over from earlier tests
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.core
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("llama", {"dense_layers": (0,)}),
        ("gemma3", {}),
        ("llama", {"save_path": "flash_d2h"}),  # the saver's CPU threads must not pin the store either
        ("llama", {"offload": False, "transfer": "copy"}),
    ],
    ids=["llama", "dense-layer", "gemma3-sliding", "flash-d2h", "no-offload-copy"],
)
def test_deleting_a_used_cache_frees_its_store_without_gc(no_cyclic_gc, arch, overrides):
    model = tiny_model(arch, num_layers=3 if arch == "gemma3" else 2)
    cache = SparseServeCache(model.config, SparseServeConfig(block_size=16, token_budget=48, **overrides))
    greedy(model, random_ids(2, 100), cache, max_new_tokens=6)
    store, pool = weakref.ref(cache.store), weakref.ref(cache.store.dram.storage)
    assert cache.store.dram.num_used > 0  # the pool holds blocks (on the device with offload=False)
    del cache
    assert store() is None, "the store outlived its cache: something still refers to it (a reference cycle?)"
    assert pool() is None


def test_a_shared_store_outlives_the_caches_over_it(no_cyclic_gc):
    model = tiny_model("llama")
    config = SparseServeConfig(block_size=16, token_budget=48)
    owner = SparseServeCache(model.config, config)
    greedy(model, random_ids(1, 40), owner, max_new_tokens=2)
    moved = owner.pop_rows([0])  # a second cache over the same store
    store = weakref.ref(owner.store)
    moved.reset()
    del moved
    assert store() is owner.store
    del owner
    assert store() is None


@pytest.mark.core
def test_a_prompt_grows_a_growable_pool_once_and_decodes_as_before():
    """4 rows x 1000 tokens fill 992 head-blocks over 2 layers: grown block by block, the pool of
    256 would double twice during the prefill (each a pinned reallocation and a copy); reserved
    at the first layer it grows once. The tokens are those of a fixed pool."""
    model = tiny_model("llama")
    ids = random_ids(4, 1000)
    growing = SparseServeCache(model.config, SparseServeConfig(block_size=16, token_budget=64))
    with torch.no_grad():
        model(ids[:, :1], past_key_values=growing)  # one token: the store exists, nothing reserved
    store = growing.store
    grown, capacity = store.hbm.reallocations, store.dram.capacity  # its block map grows with the pool
    growing.reset()
    with torch.no_grad():
        model(ids, past_key_values=growing)
    assert store.hbm.reallocations == grown + 1 and store.dram.capacity >= 992 > capacity
    growing.reset()
    fixed = SparseServeCache(model.config, SparseServeConfig(block_size=16, token_budget=64, dram_bytes=1 << 24))
    assert torch.equal(greedy(model, ids, fixed, max_new_tokens=6), greedy(model, ids, growing, max_new_tokens=6))


@pytest.mark.core
def test_a_pool_grown_by_a_prompt_under_inference_mode_works_outside_it():
    """`generate` may run under torch.inference_mode (pipelines do): the pool the prompt's
    reservation grew must be a plain tensor, or the next forward outside it cannot write it."""
    model = tiny_model("llama")
    cache = SparseServeCache(model.config, SparseServeConfig(block_size=16, token_budget=64))
    ids = random_ids(4, 1000)
    with torch.inference_mode():
        model(ids[:, :1], past_key_values=cache)
        cache.reset()
        model(ids, past_key_values=cache)
    with torch.no_grad():
        model(ids[:, :1], past_key_values=cache)
    assert not cache.store.dram.refcount.is_inference() and not cache.store.dram.storage.is_inference()
