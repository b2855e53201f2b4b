"""`load_budget` end to end: the drop-in and the Generator load at most the cap per KV head, and a
cache sized by the cap serves more rows in one lookup (tiny Llama: 4 query / 2 KV heads, G = 2)."""

from __future__ import annotations

import pytest
import torch
from gen_support import prompt

from sparseserve_hf import Generator, SamplingParams, SparseServeCache, SparseServeConfig

# The group union (the cap's selection), 16-token blocks, budget 96: each query head picks 5 full
# blocks, so a KV head loads up to 10; load_budget=96 caps it at 5 (80 tokens, the tail block on top).
BUDGET = dict(block_size=16, token_budget=96, selection="group_union")
CAP_TOKENS = 96
PROMPTS = (150, 170, 190, 210)


def one_by_one(model, config: SparseServeConfig, prompts, params) -> list[tuple[int, ...]]:
    return [Generator(model, None, config).generate([p], params)[0].token_ids for p in prompts]


def dropin_run(model, ids: torch.Tensor, **overrides) -> tuple[list[int], dict]:
    cache = SparseServeCache(model.config, SparseServeConfig(**BUDGET, **overrides))
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=24, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist(), cache.store.load_summary()


@pytest.mark.core
def test_the_drop_in_loads_at_most_the_cap_and_a_cap_above_the_union_changes_nothing(llama):
    ids = torch.tensor([prompt(200, seed=3)])
    whole, whole_loads = dropin_run(llama, ids)
    assert dropin_run(llama, ids, load_budget=2 * 96)[0] == whole  # G x the budget: no cap
    capped, capped_loads = dropin_run(llama, ids, load_budget=CAP_TOKENS)
    assert capped_loads["loaded_tokens_per_kv_head"] <= CAP_TOKENS
    assert capped_loads["loaded_tokens_per_kv_head"] < whole_loads["loaded_tokens_per_kv_head"]  # the cap binds
    assert len(capped) == 24


@pytest.mark.parametrize("admission", [False, True])
def test_a_cache_sized_by_the_cap_serves_more_rows_and_batches_as_one_by_one(llama, admission):
    """The same HBM cache serves 2 rows at the whole union's worst case and 4 under the cap (every
    lookup then fits its partitions); the capped batch gives each request's tokens alone. Without
    admission all four rows decode together; with it, the working sets decide."""
    probe = Generator(llama, None, SparseServeConfig(**BUDGET, max_batch=8))
    settings = dict(BUDGET, max_batch=8, hbm_cache_bytes=2 * probe.sizes.one_row_hbm_cache_bytes, admission=admission)
    whole = Generator(llama, None, SparseServeConfig(**settings))
    config = SparseServeConfig(**settings, load_budget=CAP_TOKENS)
    capped = Generator(llama, None, config)
    assert (whole.sizes.max_decode_rows, capped.sizes.max_decode_rows) == (2, 4)
    params = SamplingParams(max_new_tokens=12)
    for n in PROMPTS:
        capped.submit(prompt(n, seed=n), params)
    rows, outs = set(), {}
    while capped.has_unfinished:
        outs |= {e.request_id: e.output.token_ids for e in capped.step() if e.output is not None}
        rows.add(capped.batch.num_rows)
    prompts = [prompt(n, seed=n) for n in PROMPTS]
    assert [outs[rid] for rid in sorted(outs)] == one_by_one(llama, config, prompts, params)
    totals = capped.metrics()["totals"]
    assert totals["loaded_tokens_per_kv_head"] <= CAP_TOKENS
    assert totals["hbm_bytes_in_use"] == 0 and totals["dram_bytes_in_use"] == 0
    if not admission:
        assert max(rows) == 4
