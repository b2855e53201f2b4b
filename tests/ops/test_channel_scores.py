"""metadata="channels": each block's 2-bit copy of its own channels, the channel scores, the query
profile, and the selector through the cache."""

from __future__ import annotations

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.compat import cache_kwarg
from sparseserve_hf.ops import channels, reference
from tiny_models import greedy, random_ids, tiny_model

FP8 = torch.float8_e4m3fn


def _true_keys(keys: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    """(..., S, D) keys on each block's stored channels (..., P) -> (..., S, P)."""
    return torch.gather(keys, -1, channel.unsqueeze(-2).expand(*keys.shape[:-1], channel.shape[-1]))


@pytest.mark.parametrize("dim,share", [(24, 0.375), (64, 0.375), (128, 0.375), (64, 0.5), (16, 1.0)])
def test_codes_round_trip_within_half_a_step(dim, share):
    keys = torch.randn(7, 32, dim) * torch.linspace(0.1, 30, dim)  # channels of very different ranges
    meta = channels.channel_metadata(keys, share, FP8)
    assert meta.shape == (7, channels.metadata_rows(32, share), dim) and meta.dtype == FP8
    stored = channels.stored_channels(share, dim)
    channel, back = channels.unpacked(meta, 32, stored)  # (7, P), (7, 32, P)
    assert channel.shape == (7, stored) and torch.equal(channel[:, stored // 2 :], channel[:, : stored // 2] + dim // 2)
    true = _true_keys(keys, channel)
    low = true.amin(1).to(FP8).float()
    step = ((true.amax(1) - true.amin(1)) / channels.LEVELS).to(FP8).float()
    # The stored minimum and step are rounded, so the codes' range can end short of the maximum (the
    # top code clamps): within half a step inside that range, and no further than the range holds outside.
    top = low + channels.LEVELS * step
    inside = true <= top[:, None]
    error = (back - true).abs()
    assert (error[inside] <= (step[:, None].expand_as(true)[inside] / 2) + 1e-6).all()
    assert torch.equal(back[~inside], top[:, None].expand_as(true)[~inside])


def test_a_block_keeps_the_pairs_where_its_keys_spread_most():
    keys = torch.randn(3, 32, 16) * 0.01
    keys[0, :, [2, 10]] *= 100  # pair 2 = channels (2, 10)
    keys[1, :, 5] *= 300  # pair 5 = channels (5, 13), through one channel of it
    keys[2, :, [1, 9, 7, 15]] *= 100  # pairs 1 and 7
    meta = channels.channel_metadata(keys, 0.25, FP8)  # two pairs per block
    channel, _ = channels.unpacked(meta, 32, 4)
    assert 2 in channel[0, :2].tolist() and 5 in channel[1, :2].tolist() and channel[2, :2].tolist() == [1, 7]
    assert channel[0].tolist() == sorted(channel[0, :2].tolist()) + [c + 8 for c in sorted(channel[0, :2].tolist())]


def test_the_query_profile_weighs_the_choice():
    keys = torch.randn(2, 32, 8)  # four pairs of similar spread
    keys[:, :, [0, 4]] *= 1.5  # pair 0 spreads most
    profile = torch.tensor([1.0, 1.0, 1.0, 20.0, 1.0, 1.0, 1.0, 20.0])  # the queries live on pair 3
    assert channels.unpacked(channels.channel_metadata(keys, 0.25, FP8), 32, 2)[0][:, 0].tolist() == [0, 0]
    weighed = channels.channel_metadata(keys, 0.25, FP8, profile.expand(2, 8))
    assert channels.unpacked(weighed, 32, 2)[0].tolist() == [[3, 7], [3, 7]]
    unprofiled = channels.channel_metadata(keys, 0.25, FP8, torch.zeros(2, 8))  # a row that saw no prompt
    assert torch.equal(unprofiled.view(torch.uint8), channels.channel_metadata(keys, 0.25, FP8).view(torch.uint8))


def test_packing_layout_codes_then_header():
    keys = torch.zeros(1, 8, 4)
    keys[0, :, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0])  # codes 0..3 with step 1
    meta = channels.channel_metadata(keys, 0.5, FP8)  # one pair of 4 channels: (0, 2)
    assert meta.shape == (1, channels.metadata_rows(8, 0.5), 4) == (1, 3, 4)
    raw = meta.view(torch.uint8).flatten().tolist()
    first, second = 0 | 1 << 2 | 2 << 4 | 3 << 6, 3 | 2 << 2 | 1 << 4 | 0 << 6
    one = torch.tensor(1.0).to(FP8).view(torch.uint8).item()
    # code bytes (token quad j, stored channel i) at j*P + i; the header from the next row: pair 0,
    # minima (0, 0), steps (1, 0); zeros after it
    assert raw == [first, 0, second, 0] + [0, 0, 0, one] + [0, 0, 0, 0]
    channel, back = channels.unpacked(meta, 8, 2)
    assert channel.tolist() == [[0, 2]] and torch.equal(back[0], keys[0][:, [0, 2]])


def test_constant_channels_decode_to_their_value():
    keys = torch.full((2, 32, 4), 1.5)
    channel, back = channels.unpacked(channels.channel_metadata(keys, 1.0, FP8), 32, 4)
    assert torch.equal(back, _true_keys(keys, channel))


def test_bad_metadata_requests_are_refused():
    with pytest.raises(ValueError, match="8-bit float"):
        channels.channel_metadata(torch.randn(2, 32, 8), 0.5, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple"):
        channels.metadata_rows(2, 0.5)
    with pytest.raises(ValueError, match="even head_dim"):
        channels.stored_channels(0.5, 7)


def test_stored_channels_are_whole_pairs_and_default_metadata_is_a_32nd_of_the_kv():
    assert channels.stored_channels(0.375, 64) == 24 and channels.stored_channels(0.375, 128) == 48
    assert channels.stored_channels(0.001, 64) == 2 and channels.stored_channels(1.0, 80) == 80
    config = SparseServeConfig(metadata="channels")
    assert config.channel_share == 0.375 and config.metadata_vectors == 4
    for dim in (64, 128):  # rows of head_dim bytes against 32 tokens x (K, V) x head_dim x 2 bytes
        assert config.metadata_vectors * dim * 32 == 32 * 2 * dim * 2
    for share in (0.25, 0.4, 0.5, 1.0):  # the layout fits the rows for every head_dim
        for dim in (16, 24, 64, 80, 128, 256):
            stored = channels.stored_channels(share, dim)
            end = channels.header_start(32, stored, dim) + stored // 2 + 2 * stored
            assert end <= channels.metadata_rows(32, share) * dim


def test_query_profile_is_each_rows_groups_mean_abs_query_over_real_recent_positions():
    query = torch.randn(3, 6, 10, 8)
    real = torch.ones(3, 10, dtype=torch.bool)
    real[1, :7] = False  # row 1 is left-padded
    real[2] = False  # row 2 has no real token in this chunk
    profile = channels.query_profile(query, 2, 4, real)  # (B, Hkv, D)
    torch.testing.assert_close(profile[0], query[0, :, -4:].abs().mean(1).view(2, 3, 8).sum(1))
    torch.testing.assert_close(profile[1], query[1, :, -3:].abs().mean(1).view(2, 3, 8).sum(1))
    assert torch.equal(profile[2], torch.zeros(2, 8))
    assert channels.query_profile(query, 2, 64).shape == (3, 2, 8)  # fewer positions than asked: all of them


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
    meta = channels.channel_metadata(keys, 1.0, FP8).flatten(0, 2)  # (B*Hkv*N, M, D)
    ids = torch.arange(batch * num_kv_heads * num_blocks).view(batch, num_kv_heads, num_blocks)
    query = torch.randn(batch, num_kv_heads * group, dim)
    got = channels.score_channels(query, meta, ids, size, dim, 0.25)
    torch.testing.assert_close(got, _exact_mass(query, keys, 0.25))


def test_scores_follow_each_blocks_own_channels_and_mask_unused_ids():
    torch.manual_seed(1)
    dim = 8
    keys = torch.randn(1, 1, 4, 32, dim) * 0.1
    keys[0, 0, 2, 5, 3] = 40.0  # a needle, in channel 3 of block 2: the pair (3, 7) is block 2's
    meta = channels.channel_metadata(keys, 0.25, FP8)[0, 0]  # (4, M, D), one pair per block
    assert channels.unpacked(meta, 32, 2)[0][2].tolist() == [3, 7]
    query = torch.zeros(1, 2, dim)
    query[0, :, 3] = 1.0  # both heads of the group look along channel 3
    query[0, :, 0] = 0.01
    ids = torch.tensor([[[0, 1, 2, 3]]])
    scores = channels.score_channels(query, meta, ids, 32, 2, 1.0)
    assert (scores.argmax(-1) == 2).all() and scores[0, :, 2].min() > 0.99
    ids[0, 0, 2] = -1
    masked = channels.score_channels(query, meta, ids, 32, 2, 1.0)
    assert torch.isneginf(masked[0, :, 2]).all() and torch.allclose(masked[0, :, [0, 1, 3]].sum(-1), torch.ones(2))
    empty = channels.score_channels(query, meta, torch.full((1, 1, 4), -1), 32, 2, 1.0)
    assert torch.isneginf(empty).all()  # a row without blocks scores -inf, not NaN


def test_config_errors():
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
    assert per_block == channels.metadata_rows(16, 0.5) * 16  # head_dim 16 of the tiny model
    read = stats["metadata_bytes_read_per_step"] * stats["decode_steps"]  # every full block, every step
    assert read > 0 and round(read) % per_block == 0
    pick = cache.layers[0].last_pick  # (picked, valid, ...) each (B, Hkv, K)
    assert pick[1].sum(-1).tolist() == [[64 // 16 - 1] * 2]  # the budget's blocks, less the tail's share
    assert stats["loaded_tokens_per_kv_head"] <= 64


def test_chooses_the_block_a_query_head_attends_to():
    """A block whose keys one query head strongly matches is loaded, even with one channel in six
    kept, where a block mean (cuboid) averages it away. Checked on the op the decode step calls."""
    torch.manual_seed(3)
    dim, size, num_blocks = 48, 32, 64
    keys = torch.randn(1, 1, num_blocks, size, dim) * 0.3
    query = torch.randn(1, 4, dim) * 0.3
    query[0, 1] *= 0.1
    query[0, 1, 7] = 3.0  # head 1 looks along channel 7
    keys[0, 0, 41, 17, 7] = 6.0  # one token of block 41
    meta = channels.channel_metadata(keys, 1 / 6, FP8)[0, 0]
    ids = torch.arange(num_blocks).view(1, 1, num_blocks)
    scores = channels.score_channels(query, meta, ids, size, channels.stored_channels(1 / 6, dim), dim**-0.5)
    assert scores[0, 1].argmax() == 41
    group = reference.aggregate_group_scores(scores, 1, "sum")
    picked, _ = reference.select_blocks(group, torch.tensor([num_blocks]), 4, 1, 1)
    assert 41 in picked[0, 0].tolist()


@pytest.mark.core
def test_the_cache_profiles_each_rows_prompt_and_saves_its_blocks_under_it():
    """Each row's last prompt queries make its query profile, and the blocks it saves keep the channels
    that `channel_metadata` chooses under it; the profile moves with the row."""
    model = tiny_model("llama", num_heads=6, num_kv_heads=2)
    cache = _channel_cache(model, token_budget=64)
    ids = torch.cat((random_ids(1, 100), random_ids(1, 100, seed=2)))
    greedy(model, ids, cache, max_new_tokens=1)
    layer = cache.layers[1]
    profile = layer.query_profile
    assert profile.shape == (2, 2, 16) and (profile > 0).all() and not torch.equal(profile[0], profile[1])
    keys = layer.past()[0][:, :, : 6 * 16].reshape(2, 2, 6, 16, 16)  # (B, Hkv, n, S, D): the 6 full blocks
    expected = channels.channel_metadata(keys, 0.375, FP8, profile[:, :, None].expand(2, 2, 6, 16))
    saved = layer.block_ids[:, :, :6]  # (B, Hkv, n)
    assert torch.equal(layer.store.metadata[saved].view(torch.uint8), expected.view(torch.uint8))
    cache.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.query_profile, profile[1:])


def test_a_failed_prefill_leaves_every_rows_profile_as_it_was(monkeypatch):
    """A second turn whose save fails in the last layer: its commit and the undo of layer 0 put their
    query profiles back with their tokens."""
    model = tiny_model("llama", num_heads=6, num_kv_heads=2)
    cache = _channel_cache(model, token_budget=64)
    greedy(model, random_ids(1, 100), cache, max_new_tokens=1)
    before = [layer.query_profile.clone() for layer in cache.layers]
    lengths = [layer.get_seq_length() for layer in cache.layers]
    store, save, calls = cache.layers[0].store, cache.layers[0].store.save, []

    def save_failing_last(*args, **kwargs):
        calls.append(1)
        if len(calls) == len(cache.layers):
            raise RuntimeError("DRAM write failed")
        return save(*args, **kwargs)

    monkeypatch.setattr(store, "save", save_failing_last)
    with pytest.raises(RuntimeError, match="DRAM write failed"), torch.no_grad():
        model(random_ids(1, 60, seed=3), **{cache_kwarg(model): cache}, use_cache=True)
    assert len(calls) == len(cache.layers) == 2
    assert [layer.get_seq_length() for layer in cache.layers] == lengths
    for layer, profile in zip(cache.layers, before):
        assert torch.equal(layer.query_profile, profile)
