"""The exactness ladder (budget covering the sequence = dense, unlimited HBM cache = DynamicCache, ...) on tiny random models of every supported architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from sparseserve_hf import SparseServeCache, SparseServeConfig
from tiny_models import PAD, greedy, left_pad, random_ids, tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]
GQA = [(4, 4), (6, 2), (8, 2)]  # ratios 1, 3, 4


def sparse_cache(model, **overrides) -> SparseServeCache:
    return SparseServeCache(model.config, SparseServeConfig(block_size=16, **overrides))


@pytest.mark.core
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
def test_budget_covering_the_sequence_equals_sdpa(arch, heads):
    """Budget >= length: every block is selected, so sparse decode is dense attention."""
    num_layers = 3 if arch == "gemma3" else 2
    model = tiny_model(arch, num_heads=heads[0], num_kv_heads=heads[1], num_layers=num_layers)
    ids = random_ids(1, 77)  # not a block multiple
    expected = greedy(tiny_model(arch, "sdpa", num_heads=heads[0], num_kv_heads=heads[1], num_layers=num_layers), ids)
    cache = sparse_cache(model, token_budget=1024)
    assert torch.equal(greedy(model, ids, cache), expected)
    stats = cache.stats()
    assert stats["blocks_selected"] > 0 and stats["dram_bytes"] > 0


@pytest.mark.core
def test_unlimited_hbm_cache_equals_dynamic_cache(llama):
    """Sparse decode machinery (DRAM -> HBM fetch, block gather) with every block selected."""
    ids = random_ids(2, 130)
    sdpa = tiny_model("llama", "sdpa")
    expected = greedy(sdpa, ids, DynamicCache(config=sdpa.config), max_new_tokens=40)
    cache = sparse_cache(llama, token_budget=4096, hbm_cache_bytes=None)
    assert torch.equal(greedy(llama, ids, cache, max_new_tokens=40), expected)
    assert cache.stats()["misses"] > 0  # blocks really came through the HBM cache


@pytest.mark.core
def test_decode_that_grows_the_block_table_equals_dynamic_cache(llama):
    """Rows of different lengths fill their tails at different steps, and their tables outgrow the
    first width while decoding: each roll sizes the table from the host's copy of the counts."""
    ids, mask = left_pad([random_ids(1, 38, seed=3)[0], random_ids(1, 29, seed=4)[0]])
    sdpa = tiny_model("llama", "sdpa")
    expected = greedy(sdpa, ids, DynamicCache(config=sdpa.config), attention_mask=mask, max_new_tokens=40)
    cache = SparseServeCache(llama.config, SparseServeConfig(block_size=4, token_budget=4096))
    assert torch.equal(greedy(llama, ids, cache, attention_mask=mask, max_new_tokens=40), expected)
    assert all(layer.block_ids.shape[2] > 16 for layer in cache.layers)  # grew past the first width


@pytest.mark.core
def test_small_hbm_cache_changes_transfers_not_tokens(llama):
    """LRU eviction under a tight cache must not change the output, only the traffic."""
    ids = random_ids(1, 300)
    roomy = sparse_cache(llama, token_budget=64, hbm_cache_bytes=None)
    tight = sparse_cache(
        llama, token_budget=64, hbm_cache_bytes=2 * 4 * 3 * 2 * 16 * 16 * 4
    )  # 2 layers x 4 heads x 3 blocks
    assert torch.equal(greedy(llama, ids, roomy, max_new_tokens=30), greedy(llama, ids, tight, max_new_tokens=30))
    for stats in (roomy.stats(), tight.stats()):
        assert stats["h2d_bytes"] == stats["misses"] * 2 * 16 * 16 * 4
        assert stats["hits"] + stats["misses"] == stats["blocks_selected"]
    assert tight.stats()["misses"] > roomy.stats()["misses"]
    assert tight.stats()["hbm_block_cache_bytes"] <= 2 * 4 * 3 * 2 * 16 * 16 * 4


@pytest.mark.core
def test_dram_round_trip_is_bit_exact(llama):
    """Every prompt token read back from DRAM blocks + tail equals DynamicCache's K/V exactly."""
    ids = random_ids(1, 70)
    dynamic = DynamicCache(config=llama.config)
    sdpa = tiny_model("llama", "sdpa")
    with torch.no_grad():
        sdpa(ids, past_key_values=dynamic)
        cache = sparse_cache(llama)
        llama(ids, past_key_values=cache)
    for layer, reference in zip(cache.layers, dynamic.layers):
        keys, values, valid = layer.past()
        assert valid.all() and keys.shape == reference.keys.shape
        assert torch.equal(keys, reference.keys) and torch.equal(values, reference.values)


@pytest.mark.core
@pytest.mark.parametrize("budget", [1024, 48])
def test_left_padded_batch_equals_single_runs(llama, budget):
    rows = [random_ids(1, n, seed=n)[0] for n in (150, 97, 41)]
    ids, mask = left_pad(rows)
    batched = greedy(llama, ids, sparse_cache(llama, token_budget=budget), attention_mask=mask)
    for i, row in enumerate(rows):
        alone = greedy(llama, row[None], sparse_cache(llama, token_budget=budget))
        assert torch.equal(batched[i], alone[0]), f"row {i}"


