"""The block oracle's attention function: its blocks, its loads, and the model under it."""

from __future__ import annotations

import torch
from eval.accuracy.oracle_attention import OracleRun, oracle_run, oracle_tokens

from sparseserve_hf import SparseServeConfig
from tiny_models import greedy, left_pad, random_ids, tiny_model

BLOCK = 32


def budget(full_blocks: int, sink: int = 1, window: int = 1) -> SparseServeConfig:
    """A config whose per-KV-head selection keeps `full_blocks` full blocks (sink and window included)."""
    config = SparseServeConfig(
        token_budget=(full_blocks + 1) * BLOCK, sink_blocks=sink, window_blocks=window, selection="kv_head"
    )
    assert config.selected_full_blocks == full_blocks
    return config


def peaked_keys(length: int, hot_blocks: dict[int, list[int]], dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-row query (1, 2, 1, D) of two query heads over one KV head, and keys (1, 1, L, D) that
    are orthogonal to it but in the listed blocks, whose first token aligns with it (more for the
    earlier entries of each list: the block order of their mass)."""
    query = torch.zeros(1, 2, 1, dim)
    query[..., 0] = 1.0
    key = torch.zeros(1, 1, length, dim)
    key[..., 1] = 1.0
    for blocks in hot_blocks.values():
        for rank, block in enumerate(blocks):
            key[0, 0, block * BLOCK, 0] = 10.0 - rank
    return query, key


def test_the_oracle_keeps_sink_window_tail_and_the_heaviest_blocks():
    length = 10 * BLOCK + 5  # 10 full blocks (the last token decodes), a tail of 5
    query, key = peaked_keys(length, {0: [6, 3, 8]})
    run = OracleRun(budget(4))
    allowed = oracle_tokens(query, key, torch.ones(1, length, dtype=torch.bool), 1.0, run)  # (1, 1, L)
    blocks = sorted({t // BLOCK for t in allowed[0, 0].nonzero().flatten().tolist() if t < 10 * BLOCK})
    assert blocks == [0, 3, 6, 9]  # sink 0, window 9, then the two heaviest: 6 and 3 (8 is the third)
    assert allowed[0, 0, 10 * BLOCK :].all()  # the tail is always attended
    assert run.loads()["loaded_tokens_per_kv_head"] == 4 * BLOCK + 5
    assert abs(run.loads()["loaded_fraction"] - (4 * BLOCK + 5) / length) < 1e-6


def test_blocks_count_from_each_rows_first_real_token():
    """Left padding shifts a row's blocks: the same keys behind 7 pad positions give the same choice."""
    length = 6 * BLOCK + 2
    query, key = peaked_keys(length, {0: [3]})
    padded_key = torch.cat((torch.randn(1, 1, 7, key.shape[-1]), key), dim=2)
    real = torch.cat((torch.zeros(1, 7, dtype=torch.bool), torch.ones(1, length, dtype=torch.bool)), dim=1)
    alone = oracle_tokens(query, key, torch.ones(1, length, dtype=torch.bool), 1.0, OracleRun(budget(3)))
    padded = oracle_tokens(query, padded_key, real, 1.0, OracleRun(budget(3)))
    assert torch.equal(padded[..., 7:], alone) and not padded[..., :7].any()


def test_short_rows_attend_everything():
    length = 3 * BLOCK + 1  # 3 full blocks, at most the budget's 4
    query, key = peaked_keys(length, {0: [1]})
    allowed = oracle_tokens(query, key, torch.ones(1, length, dtype=torch.bool), 1.0, OracleRun(budget(4)))
    assert allowed.all()


def test_a_budget_past_the_context_gives_dense_tokens():
    model = tiny_model(attn="sdpa")
    ids = random_ids(2, 5 * BLOCK + 3)
    dense = greedy(model, ids, max_new_tokens=12)
    with oracle_run(model, budget(32)) as run:
        oracle = greedy(model, ids, max_new_tokens=12)
    assert torch.equal(oracle, dense)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert run.loads()["loaded_fraction"] == 1.0


def test_a_small_budget_loads_its_blocks_and_batch_rows_choose_as_alone():
    """Left padding changes only rounding; with these prompts no block choice is close enough to
    flip, so each row's tokens are what it gives alone (near ties could part them)."""
    model = tiny_model(attn="sdpa")
    rows = [random_ids(1, 9 * BLOCK + 4, seed=2)[0], random_ids(1, 6 * BLOCK + 30, seed=3)[0]]
    ids, mask = left_pad(rows)
    with oracle_run(model, budget(3)) as run:
        batched = greedy(model, ids, attention_mask=mask, max_new_tokens=10)
    loads = run.loads()
    assert 3 * BLOCK < loads["loaded_tokens_per_kv_head"] < 4 * BLOCK + BLOCK  # 3 blocks and the tail
    assert loads["loaded_fraction"] < 0.7
    for row, tokens in zip(rows, batched):
        with oracle_run(model, budget(3)):
            alone = greedy(model, row[None], max_new_tokens=10)[0]
        assert torch.equal(alone, tokens)


def test_sliding_window_layers_stay_dense_and_load_nothing():
    """Gemma-3: only its full-attention layers go through the oracle (as only they are sparse in a
    SparseServeCache), so the loads count those layers' decode steps alone."""
    model = tiny_model("gemma3", attn="sdpa", num_layers=3)  # sliding, full, sliding
    ids = random_ids(1, 5 * BLOCK + 3)
    dense = greedy(model, ids, max_new_tokens=6)
    with oracle_run(model, budget(32)) as run:
        assert torch.equal(greedy(model, ids, max_new_tokens=6), dense)
    assert len(run.steps) == 5  # one full layer, the 5 decode steps after the first token
