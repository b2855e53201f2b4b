"""`--variant` method families (eval.common.parse_variant, eval.common.sparse_methods) and the diagnostics' helpers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from eval.accuracy.ruler import parse_args
from eval.accuracy.selection_diagnostics import (
    BASE,
    REUSED,
    Recording,
    StepMass,
    block_channel_lse,
    block_channel_mass,
    block_channels,
    calibrated_channels,
    channel_mass,
    channel_quantized_keys,
    channel_score_blocks,
    estimated_mass_blocks,
    evaluate_recording,
    exact_block_lse,
    fed_back,
    needle_token_mask,
    oracle_blocks,
    pooled_blocks,
    quantized_keys,
    reused_blocks,
    step_mass,
    step_stats,
    top_blocks_by_mass,
    two_stage_blocks,
    two_stage_channel_blocks,
    variant_configs,
)
from eval.common import parse_variant, sparse_methods

from sparseserve_hf import SparseServeConfig
from sparseserve_hf.ops import reference


def hybrid(**fields) -> SparseServeConfig:
    """The diagnostics' base selector (the hybrid group union) with `fields` changed."""
    return replace(BASE, **fields)


def test_parse_variant_types_and_validation():
    family, overrides = parse_variant("quest_s8:metadata_sub_blocks=4:dense_layers=0,1:metadata=cuboid")
    assert family == "quest_s8" and overrides == dict(metadata_sub_blocks=4, dense_layers=(0, 1), metadata="cuboid")
    with pytest.raises(ValueError, match="metadata_sub_blocks"):
        parse_variant("bad:metadata_sub_blocks=3")
    with pytest.raises(ValueError, match="unknown SparseServeConfig fields"):
        parse_variant("bad:no_such_field=1")
    with pytest.raises(ValueError, match="FAMILY:field=value"):
        parse_variant("metadata_sub_blocks=4")


def test_ruler_variant_families():
    args = parse_args(["--variant", "quest_s8:metadata=quest:metadata_sub_blocks=4", "--variant", "w2:window_blocks=2"])
    methods = sparse_methods([256, 512], ["quest"], args.variant)
    assert [m.name for m in methods] == [
        "dense",
        "quest_256",
        "quest_512",
        "quest_s8_256",
        "quest_s8_512",
        "w2_256",
        "w2_512",
    ]
    quest = hybrid(token_budget=256, metadata="quest")  # a block summary family: with the group union
    assert methods[1].config == quest and methods[1].config.sub_blocks == 1
    assert methods[3].config == SparseServeConfig(token_budget=256, metadata="quest", metadata_sub_blocks=4)
    assert methods[5].config == SparseServeConfig(token_budget=256, window_blocks=2)  # the default metadata
    # the default configuration's kind is the "sparse" family; others are named by kind
    assert [m.name for m in sparse_methods([256], [SparseServeConfig().metadata, "cuboid"])] == [
        "dense",
        "sparse_256",
        "cuboid_256",
    ]
    assert parse_args([]).metadata == SparseServeConfig().metadata
    with pytest.raises(ValueError, match="clashes"):
        sparse_methods([256], ["quest"], ["sparse:window_blocks=2"])
    with pytest.raises(ValueError, match="share a name"):
        sparse_methods([256], ["quest"], ["a:window_blocks=2", "a:window_blocks=3"])


def test_needle_token_mask_marks_the_value_tokens():
    prompt = "xx 123 yy"
    offsets = torch.tensor([[0, 2], [2, 3], [3, 6], [6, 9]])  # tokens "xx", " ", "123", " yy"
    assert needle_token_mask(offsets, prompt, ["123"], 5).tolist() == [False, False, True, False, False]


