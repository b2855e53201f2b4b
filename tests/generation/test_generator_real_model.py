"""The Generator on the real default model (SmolLM2-135M-Instruct): a batch equals one-by-one greedy."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.data.models import ModelNotAvailableError, load_default

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.\nHaiku:",
    "List three prime numbers greater than ten, separated by commas, and explain why each one is prime:",
]


def test_real_prompts_batch_equals_one_by_one_greedy():
    try:
        model, tokenizer = load_default(attn_implementation="sparseserve")
    except ModelNotAvailableError as exc:
        pytest.skip(f"real default model not installed: {exc}")
    config = SparseServeConfig(
        token_budget=64, block_size=16, hbm_cache_bytes=16 << 20
    )  # < the lengths: real selection
    params = SamplingParams(max_new_tokens=24)
    batch = Generator(model, tokenizer, config).generate(PROMPTS, params)
    for text, out in zip(PROMPTS, batch):
        alone = Generator(model, tokenizer, config).generate([text], params)[0]
        assert out.token_ids == alone.token_ids and out.text == alone.text, text
        ids = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            stock = model.generate(**ids, max_new_tokens=24, do_sample=False)[0, ids["input_ids"].shape[1] :]
        if len(ids["input_ids"][0]) + 24 <= config.token_budget:  # budget covers the sequence: dense == sparse
            assert list(out.token_ids) == stock[: len(out.token_ids)].tolist(), text
        assert out.finish_reason in ("stop", "length") and out.text
