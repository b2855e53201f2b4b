"""`channel_feedback`: a decode step's exact per-block log-sum-exps raise the next step's channel
estimates. The config's rule, the op, the numbers reaching the scorer through the drop-in, rows that
keep their own numbers, and the batch that equals its requests one by one (graphs included)."""

from __future__ import annotations

import pytest
import torch
from gen_support import prompt

from sparseserve_hf import Generator, SamplingParams, SparseServeCache, SparseServeConfig
from sparseserve_hf.ops import channels

FEEDBACK = dict(
    metadata="channels", selection="kv_head", group_aggregation="sum", channel_feedback=True, block_size=16,
    token_budget=48,
)  # fmt: skip


def test_the_config_takes_feedback_only_where_it_applies():
    assert SparseServeConfig(metadata="channels", channel_feedback=True).channel_feedback
    assert SparseServeConfig().feeds_back  # on by default, with the default channel metadata
    assert not SparseServeConfig(channel_feedback=False).feeds_back
    with pytest.raises(ValueError, match="channel_feedback applies to metadata='channels'"):
        SparseServeConfig(metadata="hybrid", channel_feedback=True)  # hybrid scores ranks, not log-sum-exps
    with pytest.raises(ValueError, match="channel_feedback must be a bool"):
        SparseServeConfig(metadata="channels", channel_feedback=1)
    with pytest.raises(NotImplementedError, match="channel_feedback needs the Triton or torch"):
        SparseServeConfig(metadata="channels", channel_feedback=True, backend="flash")


def test_the_last_steps_numbers_raise_the_estimates_of_the_blocks_it_attended():
    estimate = torch.tensor([[[0.0, -1.0, 2.0, float("-inf")], [1.0, 1.0, 1.0, 1.0]]])  # (B=1, Hq=2, N=4)
    picked = torch.tensor([[[1, 2, 0]]])  # (B, Hkv=1, U=3): table positions the KV head loaded
    exact = torch.tensor([[[3.0, 1.5, float("-inf")], [0.5, float("-inf"), 4.0]]])  # (B, Hq, U)
    raised = channels.with_feedback(estimate, (picked, exact))
    # head 0: block 1 raised to 3, block 2 keeps its larger estimate; head 1: block 0 raised to 4
    assert raised.tolist() == [[[0.0, 3.0, 2.0, float("-inf")], [4.0, 1.0, 1.0, 1.0]]]
    assert torch.equal(channels.with_feedback(estimate, None), estimate)
    outside = channels.with_feedback(estimate, (torch.tensor([[[3, 3, 3]]]), torch.full((1, 2, 3), 9.0)))
    assert outside[0, 0, 3] == float("-inf")  # a block the table does not hold stays out
    mass = channels.block_mass(raised)
    torch.testing.assert_close(mass.masked_fill(mass.isneginf(), 0).sum(-1), torch.ones(1, 2))  # one softmax per head


def decode(model, cache, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Greedy steps of `model` over `cache` after prefilling `ids`; returns each step's tokens."""
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        for _ in range(steps):
            token = logits[:, -1:].argmax(-1)
            out.append(token)
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
    return out


def test_each_step_hands_its_exact_numbers_to_the_next_steps_scorer(llama, monkeypatch):
    seen = []
    real = channels.with_feedback
    monkeypatch.setattr(channels, "with_feedback", lambda lse, fed: seen.append(fed) or real(lse, fed))
    cache = SparseServeCache(llama.config, SparseServeConfig(**FEEDBACK))
    ids = torch.tensor([prompt(150, seed=3), prompt(150, seed=4)])
    decode(llama, cache, ids, 4)
    fed = [f for f in seen if f is not None]
    assert len(fed) >= len(cache.layers)  # every sparse layer from its second decode step on
    picked, exact = fed[-1]
    layer = cache.layers[-1]
    assert exact is layer.feedback_lse and picked is layer.feedback_picked  # read in place
    finite = torch.isfinite(exact)
    assert finite.any() and not exact.isnan().any()
    assert finite.shape == (2, llama.config.num_attention_heads, picked.shape[-1])


def test_rows_take_their_numbers_with_them(llama):
    cache = SparseServeCache(llama.config, SparseServeConfig(**FEEDBACK))
    ids = torch.tensor([prompt(150, seed=n) for n in range(3)])
    decode(llama, cache, ids, 3)
    layer = cache.layers[0]
    before_lse, before_picked = layer.feedback_lse.clone(), layer.feedback_picked.clone()
    cache.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.feedback_lse, before_lse[[2, 0]])
    assert torch.equal(layer.feedback_picked, before_picked[[2, 0]])
    cache.crop(20)  # cut into saved blocks: the numbers may name blocks the rows no longer hold
    assert layer.feedback_lse.isneginf().all()


def generator_outputs(model, config: SparseServeConfig, prompts, params, one_by_one: bool):
    if not one_by_one:
        return [o.token_ids for o in Generator(model, None, config).generate(prompts, params)]
    return [Generator(model, None, config).generate([p], params)[0].token_ids for p in prompts]


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "static-step"])
def test_a_batch_with_feedback_equals_its_requests_one_by_one(llama, cuda_graphs):
    """Rows join, sit out and leave (slots reused by other requests): a row never scores from numbers
    another request left in its slot."""
    config = SparseServeConfig(**FEEDBACK, max_batch=3, hbm_cache_bytes=36 * 2048, cuda_graphs=cuda_graphs)
    prompts = [prompt(n, seed=n) for n in (5, 37, 80, 130, 16, 1)]
    params = SamplingParams(max_new_tokens=24)
    batch = generator_outputs(llama, config, prompts, params, one_by_one=False)
    assert batch == generator_outputs(llama, config, prompts, params, one_by_one=True)


def test_rows_keep_their_numbers_wherever_they_move_and_new_rows_start_without(llama):
    cache = SparseServeCache(llama.config, SparseServeConfig(**FEEDBACK))
    decode(llama, cache, torch.tensor([prompt(150, seed=n) for n in range(3)]), 3)
    layer = cache.layers[0]
    before = layer.feedback_lse.clone()
    popped = cache.pop_rows([2])  # row 2 leaves with its numbers; rows 0 and 1 keep theirs
    assert torch.equal(popped.layers[0].feedback_lse, before[[2]])
    assert torch.equal(layer.feedback_lse, before[[0, 1]])
    cache.append_rows(popped)
    assert torch.equal(layer.feedback_lse, before)
    taken = cache.take_rows([1])  # slot 1 becomes vacant and knows nothing
    assert torch.equal(taken.layers[0].feedback_lse, before[[1]])
    assert layer.feedback_lse[1].isneginf().all() and torch.equal(layer.feedback_lse[0], before[0])
    cache.place_rows(taken, [1])  # back into its slot with its own numbers, as it would decode alone
    assert torch.equal(layer.feedback_lse, before)
    fresh = SparseServeCache(llama.config, SparseServeConfig(**FEEDBACK), store=cache.store)
    decode(llama, fresh, torch.tensor([prompt(150, seed=7)]), 0)  # prefilled, no decode step yet: no numbers
    vacated = cache.take_rows([0])
    cache.place_rows(fresh, [0])  # a new row in a slot another request left: it starts without numbers
    assert layer.feedback_lse[0].isneginf().all() and torch.equal(layer.feedback_lse[1:], before[1:])
    assert torch.equal(vacated.layers[0].feedback_lse, before[[0]])