def test_step_stats_by_hand():
    # 2 query heads / 1 KV head, block size 2, 5 keys: blocks {0,1}, {2,3}, tail {4}; head 0 looks at key 2.
    keys = torch.zeros(1, 5, 2)
    keys[0, 2] = torch.tensor([10.0, 0.0])
    q = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    needle = torch.tensor([False, False, True, False, False])
    mass = step_mass(q, keys, needle, 1.0, 2)
    config = hybrid(block_size=32, token_budget=64, sink_blocks=0, window_blocks=0)  # 1 full block each
    chosen = torch.tensor([[True, False], [True, False]])  # both heads attend block 0 only
    stats = step_stats(config, mass, chosen, torch.tensor([1]), 5)  # the KV head loads 1 block of 2 tokens
    # Head 0: nearly all mass on block 1 (oracle) -> recall ~0, needle lost; head 1: uniform, 2/5 on each block.
    assert stats["recall"][0] < 1e-3 and stats["needle_kept"][0] < 1e-3 and stats["needle_mass"][0] > 0.99
    torch.testing.assert_close(stats["recall"][1], torch.tensor(1.0))
    torch.testing.assert_close(stats["attended"][1], torch.tensor(0.6))
    # the loaded fraction counts tokens in the config's blocks: at block size 2, (1 block x 2 + a 1-token tail) / 5
    small = hybrid(block_size=2, token_budget=4, sink_blocks=0, window_blocks=0)
    loaded = step_stats(small, mass, chosen, torch.tensor([1]), 5)["loaded_fraction"]
    torch.testing.assert_close(loaded, torch.full((2,), 3 / 5))


def test_the_oracle_loads_the_groups_heaviest_blocks_with_sink_and_window():
    # 4 query heads / 2 KV heads, 6 full blocks; budget: 3 full blocks per KV head (1 sink + 1 window + 1).
    config = hybrid(block_size=2, token_budget=8, sink_blocks=1, window_blocks=1)
    block_mass = torch.zeros(4, 6)
    block_mass[0, 2], block_mass[1, 3] = 0.5, 0.4  # KV head 0's group: block 2 heaviest in sum
    block_mass[2, 4], block_mass[3, 1] = 0.3, 0.35  # KV head 1's group: block 1 (4 is the window)
    zeros = torch.zeros(4)
    mass = StepMass(block_mass, zeros, torch.zeros(4, 6), zeros, zeros)
    chosen, loaded = oracle_blocks(config, mass, num_kv_heads=2)
    assert loaded.tolist() == [3, 3]
    assert chosen[0].nonzero().flatten().tolist() == [0, 2, 5] and torch.equal(chosen[0], chosen[1])
    assert chosen[2].nonzero().flatten().tolist() == [0, 1, 5] and torch.equal(chosen[2], chosen[3])


def test_pooled_budget_goes_where_the_mass_is_within_each_heads_cap():
    # 3 KV heads, 8 full blocks, 4 full blocks per head (the tail aside): sink + window + 2 free each.
    config = hybrid(block_size=2, token_budget=10, sink_blocks=1, window_blocks=1)
    assert config.selected_full_blocks == 4
    mass = torch.full((3, 8), 0.01)
    mass[0, 1:7] = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])  # head 0 wants all its middle blocks
    mass[1, 3] = 0.2  # head 1: one block worth loading
    chosen = pooled_blocks(config, mass, cap=2)  # at most 2 x 2 free blocks per head
    assert chosen[:, 0].all() and chosen[:, 7].all()  # every head keeps its sink and window
    assert chosen[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 7]  # its cap: 4 of the 6 free
    assert chosen[1].nonzero().flatten().tolist() == [0, 3, 7]
    assert chosen.sum() == 3 * 4  # the layer loads what a fixed per-head budget would
    # through the oracle: loads per head follow the pick, the total stays the budget's
    zeros = torch.zeros(6)
    block_mass = mass.repeat_interleave(2, dim=0) / 2  # 2 query heads per KV head, same group sums
    step = StepMass(block_mass, zeros, torch.zeros(6, 8), zeros, zeros)
    pooled, loaded = oracle_blocks(config, step, num_kv_heads=3, pool_cap=2)
    assert loaded.tolist() == [6, 3, 3] and torch.equal(pooled[::2], chosen)
    assert "oracle_pooled2" in variant_configs(["oracle_pooled2"], 256)


