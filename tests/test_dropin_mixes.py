"""The exactness ladder's dense rung through `model.generate`, over seeded mixes of what a user passes.

Each seed draws a model family, a left-padded batch, a decoding mode (greedy, seeded sampling,
beam search), a second turn over the same cache or not, and a `SparseServeConfig` (block size,
metadata, offload, an HBM block cache, sink and window blocks) whose budget holds every block:
the tokens must be stock `generate`'s with its own cache. Each setting is tested alone elsewhere;
these are their combinations.
"""

from __future__ import annotations

import random

import pytest
import torch

from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.compat import cache_kwarg
from tiny_models import PAD, left_pad, random_ids, tiny_model

# Chosen for coverage: two turns over one cache (10, 31, 33, 35, 43), beam search (3, 12, 40, 53),
# seeded sampling (14, 33, 35, 43), Gemma-3 (10, 33, 35, 53), every metadata kind, offload with an
# HBM block cache (3, 10, 12, 14, 33, 40) and without offload (35, 43, 53).
SEEDS = (3, 10, 12, 14, 31, 33, 35, 40, 43, 53)
SECOND_TURN_TOKENS = 7


def draw_mix(seed: int) -> tuple[str, torch.Tensor, torch.Tensor, dict, dict, bool]:
    """(family, ids, attention mask, config fields, generate kwargs, second turn) for `seed`."""
    rng = random.Random(seed)
    family = rng.choice(["llama", "llama", "gemma3"])
    rows = [random_ids(1, rng.randint(5, 150), seed=seed * 7 + i)[0] for i in range(rng.randint(1, 3))]
    ids, mask = left_pad(rows)
    fields = dict(
        block_size=rng.choice([16, 32]),
        token_budget=4096,  # past every sequence here: sparse attention sees every block
        metadata=rng.choice(["hybrid", "quest", "channels", "cuboid"]),
        offload=rng.choice([True, False]),
        hbm_cache_bytes=rng.choice([None, 64 << 20]),
        sink_blocks=rng.choice([0, 1, 2]),
        window_blocks=rng.choice([1, 2]),
    )
    if fields["metadata"] == "channels":
        fields |= dict(selection="kv_head", group_aggregation="sum")
    if not fields["offload"]:
        fields["hbm_cache_bytes"] = None  # every block lives on the device: no block cache to size
    kwargs = dict(max_new_tokens=rng.randint(1, 40), pad_token_id=PAD, do_sample=False)
    mode = rng.choice(["greedy", "sample", "beam"])
    if mode == "sample":
        kwargs |= dict(do_sample=True, top_k=20, temperature=0.9)
    elif mode == "beam":
        kwargs |= dict(num_beams=rng.choice([2, 3]))
    return family, ids, mask, fields, kwargs, rng.choice([1, 1, 2]) == 2 and mode != "beam"


def turns(model, ids, mask, kwargs: dict, cache, second_turn: bool, seed: int) -> list[torch.Tensor]:
    """The new tokens of one `generate` call and, with `second_turn`, of a second one that continues
    the first's output with a few more prompt tokens (over the same cache where there is one)."""
    outputs = []
    for turn in range(2 if second_turn else 1):
        torch.manual_seed(seed)
        extra = {} if cache is None else {cache_kwarg(model): cache}
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **kwargs, **extra)
        outputs.append(out[:, ids.shape[1] :])
        more = random_ids(out.shape[0], SECOND_TURN_TOKENS, seed=seed + 99)
        mask = torch.cat(
            [mask, torch.ones(out.shape[0], out.shape[1] - ids.shape[1] + more.shape[1], dtype=mask.dtype)], 1
        )
        ids = torch.cat([out, more], 1)
    return outputs


@pytest.mark.parametrize("seed", SEEDS)
def test_a_mix_of_generate_settings_gives_stock_tokens_when_the_budget_holds_every_block(seed):
    family, ids, mask, fields, kwargs, second_turn = draw_mix(seed)
    stock = turns(tiny_model(family, "sdpa"), ids, mask, kwargs, None, second_turn, seed)
    model = tiny_model(family)
    ours = turns(
        model, ids, mask, kwargs, SparseServeCache(model.config, SparseServeConfig(**fields)), second_turn, seed
    )
    assert len(ours) == len(stock)
    for mine, theirs in zip(ours, stock):
        assert torch.equal(mine, theirs), (family, fields, kwargs)
