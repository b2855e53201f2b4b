"""Selection levers through the real sparse path (tiny model): what the cache selects is what the spec says."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.attention import pick_blocks
from sparseserve_hf.ops import reference
from tiny_models import random_ids

BLOCK = 16


def expected_selection(layer, query: torch.Tensor, config: SparseServeConfig) -> torch.Tensor:
    """(Hq, U) the blocks each query head should attend, from the layer's stored keys and the spec."""
    keys, _, _ = layer.past()  # (1, Hkv, L, D)
    num_full = int(layer.num_blocks[0])
    blocks = keys[0, :, : num_full * BLOCK].unflatten(1, (num_full, BLOCK))  # (Hkv, N, S, D)
    stored = reference.metadata_dtype(config.metadata_dtype, keys.dtype)
    meta = reference.block_metadata(blocks, config.metadata, config.sub_blocks, stored)
    scores = reference.score_blocks(query, meta[None], config.metadata)  # (1, Hq, N)
    picked, valid, head_mask = pick_blocks(reference, config, scores, layer.num_blocks, keys.shape[1], num_full)
    group = query.shape[1] // keys.shape[1]
    use = valid.repeat_interleave(group, 1) if head_mask is None else head_mask
    return torch.where(use, picked.repeat_interleave(group, 1), -1)[0]


@pytest.mark.parametrize("metadata", ["quest", "cuboid", "hybrid"])
@pytest.mark.parametrize("sub_blocks,metadata_dtype", [(2, "auto"), (4, "auto"), (2, "float8_e4m3fn")])
def test_sub_block_selection_in_the_cache_matches_the_spec(llama, metadata, sub_blocks, metadata_dtype):
    config = SparseServeConfig(
        block_size=BLOCK, token_budget=4 * BLOCK, metadata=metadata, metadata_sub_blocks=sub_blocks,
        metadata_dtype=metadata_dtype, selection="query_head",
    )  # fmt: skip
    cache = SparseServeCache(llama.config, config)
    captured = {}
    attention = llama.model.layers[0].self_attn
    hook = attention.q_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("q", o))
    with torch.no_grad():
        token = llama(random_ids(1, 200), past_key_values=cache).logits[:, -1:].argmax(-1)
        position = torch.tensor([[200]])
        llama(token, past_key_values=cache, position_ids=position)
    hook.remove()
    layer = cache.layers[0]
    assert cache.store.metadata.shape[1] == config.metadata_vectors
    assert cache.store.metadata.dtype == reference.metadata_dtype(metadata_dtype, llama.dtype)
    # Rebuild layer 0's decode query (q_proj -> heads -> RoPE) as the attention saw it.
    heads = llama.config.num_attention_heads
    q = captured["q"].view(1, 1, heads, -1).transpose(1, 2)  # (1, Hq, 1, D)
    cos, sin = llama.model.rotary_emb(q, position)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    got = layer.last_selection[0]  # (Hq, U)
    expected = expected_selection(layer, q[:, :, 0], config)
    for head in range(heads):
        assert sorted(got[head][got[head] >= 0].tolist()) == sorted(expected[head][expected[head] >= 0].tolist())


def test_sub_blocks_with_a_budget_covering_the_sequence_equal_dense(llama):
    from tiny_models import greedy, tiny_model

    sdpa = tiny_model("llama", "sdpa")
    ids = random_ids(1, 90)
    cache = SparseServeCache(
        llama.config, SparseServeConfig(block_size=BLOCK, token_budget=1024, metadata="hybrid", metadata_sub_blocks=4)
    )
    assert torch.equal(greedy(llama, ids, cache, max_new_tokens=8), greedy(sdpa, ids, max_new_tokens=8))


def test_float8_metadata_with_a_budget_covering_the_sequence_equals_dense(llama):
    """Rounded scores change which blocks rank first, never what a covering budget attends."""
    from tiny_models import greedy, tiny_model

    sdpa = tiny_model("llama", "sdpa")
    ids = random_ids(1, 90)
    config = SparseServeConfig(block_size=BLOCK, token_budget=1024, metadata_dtype="float8_e4m3fn")
    cache = SparseServeCache(llama.config, config)
    assert torch.equal(greedy(llama, ids, cache, max_new_tokens=8), greedy(sdpa, ids, max_new_tokens=8))
    meta = cache.store.metadata[: cache.store.dram.num_used]
    assert meta.dtype == torch.float8_e4m3fn and meta.float().abs().sum() > 0
    assert cache.stats()["hbm_metadata_bytes"] == meta.numel()  # one byte per value