def test_the_mass_estimate_picks_the_blocks_the_sub_block_means_point_at():
    # 2 query heads / 1 KV head, 6 full blocks of 2 sub-blocks; head 0's query matches a sub-block
    # mean of block 3, head 1's one of block 1: with sink + window that is the budget of 4 blocks.
    config = hybrid(block_size=2, token_budget=10, sink_blocks=1, window_blocks=1)
    meta = torch.zeros(1, 6, 2, 2)  # (Hkv, N, sub, D)
    meta[0, 3, 1] = torch.tensor([5.0, 0.0])
    meta[0, 1, 0] = torch.tensor([0.0, 5.0])
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    chosen, loaded = estimated_mass_blocks(config, q, meta, num_full=6, scaling=1.0)
    assert loaded.tolist() == [4]
    assert chosen[0].nonzero().flatten().tolist() == [0, 1, 3, 5] and torch.equal(chosen[0], chosen[1])


def test_quantized_keys_round_each_token_to_16_levels():
    keys = torch.randn(2, 7, 16)
    coarse = quantized_keys(keys, bits=4)
    step = (keys.amax(-1, keepdim=True) - keys.amin(-1, keepdim=True)) / 15
    assert ((coarse - keys).abs() <= step / 2 + 1e-6).all()
    assert all(len(coarse[h, t].unique()) <= 16 for h in range(2) for t in range(7))


def test_two_stage_keeps_the_candidate_whose_tokens_the_query_reads():
    # 1 KV head / 2 query heads, 8 full blocks of 2 tokens (D = 2); budget: sink + window + 1 block.
    # Block 5 holds the token both queries point at; its Quest box is also the widest, so it is a candidate.
    config = hybrid(block_size=2, token_budget=8, sink_blocks=1, window_blocks=1, metadata="quest")
    keys = torch.zeros(1, 16, 2)
    keys[0, 11] = torch.tensor([6.0, 0.0])  # block 5, second token
    keys[0, 4] = torch.tensor([1.0, 1.0])  # block 2: a weaker pull
    meta = reference.block_metadata(keys[0].view(8, 2, 2), "quest")[None]  # (1, N, 2, D)
    q = torch.tensor([[1.0, 0.0], [1.0, 0.2]])
    chosen, loaded = two_stage_blocks(config, q, meta, quantized_keys(keys), num_full=8, scaling=1.0)
    assert loaded.tolist() == [3]
    assert chosen[0].nonzero().flatten().tolist() == [0, 5, 7]


