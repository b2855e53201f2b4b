"""Failures inside the cache leave it as it was: no leaked block, no layer ahead of the others.

Faults are injected through the store's public seams (its op set and its `fetch`), the way a
failing D2H copy or a device error would surface, then the cache is checked through the public
API: `stats()`, `get_seq_length()`, `reset()`, and tokens against `DynamicCache`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.generation import Generator, SamplingParams
from tiny_models import PAD, random_ids

CONFIG = SparseServeConfig(block_size=16, token_budget=4096)  # every block selected: tokens equal dense


class Fault(RuntimeError):
    """The injected failure."""


def fail_on_call(fn, call: int):
    """`fn`, except that its `call`-th call (1-based) raises Fault; every other call goes through."""
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise Fault(f"injected fault on call {call}")
        return fn(*args, **kwargs)

    return wrapped


def fail_scatter(store, call: int = 1) -> None:
    """Make the store's `call`-th DRAM scatter fail (after the save allocated its block ids)."""
    store.ops = replace(store.ops, scatter_blocks=fail_on_call(store.ops.scatter_blocks, call))


def generate(model, ids, cache, max_new_tokens: int = 6) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD
        )


def state(cache: SparseServeCache) -> tuple:
    """Everything a failed update must leave as it was."""
    stats = cache.stats()
    layers = tuple((layer.num_positions, tuple(layer.row_lengths().tolist())) for layer in cache.layers)
    return cache.get_seq_length(), stats["dram_bytes"], stats["hbm_metadata_bytes"], stats["hbm_tail_bytes"], layers


def assert_empty(cache: SparseServeCache) -> None:
    stats = cache.stats()
    assert (stats["dram_bytes"], stats["hbm_metadata_bytes"], stats["hbm_bytes"]) == (0, 0, 0)
    assert cache.store.dram.num_used == 0


@pytest.mark.core
def test_a_failed_save_leaks_no_block_and_reset_empties_the_cache(llama):
    cache = SparseServeCache(llama.config, CONFIG)
    first = generate(llama, random_ids(1, 60), cache)
    before = state(cache)
    fail_scatter(cache.store)
    follow_up = torch.cat((first, random_ids(1, 40, seed=2)), dim=1)  # a second turn over the past
    with pytest.raises(Fault):
        generate(llama, follow_up, cache)
    assert state(cache) == before  # the failed save's ids went back: no block is held by nobody
    cache.reset()
    assert_empty(cache)
    expected = generate(llama, follow_up, DynamicCache(config=llama.config))
    assert torch.equal(generate(llama, follow_up, cache), expected)  # usable, and right


@pytest.mark.core
def test_a_save_failing_at_a_later_layer_undoes_the_earlier_layers(llama):
    cache, dynamic = SparseServeCache(llama.config, CONFIG), DynamicCache(config=llama.config)
    ids = random_ids(1, 70)
    first = generate(llama, ids, cache)
    assert torch.equal(first, generate(llama, ids, dynamic))
    before = state(cache)
    fail_scatter(cache.store, call=2)  # layer 0 saves its blocks, layer 1's save fails
    follow_up = torch.cat((first, random_ids(1, 50, seed=3)), dim=1)
    with pytest.raises(Fault):
        generate(llama, follow_up, cache)
    assert state(cache) == before  # layer 0 gave its new blocks back too: get_seq_length did not move
    assert torch.equal(generate(llama, follow_up, cache), generate(llama, follow_up, dynamic))


@pytest.mark.core
def test_a_decode_step_failing_after_its_commit_is_undone_in_every_layer(llama, monkeypatch):
    cache = SparseServeCache(llama.config, CONFIG)
    ids = random_ids(1, 70)
    with torch.no_grad():
        llama(ids, past_key_values=cache)
    before = state(cache)
    # The first decode step: layer 0 commits and attends, layer 1 commits, then its block fetch fails.
    monkeypatch.setattr(cache.store, "fetch", fail_on_call(cache.store.fetch, 2))
    with pytest.raises(Fault), torch.no_grad():
        llama(random_ids(1, 1, seed=4), past_key_values=cache)
    assert state(cache) == before
    dynamic = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(ids, past_key_values=dynamic)
    for layer, reference in zip(cache.layers, dynamic.layers):
        keys, values, _ = layer.past()
        assert torch.equal(keys, reference.keys) and torch.equal(values, reference.values)
    monkeypatch.undo()
    assert torch.equal(generate(llama, ids, cache), generate(llama, ids, DynamicCache(config=llama.config)))


@pytest.mark.core
@pytest.mark.parametrize("at", ["prefill", "decode"])
def test_a_failed_save_in_the_generator_leaves_no_dram_in_use(llama, at):
    gen = Generator(llama, None, replace(CONFIG, token_budget=48))
    params = SamplingParams(max_new_tokens=30)
    for seed in (1, 2):
        gen.submit(random_ids(1, 40, seed=seed)[0].tolist(), params)
    finished = []
    if at == "decode":  # run until both prompts are prefilled and decoding, then break the next save
        started: set[int] = set()
        while len(started) < 2:
            events = gen.step()
            started |= {event.request_id for event in events}
            finished += [event for event in events if event.finished]
    fail_scatter(gen.store)
    while gen.has_unfinished:
        finished += [event for event in gen.step() if event.finished]
    assert any(event.output.finish_reason == "error" for event in finished)  # the fault did hit a request
    assert gen.dram_bytes_in_use() == 0


@pytest.mark.core
def test_a_failed_block_load_leaves_no_slot_claiming_the_block(llama, monkeypatch):
    """The HBM lookup assigns slots to its misses before copying them in: if the copy fails, those
    slots must not stay resident, or the next step would attend to whatever they held."""
    config = SparseServeConfig(block_size=16, token_budget=1024, hbm_cache_bytes=1 << 20)  # a bounded LRU
    cache, ids = SparseServeCache(llama.config, config), random_ids(1, 70)
    with torch.no_grad():
        llama(ids, past_key_values=cache)
    hbm = cache.store.hbm
    monkeypatch.setattr(hbm, "gather_blocks", fail_on_call(hbm.gather_blocks, 1))  # the first decode load
    with pytest.raises(Fault), torch.no_grad():
        llama(random_ids(1, 1, seed=4), past_key_values=cache)
    assert cache.stats()["hbm_block_cache_bytes"] == 0  # nothing was loaded, so nothing is resident
    monkeypatch.undo()
    cache.reset()
    assert torch.equal(generate(llama, ids, cache), generate(llama, ids, DynamicCache(config=llama.config)))


@pytest.mark.core
def test_a_reset_failing_in_one_layer_still_frees_the_others_and_a_second_reset_frees_all(llama, monkeypatch):
    config = SparseServeConfig(block_size=16, token_budget=1024, hbm_cache_bytes=1 << 20)  # a bounded LRU
    cache, ids = SparseServeCache(llama.config, config), random_ids(1, 70)
    generate(llama, ids, cache)
    store = cache.store
    monkeypatch.setattr(store.hbm, "invalidate", fail_on_call(store.hbm.invalidate, 1))
    with pytest.raises(Fault):
        cache.reset()  # layer 0's blocks stay (and stay resident), layer 1's are freed
    assert 0 < store.dram.num_used
    cache.reset()
    assert_empty(cache)
    assert torch.equal(generate(llama, ids, cache), generate(llama, ids, DynamicCache(config=llama.config)))
