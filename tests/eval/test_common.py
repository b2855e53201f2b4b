"""eval.common: batched greedy answers equal one-by-one answers; method names and batching helpers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from eval.common import (
    Method,
    answer,
    answer_batch,
    batches,
    left_pad,
    methods_for,
    sized_dram_pool,
    sparse_methods,
    split_method,
)
from transformers import AutoModelForCausalLM, LlamaConfig

import sparseserve_hf  # noqa: F401  (registers "sparseserve")
from sparseserve_hf import SparseServeConfig
from toy_tokenizer import word_tokenizer

VOCAB = 64


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="sparseserve").eval()


def _prompts(lengths: list[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(2, VOCAB, (n,), generator=generator) for n in lengths]


@pytest.mark.parametrize(
    "method", [Method("dense"), Method("sparse_64", SparseServeConfig(block_size=8, token_budget=64))]
)
def test_batched_answers_equal_single_answers(tiny, method):
    tokenizer = word_tokenizer(vocab_size=VOCAB)
    prompts = _prompts([150, 171, 163])  # ragged: the batch is left-padded
    together, loads = answer_batch(tiny, tokenizer, prompts, method, max_new_tokens=8)
    alone = [answer(tiny, tokenizer, p[None], method, max_new_tokens=8) for p in prompts]
    assert together == alone
    assert all(text.strip() for text in together)
    if method.config is None:
        assert loads == {}
    else:  # one pick of 64 tokens per KV head of 150-178 stored (its tail counted as the budget counts it)
        assert 0 < loads["loaded_fraction"] < 1 and 56 < loads["loaded_tokens_per_kv_head"] <= 64


def test_the_oracle_method_answers_in_batches_and_reports_its_loads(tiny):
    tokenizer = word_tokenizer(vocab_size=VOCAB)
    prompts = _prompts([150, 171, 163])
    assert [m.name for m in sparse_methods([256, 512], [], oracle=True)] == ["dense", "oracle_256", "oracle_512"]
    oracle = next(m for m in sparse_methods([256], [], oracle=True) if m.oracle)
    assert oracle.name == "oracle_256" and oracle.config.selection == "kv_head"
    config = replace(oracle.config, block_size=8, token_budget=64)  # 7 blocks of 8 + the tail
    method = Method("oracle_64", config, oracle=True)
    together, loads = answer_batch(tiny, tokenizer, prompts, method, max_new_tokens=8)
    assert len(together) == 3 and all(text.strip() for text in together)
    assert 7 * 8 < loads["loaded_tokens_per_kv_head"] <= 8 * 8 and loads["metadata_fraction"] == 0.0
    assert tiny.config._attn_implementation == "sparseserve"  # restored after the batch


def test_left_pad_right_aligns():
    ids, mask = left_pad([torch.tensor([5, 6, 7]), torch.tensor([9])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_batches_and_method_names():
    assert batches(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="batch size"):
        batches([1], 0)
    names = [m.name for m in methods_for([256, 512], SparseServeConfig(metadata="cuboid"), "cuboid")]
    assert names == ["dense", "cuboid_256", "cuboid_512"]
    assert split_method("cuboid_512") == ("cuboid", 512) and split_method("dense") == ("dense", None)


def test_sized_dram_pool_holds_every_layer_and_rounds_to_a_power_of_two(tiny):
    config = sized_dram_pool(SparseServeConfig(block_size=8), tiny.config, tokens=100, dtype=torch.float32)
    blocks = (100 // 8 + 1) * 2 * 2  # layers x KV heads
    assert config.dram_bytes == 1 << (blocks * 2 * 8 * 16 * 4 - 1).bit_length()
    assert config.dram_bytes.bit_count() == 1
    fixed = SparseServeConfig(dram_bytes=12345)
    assert sized_dram_pool(fixed, tiny.config, 100, torch.float32) is fixed
