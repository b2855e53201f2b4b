"""The drop-in: attn_implementation="sparseserve" with and without a cache, streaming, registry."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AttentionInterface, TextStreamer

import sparseserve_hf
from sparseserve_hf import SparseServeCache, SparseServeConfig
from tiny_models import PAD, VOCAB, greedy, random_ids, tiny_model
from toy_tokenizer import word_tokenizer


@pytest.mark.core
def test_importing_twice_keeps_one_registration():
    sparseserve_hf.register()
    sparseserve_hf.register()
    assert "sparseserve" in AttentionInterface().valid_keys()


@pytest.mark.core
def test_without_a_cache_it_is_dense_and_hints_once(llama, caplog):
    ids = random_ids(2, 70)
    sparseserve_hf.attention._hint_no_cache.cache_clear()
    with caplog.at_level(logging.WARNING, logger="sparseserve_hf.attention"):
        got = greedy(llama, ids)
        greedy(llama, ids)
    assert torch.equal(got, greedy(tiny_model("llama", "sdpa"), ids))
    hints = [r for r in caplog.records if "SparseServeCache" in r.getMessage()]
    assert len(hints) == 1


class Collect(TextStreamer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer, skip_prompt=True)
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text


def test_text_streamer_streams_the_sparse_tokens(llama):
    tokenizer = word_tokenizer(chat_template=None, vocab_size=VOCAB)
    inputs = tokenizer(" ".join(f"w{i}" for i in random_ids(1, 120)[0].tolist()), return_tensors="pt")
    streamer = Collect(tokenizer)
    cache = SparseServeCache(llama.config, SparseServeConfig(block_size=16, token_budget=64))
    out = llama.generate(
        **inputs, past_key_values=cache, streamer=streamer, max_new_tokens=12, do_sample=False, pad_token_id=PAD
    )
    new = out[0, inputs["input_ids"].shape[1] :]
    assert streamer.text.split() == tokenizer.decode(new).split()
    assert len(streamer.text.split()) == 12


def test_dense_layers_stay_dense_and_match(llama):
    ids = random_ids(1, 90)
    config = SparseServeConfig(block_size=16, token_budget=4096, dense_layers=(0,))
    cache = SparseServeCache(llama.config, config)
    assert torch.equal(greedy(llama, ids, cache), greedy(tiny_model("llama", "sdpa"), ids))
    assert cache.stats()["hbm_dense_layer_bytes"] > 0


@pytest.mark.core
def test_a_second_turn_over_the_same_cache_prefills_only_its_new_tokens(llama):
    """A chat through `generate`: turn 2's prompt is turn 1's prompt, answer and a new message;
    the cache already holds turn 1, so only the new tokens are prefilled, with the tokens of a
    fresh cache over the whole conversation."""
    config = SparseServeConfig(block_size=16, token_budget=48)
    cache = SparseServeCache(llama.config, config)
    turn1 = random_ids(1, 150, seed=3)
    answer = greedy(llama, turn1, cache, max_new_tokens=10)
    turn2 = torch.cat((turn1, answer, random_ids(1, 20, seed=4)), dim=1)
    cached = cache.get_seq_length()
    assert cached == turn1.shape[1] + answer.shape[1] - 1  # the last answer token was never fed
    saves_before = cache.stats()["d2h_bytes"]
    got = greedy(llama, turn2, cache, max_new_tokens=10)
    assert torch.equal(got, greedy(llama, turn2, SparseServeCache(llama.config, config), max_new_tokens=10))
    block_bytes = 2 * 16 * 16 * 4  # K and V, 16 tokens x head_dim 16, fp32
    new_blocks = (turn2.shape[1] + 9) // 16 - cached // 16  # blocks turn 2 completed (prompt + 9 fed answers)
    saved = cache.stats()["d2h_bytes"] - saves_before
    assert saved <= new_blocks * 2 * 2 * block_bytes  # per layer and KV head: only what turn 2 added
