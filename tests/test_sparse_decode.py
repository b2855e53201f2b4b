"""At a small budget, sparse decode equals dense attention masked to exactly the selected blocks."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sparseserve_hf import SparseServeCache, SparseServeConfig
from tiny_models import left_pad, random_ids, tiny_model

BLOCK = 16
REFERENCE = "selected_blocks_reference"
ALLOWED: dict[int, torch.Tensor] = {}  # layer_idx -> (B, Hq, 1, kv_len) positions each query head may see


def selected_blocks_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager dense attention restricted to the positions in ALLOWED (prefill: plain SDPA)."""
    if query.shape[2] > 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    group = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    logits = (query @ keys.transpose(-1, -2)) * scaling  # (B, Hq, 1, L)
    weights = logits.masked_fill(~ALLOWED[module.layer_idx], float("-inf")).softmax(-1)
    return (weights @ values).transpose(1, 2), None


AttentionInterface.register(REFERENCE, selected_blocks_reference)
AttentionMaskInterface.register(REFERENCE, sdpa_mask)


def allowed_positions(layer, pads: list[int], num_positions: int) -> torch.Tensor:
    """(B, Hq, 1, L) mask of the positions in a layer's last selection plus its tail block."""
    selection = layer.last_selection  # (B, Hq, K) block indices, -1 unused
    batch, num_heads, _ = selection.shape
    allowed = torch.zeros((batch, num_heads, 1, num_positions), dtype=torch.bool)
    for row in range(batch):
        token = torch.arange(num_positions) - pads[row]  # index among the row's real tokens
        block = torch.where(token >= 0, token // BLOCK, -2)
        tail = (block >= int(layer.num_blocks[row])) & (token >= 0)
        for head in range(num_heads):
            chosen = selection[row, head][selection[row, head] >= 0]
            allowed[row, head, 0] = torch.isin(block, chosen) | tail
    return allowed


@pytest.mark.core
@pytest.mark.parametrize("selection", ["query_head", "group_union", "kv_head"])
@pytest.mark.parametrize("metadata", ["quest", "cuboid"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_sparse_decode_equals_masked_dense(selection, metadata, padded):
    shape = dict(num_heads=6, num_kv_heads=2)
    sparse, reference, dense = (tiny_model("llama", attn, **shape) for attn in ("sparseserve", REFERENCE, "sdpa"))
    if padded:
        ids, mask = left_pad([random_ids(1, 230, seed=5)[0], random_ids(1, 181, seed=6)[0]])
    else:
        ids, mask = random_ids(1, 230, seed=5), torch.ones(1, 230, dtype=torch.long)
    pads = (mask == 0).sum(1).tolist()
    config = SparseServeConfig(block_size=BLOCK, token_budget=4 * BLOCK, selection=selection, metadata=metadata)
    cache = SparseServeCache(sparse.config, config)
    reference_cache, dense_cache = DynamicCache(config=sparse.config), DynamicCache(config=sparse.config)
    max_gap = 0.0
    with torch.no_grad():
        token = sparse(ids, attention_mask=mask, past_key_values=cache).logits[:, -1:].argmax(-1)
        reference(ids, attention_mask=mask, past_key_values=reference_cache)
        dense(ids, attention_mask=mask, past_key_values=dense_cache)
        for _ in range(4):
            mask = torch.cat((mask, torch.ones_like(token)), dim=1)
            got = sparse(token, attention_mask=mask, past_key_values=cache).logits
            for layer_idx, layer in enumerate(cache.layers):
                ALLOWED[layer_idx] = allowed_positions(layer, pads, mask.shape[1])
                attended = (layer.last_selection >= 0).sum(-1)  # sink + window + 1 top-k (a G=3 union)
                assert attended.min() >= 3 and attended.max() <= (9 if selection == "group_union" else 3)
            expected = reference(token, attention_mask=mask, past_key_values=reference_cache).logits
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
            full = dense(token, attention_mask=mask, past_key_values=dense_cache).logits
            max_gap = max(max_gap, (got - full).abs().max().item())
            token = got[:, -1:].argmax(-1)
    assert max_gap > 1e-3, "a 64-token budget over ~230 tokens should differ from dense attention"


def test_sink_and_window_blocks_are_always_selected(llama):
    cache = SparseServeCache(llama.config, SparseServeConfig(block_size=BLOCK, token_budget=4 * BLOCK))
    with torch.no_grad():
        token = llama(random_ids(1, 300), past_key_values=cache).logits[:, -1:].argmax(-1)
        llama(token, past_key_values=cache)
    for layer in cache.layers:
        last_full = int(layer.num_blocks[0]) - 1
        for head_selection in layer.last_selection[0]:
            assert 0 in head_selection.tolist() and last_full in head_selection.tolist()


def test_group_union_gives_every_head_its_groups_blocks(llama):
    caches = {
        mode: SparseServeCache(
            llama.config, SparseServeConfig(block_size=BLOCK, token_budget=4 * BLOCK, selection=mode)
        )
        for mode in ("query_head", "group_union")
    }
    ids = random_ids(1, 300)
    with torch.no_grad():
        for cache in caches.values():
            token = llama(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
            llama(token, past_key_values=cache)
    own = caches["query_head"].layers[0].last_selection[0]  # (Hq=4, 3); 2 KV heads -> groups of 2
    union = caches["group_union"].layers[0].last_selection[0]  # (4, 6)
    for head in range(4):
        group = own[2 * (head // 2) : 2 * (head // 2) + 2]
        expected = sorted(set(group[group >= 0].tolist()))
        assert union[head][union[head] >= 0].tolist() == expected


def test_kv_head_selection_is_shared_by_the_group(llama):
    config = SparseServeConfig(block_size=BLOCK, token_budget=4 * BLOCK, selection="kv_head", group_aggregation="sum")
    cache = SparseServeCache(llama.config, config)
    with torch.no_grad():
        token = llama(random_ids(1, 300), past_key_values=cache).logits[:, -1:].argmax(-1)
        llama(token, past_key_values=cache)
    selection = cache.layers[0].last_selection[0]  # (Hq=4, K); 2 KV heads -> groups of 2
    assert torch.equal(selection[0], selection[1]) and torch.equal(selection[2], selection[3])
