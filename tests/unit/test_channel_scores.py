"""metadata="channels": the 2-bit key copy, the channel scores, and the selector through the cache."""

from __future__ import annotations

import math

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.ops import channels, reference
from tiny_models import greedy, random_ids, tiny_model

FP8 = torch.float8_e4m3fn


def test_codes_round_trip_within_half_a_step():
    keys = torch.randn(7, 32, 24) * torch.linspace(0.1, 30, 24)  # channels of very different ranges
    meta = channels.channel_metadata(keys, FP8)
    assert meta.shape == (7, channels.metadata_rows(32), 24) and meta.dtype == FP8
    low, step = meta[:, -2].float(), meta[:, -1].float()  # (7, 24) as stored
    assert torch.equal(low, keys.amin(1).to(FP8).float())
    back = channels.dequantized_keys(meta)
    # The stored minimum and step are rounded, so the codes' range can end short of the maximum
    # (the top code clamps): within half a step inside that range, and no further than the range
    # holds outside it.
    top = low + channels.LEVELS * step
    inside = keys <= top[:, None]
    error = (back - keys).abs()
    assert (error[inside] <= (step[:, None].expand_as(keys)[inside] / 2) + 1e-6).all()
    assert torch.equal(back[~inside], top[:, None].expand_as(keys)[~inside])


def test_packing_is_two_bits_per_token_first_token_lowest():
    keys = torch.zeros(1, 8, 1)
    keys[0, :, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0])  # codes 0..3 with step 1
    meta = channels.channel_metadata(keys, FP8)  # (1, 4, 1): two code bytes, minimum, step
    codes = meta[0, :2, 0].view(torch.uint8).tolist()
    assert codes == [0 | 1 << 2 | 2 << 4 | 3 << 6, 3 | 2 << 2 | 1 << 4 | 0 << 6]
    assert torch.equal(channels.dequantized_keys(meta)[0, :, 0], keys[0, :, 0])


def test_constant_channel_decodes_to_its_value():
    keys = torch.full((2, 32, 4), 1.5)
    assert torch.equal(channels.dequantized_keys(channels.channel_metadata(keys, FP8)), keys)


def test_metadata_needs_an_8_bit_float():
    with pytest.raises(ValueError, match="8-bit float"):
        channels.channel_metadata(torch.randn(2, 32, 8), torch.bfloat16)
    with pytest.raises(ValueError, match="multiple"):
        channels.metadata_rows(2)


def _exact_mass(query, keys, scaling):
    """(B, Hq, N) true softmax mass per block: keys (B, Hkv, N, S, D)."""
    batch, num_q_heads, dim = query.shape
    num_kv_heads, num_blocks, size = keys.shape[1:4]
    q = query.view(batch, num_kv_heads, -1, dim)
    logits = torch.einsum("bhgd,bhnsd->bhgns", q, keys).flatten(3) * scaling
    return torch.softmax(logits, -1).unflatten(-1, (num_blocks, size)).sum(-1).reshape(batch, num_q_heads, num_blocks)


def test_all_channels_of_unrounded_keys_give_the_exact_block_mass():
    """With every channel read and keys that the 2-bit codes hold exactly, the estimate is attention."""
    torch.manual_seed(0)
    batch, num_kv_heads, group, num_blocks, size, dim = 2, 2, 3, 5, 8, 16
    keys = torch.randint(0, 4, (batch, num_kv_heads, num_blocks, size, dim)).float() * 0.5 - 0.75
    keys[..., 0, :], keys[..., 1, :] = -0.75, 0.75  # every channel spans all four codes in every block
    meta = channels.channel_metadata(keys, FP8).flatten(0, 2)  # (B*Hkv*N, M, D)
    ids = torch.arange(batch * num_kv_heads * num_blocks).view(batch, num_kv_heads, num_blocks)
    query = torch.randn(batch, num_kv_heads * group, dim)
    got = channels.score_channels(query, meta, ids, dim, 0.25)
    torch.testing.assert_close(got, _exact_mass(query, keys, 0.25))