def test_channel_quantized_keys_round_each_block_channel_and_keep_the_tail():
    keys = torch.randn(2, 7, 16)  # blocks of 3: two full blocks and one tail token
    coarse = channel_quantized_keys(keys, size=3, bits=2)
    blocks = keys[:, :6].view(2, 2, 3, 16)
    step = (blocks.amax(2, keepdim=True) - blocks.amin(2, keepdim=True)) / 3
    assert ((coarse[:, :6].view(2, 2, 3, 16) - blocks).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(coarse[:, 6], keys[:, 6])
    assert all(len(coarse[h, :3, c].unique()) <= 4 for h in range(2) for c in range(16))
    # with the min and scale stored in 8 bits (e4m3: within 1/16 of each): still 4 levels, and off
    # the key by at most the min's rounding plus one level
    stored = channel_quantized_keys(keys, size=3, bits=2, scale_dtype=torch.float8_e4m3fn)
    assert all(len(stored[h, :3, c].unique()) <= 4 for h in range(2) for c in range(16))
    low = blocks.amin(2, keepdim=True).abs()
    assert ((stored[:, :6].view(2, 2, 3, 16) - blocks).abs() <= low / 16 + step + 1e-6).all()


def test_channel_scores_read_the_channels_the_queries_weigh_and_find_the_block_they_point_at():
    # 1 KV head / 2 query heads, 8 full blocks of 2 tokens (D = 4); budget: sink + window + 1 block.
    # The queries weigh channel 0 (and 1 a little); block 5 holds a token large there, block 2 one
    # large on channel 3, which the queries barely read: with 1 channel, block 5 wins alone.
    config = hybrid(block_size=2, token_budget=8, sink_blocks=1, window_blocks=1)
    keys = torch.zeros(1, 16, 4)
    keys[0, 11, 0] = 6.0  # block 5
    keys[0, 4, 3] = 200.0  # block 2: large on a channel the queries hardly read
    q = torch.tensor([[1.0, 0.3, 0.0, 0.05], [1.0, 0.0, 0.0, 0.05]])
    chosen, loaded = channel_score_blocks(config, q, keys, num_full=8, scaling=1.0, channels=1)
    assert loaded.tolist() == [3] and chosen.shape == (2, 8)
    assert chosen[0].nonzero().flatten().tolist() == [0, 5, 7] and torch.equal(chosen[0], chosen[1])
    # with every channel read it is the true attention's pick: 200 x 0.05 outweighs 6 x 1
    everything, _ = channel_score_blocks(config, q, keys, num_full=8, scaling=1.0, channels=4)
    assert everything[0].nonzero().flatten().tolist() == [0, 2, 7]


def test_block_lse_is_the_log_of_the_mass_before_its_softmax_and_exact_with_every_channel():
    torch.manual_seed(1)
    keys, q = torch.randn(2, 24, 8), torch.randn(6, 8)  # 2 KV heads of 3 query heads, 12 full blocks of 2
    every = torch.ones(2, 12, 8, dtype=torch.bool)
    lse = block_channel_lse(q, keys, 12, 2, 0.5, every)  # (Hq, N)
    mass = block_channel_mass(q, keys, 12, 2, 0.5, every).reshape(6, 12)
    torch.testing.assert_close(torch.softmax(lse, dim=-1), mass)
    torch.testing.assert_close(lse, exact_block_lse(q, keys, 12, 2, 0.5))  # every channel kept: exact


def test_feedback_raises_the_blocks_the_last_step_attended_to_their_exact_scores():
    estimate = torch.tensor([[0.1, 0.5, 0.2, 0.9]])  # (Hq, N): this step's, one block more than before
    chosen = torch.tensor([[True, False, True]])  # the last step attended blocks 0 and 2
    true = torch.tensor([[0.7, 0.9, 0.05]])
    assert torch.equal(fed_back(estimate, chosen, true, "max"), torch.tensor([[0.7, 0.5, 0.2, 0.9]]))
    assert torch.equal(fed_back(estimate, chosen, true, "exact"), torch.tensor([[0.7, 0.5, 0.05, 0.9]]))


def test_two_stage_channels_over_every_block_with_exact_keys_is_the_mass_oracle():
    torch.manual_seed(0)
    config = hybrid(block_size=2, token_budget=10, sink_blocks=1, window_blocks=1)
    keys, q = torch.randn(2, 24, 8) * 2, torch.randn(6, 8)  # 2 KV heads of 3 query heads, 12 full blocks
    chosen, loaded = two_stage_channel_blocks(config, q, keys, keys, 12, 0.5, channels=2, share=1)
    probs = torch.softmax(0.5 * (q.view(2, 3, 8) @ keys.transpose(1, 2)), dim=-1)  # (Hkv, G, L)
    want, _ = top_blocks_by_mass(config, probs.view(6, 12, 2).sum(-1), 2)
    assert torch.equal(chosen, want) and loaded.tolist() == [4, 4]


def test_block_channels_keep_whole_pairs_and_score_as_the_channel_mass_with_every_channel():
    torch.manual_seed(1)
    keys, q = torch.randn(2, 24, 8), torch.randn(6, 8)  # 2 KV heads of 3 query heads, 6 blocks of 4
    keys[0, :4, [1, 5]] *= 50  # block 0 of head 0 spreads on pair 1
    one_pair = block_channels("std", 2, keys, 4, None)  # (Hkv, N, D)
    assert one_pair.sum(-1).eq(2).all() and torch.equal(one_pair[..., :4], one_pair[..., 4:])
    assert one_pair[0, 0].nonzero().flatten().tolist() == [1, 5]
    profile = torch.zeros(6, 8)
    profile[:, 3] = 1.0  # the queries live on pair 3: with the query weight every block keeps it
    assert block_channels("stdq", 2, keys, 4, profile)[..., 3].all()
    every = block_channels("std", 8, keys, 4, None)
    torch.testing.assert_close(block_channel_mass(q, keys, 6, 4, 0.5, every), channel_mass(q, keys, 6, 4, 0.5, 8))


def test_calibrated_channels_pick_pairs_from_keys_or_prompt_queries():
    keys = torch.ones(1, 10, 8)
    keys[0, :, 2] = 9.0  # pair 2 by key size
    queries = torch.ones(2, 8)
    queries[:, 7] = 9.0  # pair 3 by prompt query size (summed over the group of 2)
    assert calibrated_channels("keys", 2, keys, None).tolist() == [[2, 6]]
    assert calibrated_channels("pq", 2, keys, queries).tolist() == [[3, 7]]
    assert calibrated_channels("pq1", 1, keys, queries).tolist() == [[7]]
    with pytest.raises(ValueError, match="record again"):
        calibrated_channels("pq", 2, keys, None)


def test_variant_configs():
    configs = variant_configs(["default", "x=metadata_sub_blocks:2"], 256)
    assert configs["default"] == hybrid(token_budget=256)
    assert configs["x"].metadata_sub_blocks == 2
    with pytest.raises(ValueError, match="unknown variant"):
        variant_configs(["nope"], 256)


@pytest.mark.slow
def test_diagnostics_cli_end_to_end_on_the_default_model(tmp_path):
    """One niah_single_1 prompt at ~1K tokens, 2 decode steps, two variants, and the real-path answer check."""
    pytest.importorskip("long_context_eval")
    from eval.accuracy.selection_diagnostics import main

    argv = ["--tasks", "niah_single_1", "--length", "1024", "--samples", "1", "--steps", "2", "--budgets", "128"]
    argv += ["--variants", "default,hybrid_s8,oracle", "--answers", "1", "--max-new-tokens", "8"]
    argv += ["--answer-variants", "default,hybrid_s8", "--out", str(tmp_path)]
    result = main(argv + ["--cache-dir", str(tmp_path / "rec")])
    assert set(result["summaries"]) == {f"niah_single_1|128|{v}" for v in ("default", "hybrid_s8", "oracle")}
    for summary in result["summaries"].values():
        assert 0 < summary["recall"] <= 1 and 0 < summary["attended"] <= 1 + 1e-6
        assert 0 < summary["loaded_fraction"] < 1
        assert len(summary["recall_per_layer"]) == 30
    # the oracle loads exactly its budget per KV head: 3 full blocks of 32 + the tail, of ~1K tokens
    assert result["summaries"]["niah_single_1|128|oracle"]["loaded_fraction"] < 128 / 900
    assert {r["method"] for r in result["real_answers"]} == {"dense", "default_128", "hybrid_s8_128"}
    for name in ("diagnostics.json", "diagnostics.md", "recall_per_layer.png"):
        assert (tmp_path / name).is_file()
    again = main(argv + ["--cache-dir", str(tmp_path / "rec")])  # from the cached recording: same numbers
    assert again["summaries"] == result["summaries"]


def test_longbench_takes_the_same_method_families():
    from eval.accuracy.longbench import parse_args as longbench_args
    from eval.common import metadata_kinds

    args = longbench_args(
        ["--tasks", "multi_news", "--budgets", "512", "--metadata", "channels,quest", "--variant", "b16:block_size=16"]
    )
    methods = sparse_methods([512], metadata_kinds(args.metadata), args.variant)
    assert [m.name for m in methods] == ["dense", "sparse_512", "quest_512", "b16_512"]
    assert longbench_args(["--tasks", "multi_news"]).metadata == SparseServeConfig().metadata
    assert metadata_kinds("none") == [] and metadata_kinds(" quest , cuboid ") == ["quest", "cuboid"]
    with pytest.raises(ValueError, match="--metadata"):
        metadata_kinds(" , ")


def test_one_layers_exact_attention_chooses_for_the_layers_after_it():
    """`reuse_*`: from the source layer on, every layer loads the blocks the source layer's true
    attention picks (pooled over its heads: one set for every KV head); before it, the layer's own
    metadata selection. Layer 1's keys point at block 3, layer 0's and 2's elsewhere."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, size, length = 4, 2, 8, 4, 8 * 4 + 1  # 8 full blocks and the decoding token
    keys = [torch.randn(kv_heads, length, dim, generator=gen) * 0.1 for _ in range(3)]
    queries = [torch.randn(heads, 1, dim, generator=gen) for _ in range(3)]
    keys[1][:, 12:16] = queries[1][0, 0] * 4  # block 3 of layer 1 matches its first query head strongly
    rec = Recording(queries, keys, torch.tensor([length - 1]), torch.zeros(length, dtype=torch.bool), 1.0, "")
    config = hybrid(block_size=size, token_budget=4 * size, selection="kv_head")  # 3 full blocks
    (picks,) = reused_blocks(rec, config, 1, "pool")  # one step
    assert picks.shape == (kv_heads, 8) and torch.equal(picks[0], picks[1])
    assert picks[0].nonzero().flatten().tolist() == [0, 3, 7]  # sink, the block layer 1 reads, window
    assert REUSED["reuse_l2_pool"] == (2, "pool")
    stats = evaluate_recording(rec, {"reuse_l2_pool": config, "kv_head": config})
    loaded = stats["reuse_l2_pool"]["loaded_fraction"]  # (layers, Hq, T)
    assert loaded.shape == (3, heads, 1) and torch.allclose(loaded, stats["kv_head"]["loaded_fraction"])
    for key in ("attended", "recall"):  # layers 0 and 1 select with their own metadata, as kv_head does
        assert torch.equal(stats["reuse_l2_pool"][key][:2], stats["kv_head"][key][:2])


def test_feedback_and_pooled_variants_run_over_a_recording_and_load_what_their_base_loads():
    """Over 3 decode steps the feedback variants keep their base's loads (one pick per KV head), and the
    feedback changes nothing on the first step (nothing was attended before it); a pooled variant loads
    per layer what its base loads, however the heads share it."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, size, steps = 4, 2, 64, 4, 3  # 24 stored channels of 64, as the default model
    length = 10 * size + steps  # 10 full blocks by the last step
    keys = [torch.randn(kv_heads, length, dim, generator=gen) for _ in range(2)]
    queries = [torch.randn(heads, steps, dim, generator=gen) for _ in range(2)]
    positions = torch.arange(length - steps, length)
    rec = Recording(queries, keys, positions, torch.zeros(length, dtype=torch.bool), 0.5, "",
                    prompt_query_abs=[q.abs().mean(1) for q in queries],
                    prompt_last_query=[torch.randn(heads, dim, generator=gen) for _ in range(2)])  # fmt: skip
    config = hybrid(block_size=size, token_budget=4 * size, selection="kv_head")
    base = "blockch_std_p24_q2"
    names = [base, f"{base}_fblse", f"{base}_fbmax", f"{base}_fbprefill", f"{base}_pooled2", "oracle_pooled2"]
    stats = evaluate_recording(rec, dict.fromkeys(names, config))
    for name in names:
        assert stats[name]["loaded_fraction"].shape == (2, heads, steps)
    for name in names[1:4]:
        torch.testing.assert_close(stats[name]["loaded_fraction"], stats[base]["loaded_fraction"])
    for name in names[1:3]:  # no feedback before the first step
        assert torch.equal(stats[name]["recall"][:, :, 0], stats[base]["recall"][:, :, 0])
    for name in names[4:]:  # per layer and step, the heads' loads add up to the fixed budget's
        torch.testing.assert_close(stats[name]["loaded_fraction"].sum(1), stats[base]["loaded_fraction"].sum(1))