@pytest.mark.core
def test_padding_never_enters_blocks(llama):
    rows = [random_ids(1, n, seed=n)[0] for n in (64, 20)]
    ids, mask = left_pad(rows)
    cache = sparse_cache(llama)
    with torch.no_grad():
        llama(ids, attention_mask=mask, past_key_values=cache)
    layer = cache.layers[0]
    assert layer.row_lengths().tolist() == [64, 20]
    assert layer.num_blocks.tolist() == [3, 1]  # the tail keeps 1..16 tokens
    assert cache.get_seq_length() == 64


def test_multi_turn_reuse_equals_dynamic_cache(llama):
    sdpa = tiny_model("llama", "sdpa")
    first = random_ids(1, 60)
    cache, dynamic = sparse_cache(llama, token_budget=4096), DynamicCache(config=sdpa.config)
    turn1 = torch.cat((first, greedy(llama, first, cache, max_new_tokens=10)), dim=1)
    assert torch.equal(turn1, torch.cat((first, greedy(sdpa, first, dynamic, max_new_tokens=10)), dim=1))
    follow_up = torch.cat((turn1, random_ids(1, 25, seed=7)), dim=1)
    assert torch.equal(
        greedy(llama, follow_up, cache, max_new_tokens=12), greedy(sdpa, follow_up, dynamic, max_new_tokens=12)
    )
    assert cache.stats()["dense_read_bytes"] > 0  # the second prefill read the past back from DRAM


def test_two_caches_alternately_do_not_cross_talk(llama):
    a_ids, b_ids = random_ids(1, 90, seed=3), random_ids(1, 120, seed=4)
    alone_a = greedy(llama, a_ids, sparse_cache(llama, token_budget=48), max_new_tokens=8)
    alone_b = greedy(llama, b_ids, sparse_cache(llama, token_budget=48), max_new_tokens=8)
    cache_a, cache_b = sparse_cache(llama, token_budget=48), sparse_cache(llama, token_budget=48)
    tokens = {"a": [], "b": []}
    with torch.no_grad():
        next_a = llama(a_ids, past_key_values=cache_a).logits[:, -1].argmax(-1, keepdim=True)
        next_b = llama(b_ids, past_key_values=cache_b).logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(8):
            tokens["a"].append(next_a)
            tokens["b"].append(next_b)
            next_a = llama(next_a, past_key_values=cache_a).logits[:, -1].argmax(-1, keepdim=True)
            next_b = llama(next_b, past_key_values=cache_b).logits[:, -1].argmax(-1, keepdim=True)
    assert torch.equal(torch.cat(tokens["a"], 1), alone_a)
    assert torch.equal(torch.cat(tokens["b"], 1), alone_b)


def test_sampling_matches_sdpa_with_the_same_seed(llama):
    ids = random_ids(2, 50)
    kwargs = dict(max_new_tokens=16, do_sample=True, top_k=20, temperature=0.8, pad_token_id=PAD)
    sdpa, cache = tiny_model("llama", "sdpa"), sparse_cache(llama, token_budget=4096)
    torch.manual_seed(123)
    expected = sdpa.generate(ids, **kwargs)
    torch.manual_seed(123)
    assert torch.equal(llama.generate(ids, past_key_values=cache, **kwargs), expected)


def test_crop_returns_to_an_earlier_state(llama):
    ids = random_ids(1, 40)
    cache = sparse_cache(llama)
    with torch.no_grad():
        llama(ids, past_key_values=cache)
        reference = [layer.past() for layer in cache.layers]
        llama(random_ids(1, 30, seed=9), past_key_values=cache)
    assert cache.get_seq_length() == 70
    cache.crop(30)
    assert cache.get_seq_length() == 40
    for layer, (keys, values, valid) in zip(cache.layers, reference):
        got = layer.past()
        assert torch.equal(got[0], keys) and torch.equal(got[1], values) and torch.equal(got[2], valid)
    assert cache.stats()["dram_bytes"] == 2 * 2 * 2 * 2 * 16 * 16 * 4  # 2 layers x 2 kv heads x 2 blocks


def test_reset_frees_every_block(llama):
    cache = sparse_cache(llama, token_budget=48)
    greedy(llama, random_ids(2, 100), cache, max_new_tokens=5)
    assert cache.stats()["dram_bytes"] > 0
    cache.reset()
    stats = cache.stats()
    assert stats["dram_bytes"] == 0 and stats["hbm_block_cache_bytes"] == 0 and cache.get_seq_length() == 0
    assert cache.store.dram.num_used == 0


@pytest.mark.core
@pytest.mark.parametrize("budget", [4096, 48])
def test_beam_search_shares_blocks_and_matches_sdpa(llama, budget):
    """Beam search reorders rows every step: rows then share past blocks (reference counted)."""
    ids = random_ids(2, 70)
    kwargs = dict(num_beams=3, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    cache = sparse_cache(llama, token_budget=budget)
    with torch.no_grad():
        got = llama.generate(ids, past_key_values=cache, **kwargs)
        if budget >= 4096:
            assert torch.equal(got, tiny_model("llama", "sdpa").generate(ids, **kwargs))
    layer = cache.layers[0]
    live = layer.block_ids[layer.block_ids >= 0]
    refcount = cache.store.dram.refcount
    assert torch.equal(refcount[live.unique()], torch.bincount(live.cpu())[live.unique()].int())
    cache.reset()
    assert cache.store.dram.num_used == 0 and int(cache.store.dram.refcount.sum()) == 0
