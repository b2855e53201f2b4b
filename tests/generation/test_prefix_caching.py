"""Prefix reuse in the Generator (`prefix_caching=True`): the same tokens for less prefill, and no block leaks."""

from __future__ import annotations

import pytest
import torch
from gen_support import prompt

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig

BLOCK = 16
DOC = prompt(150, seed=7)  # ~9 blocks: past the budget, so decode selects
QUESTIONS = [prompt(n, seed=100 + n) for n in (9, 21, 4, 16)]
PARAMS = SamplingParams(max_new_tokens=12)


def config(**overrides) -> SparseServeConfig:
    return SparseServeConfig(**(dict(block_size=BLOCK, token_budget=48) | overrides))


def served_one_after_another(model, cfg: SparseServeConfig, prompts) -> tuple[list[tuple[int, ...]], Generator]:
    gen = Generator(model, None, cfg)
    return [gen.generate([p], PARAMS)[0].token_ids for p in prompts], gen


@pytest.mark.core
def test_questions_over_one_document_give_the_unshared_tokens_for_one_prefill(llama):
    prompts = [DOC + q for q in QUESTIONS]
    want, _ = served_one_after_another(llama, config(), prompts)
    got, gen = served_one_after_another(llama, config(prefix_caching=True), prompts)
    assert got == want
    totals = gen.metrics()["totals"]
    doc_blocks = len(DOC) // BLOCK  # whole blocks of the document: the shared part
    assert totals["prefix_lookups"] == 4 and totals["prefix_hits"] == 3
    assert totals["prefix_reused_tokens"] == 3 * doc_blocks * BLOCK
    layer_work = gen.metrics()["totals"]["prefill_token_layers"]
    _, plain = served_one_after_another(llama, config(), prompts)
    assert layer_work < plain.metrics()["totals"]["prefill_token_layers"] * 0.5  # the document ran once


@pytest.mark.core
def test_requests_in_flight_together_share_what_finished_prefill_before_them(llama):
    prompts = [DOC + q for q in QUESTIONS]
    want = [o.token_ids for o in Generator(llama, None, config()).generate(prompts, PARAMS)]
    gen = Generator(llama, None, config(prefix_caching=True, max_inject_tokens=200))
    assert [o.token_ids for o in gen.generate(prompts, PARAMS)] == want
    assert gen.metrics()["totals"]["prefix_hits"] >= 1


def test_a_chat_turn_reuses_the_previous_turns_prompt_and_answer(llama):
    gen = Generator(llama, None, config(prefix_caching=True))
    first = gen.generate([DOC], SamplingParams(max_new_tokens=40))[0]
    turn = DOC + list(first.token_ids) + QUESTIONS[0]
    reused_before = gen.metrics()["totals"]["prefix_reused_tokens"]
    got = gen.generate([turn], PARAMS)[0].token_ids
    assert got == Generator(llama, None, config()).generate([turn], PARAMS)[0].token_ids
    fed = len(DOC) + len(first.token_ids) - 1  # the last answer token's KV was never computed
    assert gen.metrics()["totals"]["prefix_reused_tokens"] - reused_before == fed // BLOCK * BLOCK


def test_a_prompt_that_ends_one_token_past_cached_blocks_prefills_a_whole_block_and_that_token(llama):
    gen = Generator(llama, None, config(prefix_caching=True))
    gen.generate([DOC], PARAMS)
    whole = len(DOC) // BLOCK * BLOCK
    turn = DOC[:whole] + [QUESTIONS[0][0]]  # every block but the last token cached
    got = gen.generate([turn], PARAMS)[0].token_ids
    assert got == Generator(llama, None, config()).generate([turn], PARAMS)[0].token_ids
    assert gen.metrics()["totals"]["prefix_reused_tokens"] == whole - BLOCK  # one block given back


def test_a_small_pool_drops_cached_prefixes_and_serves_every_request(llama):
    """A fixed pool that holds a few requests at a time: cached blocks make room, nothing leaks."""
    block_bytes = 2 * BLOCK * 16 * 4  # one head-block: K and V, 16 tokens x head_dim 16, fp32
    cfg = config(prefix_caching=True, dram_bytes=2 * 2 * 2 * 16 * block_bytes, max_batch=2)  # 16 blocks x 2 requests
    prompts = [prompt(150, seed=s) + q for s, q in zip((1, 2, 3, 4), QUESTIONS)] * 2  # 4 documents, twice
    want, _ = served_one_after_another(llama, config(dram_bytes=cfg.dram_bytes), prompts)
    gen = Generator(llama, None, cfg)
    outs = gen.generate(prompts, PARAMS)
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    assert [o.token_ids for o in outs] == want
    store = gen.store
    held = gen.prefixes.index.num_entries * 2 * 2  # entries x layers x KV heads
    assert store.dram.num_used == held and store.dram.num_used <= store.dram.capacity
    gen.prefixes.index.clear()
    assert store.dram.num_used == 0  # every block was referenced by the index alone


def test_prefix_caching_refuses_dense_layers():
    with pytest.raises(ValueError, match="prefix_caching=True .* dense_layers"):
        SparseServeConfig(prefix_caching=True, dense_layers=[0])
    with pytest.raises(ValueError, match="prefix_caching must be a bool"):
        SparseServeConfig(prefix_caching=1)


def test_requests_sharing_a_document_reserve_its_blocks_once(llama):
    cfg = config(prefix_caching=True, dram_bytes=400 * 2 * BLOCK * 16 * 4)  # a fixed pool: DRAM is reserved
    gen = Generator(llama, None, cfg)
    gen.generate([DOC + QUESTIONS[0]], PARAMS)
    prompts = [DOC + q for q in QUESTIONS[1:3]]
    for p in prompts:
        gen.submit(p, PARAMS)
    gen.step()  # both admitted; each adopts the document's blocks
    shared = len(DOC) // BLOCK * 2 * 2  # document blocks x layers x KV heads
    lifetimes = [gen.sizes.lifetime_dram_blocks(len(p) + PARAMS.max_new_tokens) for p in prompts]
    assert gen.prefixes.index.pinned_blocks() == shared
    assert gen._limits().dram_free_blocks == gen.store.dram.capacity - (sum(lifetimes) - shared)


@pytest.mark.core
def test_channel_scores_keep_the_channels_a_shared_block_was_written_with(llama):
    """Channel metadata describes its own block (its channels chosen under the prompt that wrote it):
    requests adopting another's document score those blocks as written, and serve their answers."""
    cfg = config(metadata="channels", selection="kv_head", group_aggregation="sum", prefix_caching=True)
    gen = Generator(llama, None, cfg)
    prompts = [DOC + q for q in QUESTIONS]
    outs = gen.generate(prompts[:1], PARAMS)
    doc = gen.prefixes.index.match(list(DOC))
    assert len(doc) == len(DOC) // BLOCK
    ids = torch.stack([entry.ids for entry in doc]).flatten().to(gen.store.metadata.device)
    written = gen.store.metadata[ids].view(torch.uint8).clone()
    outs += [gen.generate([p], PARAMS)[0] for p in prompts[1:]]
    assert [len(o.token_ids) for o in outs] == [PARAMS.max_new_tokens] * 4
    assert gen.metrics()["totals"]["prefix_hits"] == 3
    assert torch.equal(gen.store.metadata[ids].view(torch.uint8), written)
