"""Gemma-3-270M, the second real model (15 of its 18 layers attend within 512 tokens, 3 globally),
through the drop-in on CPU: a RULER needle prompt answered densely, sparsely with every block
selected (same tokens) and at a budget that loads a fraction of the context (needle still found)."""

from __future__ import annotations

import pytest
import torch
from eval.accuracy import ruler

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.cache.layer import SparseServeLayer
from sparseserve_hf.compat import cache_kwarg
from sparseserve_hf.data.models import ModelNotAvailableError, load_model

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 1536
NEW_TOKENS = 12  # ": " and the needle's seven digits, one token each


@pytest.fixture(scope="module")
def gemma():
    try:
        return load_model("gemma3-270m", attn_implementation="sparseserve")
    except ModelNotAvailableError as exc:
        pytest.skip(f"Gemma-3-270M not installed: {exc}")


def answer(model, tokenizer, ids: torch.Tensor, cache: SparseServeCache | None) -> str:
    kwargs = {} if cache is None else {cache_kwarg(model): cache}
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_a_needle_through_the_sparse_global_layers(gemma):
    model, tokenizer = gemma
    (sample,) = ruler.build_samples(tokenizer, ["niah_single_1"], [PROMPT_TOKENS], 1, 42)
    ids = tokenizer(sample.prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    dense = answer(model, tokenizer, ids, None)
    assert ruler.score(sample, dense) == 100.0, dense

    covering = SparseServeCache(model.config, SparseServeConfig(token_budget=4096))
    assert answer(model, tokenizer, ids, covering) == dense  # every block selected: dense attention
    assert sum(isinstance(layer, SparseServeLayer) for layer in covering.layers) == 3

    cache = SparseServeCache(model.config, SparseServeConfig(token_budget=256))
    sparse = answer(model, tokenizer, ids, cache)
    assert ruler.score(sample, sparse) == 100.0, sparse
    stats = cache.stats()
    assert 0 < stats["loaded_fraction"] < 0.3  # the global layers read a fraction of the context
    assert stats["dram_bytes"] > 0 and stats["hbm_dense_layer_bytes"] > 0  # sliding windows stay on the device