def test_scores_follow_the_channels_of_largest_query_and_mask_unused_ids():
    torch.manual_seed(1)
    dim = 8
    keys = torch.randn(1, 1, 4, 32, dim)
    keys[0, 0, 2, 5, 3] = 40.0  # a needle, in channel 3 of block 2
    meta = channels.channel_metadata(keys, FP8)[0, 0]  # (4, M, D)
    query = torch.zeros(1, 2, dim)
    query[0, :, 3] = 1.0  # both heads of the group look along channel 3
    query[0, :, 0] = 0.01
    ids = torch.tensor([[[0, 1, 2, 3]]])
    scores = channels.score_channels(query, meta, ids, 1, 1.0)  # one channel read: channel 3
    assert torch.equal(channels.channel_queries(query, 1, 1, 1.0)[0], torch.tensor([[[3]]]))
    assert (scores.argmax(-1) == 2).all() and scores[0, :, 2].min() > 0.99
    ids[0, 0, 2] = -1
    masked = channels.score_channels(query, meta, ids, 1, 1.0)
    assert torch.isneginf(masked[0, :, 2]).all() and torch.allclose(masked[0, :, [0, 1, 3]].sum(-1), torch.ones(2))
    empty = channels.score_channels(query, meta, torch.full((1, 1, 4), -1), 1, 1.0)
    assert torch.isneginf(empty).all()  # a row without blocks scores -inf, not NaN


def test_channel_count_and_config():
    assert channels.channel_count(0.375, 64) == 24 and channels.channel_count(0.001, 64) == 1
    assert channels.channel_count(1.0, 128) == 128
    config = SparseServeConfig(metadata="channels")
    assert config.metadata_vectors == channels.metadata_rows(32) == 10
    for bad, match in (
        (dict(metadata_dtype="kv"), "in bytes"),
        (dict(metadata_sub_blocks=2), "metadata_sub_blocks"),
        (dict(channel_share=0.0), "channel_share"),
        (dict(channel_share=1.5), "channel_share"),
        (dict(block_size=2, token_budget=64), "multiple"),
    ):
        with pytest.raises(ValueError, match=match):
            SparseServeConfig(metadata="channels", **bad)


def _channel_cache(model, **overrides) -> SparseServeCache:
    config = SparseServeConfig(
        block_size=16, metadata="channels", selection="kv_head", group_aggregation="sum", **overrides
    )
    return SparseServeCache(model.config, config)


@pytest.mark.core
def test_budget_covering_the_sequence_equals_sdpa():
    model = tiny_model("llama", num_heads=6, num_kv_heads=2)
    ids = random_ids(1, 77)
    expected = greedy(tiny_model("llama", "sdpa", num_heads=6, num_kv_heads=2), ids)
    cache = _channel_cache(model, token_budget=1024)
    assert torch.equal(greedy(model, ids, cache), expected)


@pytest.mark.core
def test_small_budget_loads_exactly_the_budget_per_kv_head():
    """Per KV head: exactly `token_budget` tokens of full blocks + tail, scored from the 2-bit copy;
    the metadata read is what the cache reports."""
    model = tiny_model("llama", num_heads=6, num_kv_heads=2)
    ids = random_ids(1, 300)
    cache = _channel_cache(model, token_budget=64, channel_share=0.5)
    out = greedy(model, ids, cache, max_new_tokens=8)
    assert out.shape[1] == 8
    stats = cache.stats()
    per_block = cache.layers[0].store.metadata[:1].numel()  # 8-bit: bytes
    assert per_block == channels.metadata_rows(16) * 16  # head_dim 16 of the tiny model
    read = stats["metadata_bytes_read_per_step"] * stats["decode_steps"]  # every full block, every step
    assert read > 0 and round(read) % per_block == 0
    pick = cache.layers[0].last_pick  # (picked, valid, ...) each (B, Hkv, K)
    assert pick[1].sum(-1).tolist() == [[64 // 16 - 1] * 2]  # the budget's blocks, less the tail's share
    assert stats["loaded_tokens_per_kv_head"] <= 64


def test_chooses_the_block_a_query_head_attends_to():
    """A block whose keys one query head strongly matches is loaded, even with one channel in six
    read, where a block mean (cuboid) averages it away. Checked on the op the decode step calls."""
    torch.manual_seed(3)
    dim, size, num_blocks = 48, 32, 64
    keys = torch.randn(1, 1, num_blocks, size, dim) * 0.3
    query = torch.randn(1, 4, dim) * 0.3
    query[0, 1] *= 0.1
    query[0, 1, 7] = 3.0  # head 1 looks along channel 7
    keys[0, 0, 41, 17, 7] = 6.0  # one token of block 41
    meta = channels.channel_metadata(keys, FP8)[0, 0]
    ids = torch.arange(num_blocks).view(1, 1, num_blocks)
    scores = channels.score_channels(query, meta, ids, math.ceil(dim / 6), dim**-0.5)
    assert scores[0, 1].argmax() == 41
    group = reference.aggregate_group_scores(scores, 1, "sum")
    picked, _ = reference.select_blocks(group, torch.tensor([num_blocks]), 4, 1, 1)
    assert 41 in picked[0, 0].tolist()
