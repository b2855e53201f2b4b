"""One cache used under torch.inference_mode, torch.no_grad and plain grad mode alternately, as DynamicCache can be."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import DynamicCache

from sparseserve_hf import SparseServeCache, SparseServeConfig
from tiny_models import PAD, random_ids

MODES = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "plain": contextlib.nullcontext,  # grad on: `generate` turns it off itself, a bare forward does not
}


def conversation(model, cache, modes: list[str], fresh=None) -> list[torch.Tensor]:
    """Four turns over one cache, each in its own grad mode: generate; a bare forward of new text
    then generate; `reset()` and a new prompt; and that conversation continued.

    `fresh`: makes a new cache in place of `reset()` (transformers 5.17's `DynamicCache.reset()`
    zeroes its tensors but keeps their length, so the baseline starts over with a new one)."""
    generate = dict(max_new_tokens=5, do_sample=False, pad_token_id=PAD)
    contexts = [MODES[m] for m in modes]
    with contexts[0]():
        turn1 = model.generate(random_ids(1, 60), past_key_values=cache, **generate)
    with contexts[1]():
        extra = random_ids(1, 30, seed=2)
        # The new user text through a forward of its own (after turn 1's last token, which generate
        # never feeds back); its last token is left for generate, which needs one uncached input.
        model(torch.cat((turn1[:, -1:], extra[:, :-1]), dim=1), past_key_values=cache)
        turn2 = model.generate(torch.cat((turn1, extra), dim=1), past_key_values=cache, **generate)
    with contexts[2]():
        if fresh is None:
            cache.reset()
        else:
            cache = fresh()
        turn3 = model.generate(random_ids(1, 50, seed=3), past_key_values=cache, **generate)
    with contexts[3]():
        turn4 = model.generate(torch.cat((turn3, random_ids(1, 20, seed=4)), dim=1), past_key_values=cache, **generate)
    return [turn1, turn2, turn3, turn4]


@pytest.mark.core
@pytest.mark.parametrize(
    "modes",
    [
        ["inference_mode", "no_grad", "plain", "inference_mode"],
        ["plain", "inference_mode", "no_grad", "plain"],
        ["no_grad", "plain", "inference_mode", "no_grad"],
    ],
    ids=lambda modes: "-".join(modes),
)
def test_grad_modes_alternate_and_tokens_equal_dynamic_cache(llama, modes):
    cache = SparseServeCache(llama.config, SparseServeConfig(block_size=16, token_budget=4096))
    dynamic = lambda: DynamicCache(config=llama.config)
    expected = conversation(llama, dynamic(), modes, fresh=dynamic)
    got = conversation(llama, cache, modes)
    for mine, theirs in zip(got, expected):
        assert torch.equal(mine, theirs)
    assert cache.get_seq_length() == got[3].shape[1] - 1  # the last sampled token is never fed back
    cache.reset()
    stats = cache.stats()
    assert (stats["dram_bytes"], stats["hbm_bytes"]) == (0, 0)


@pytest.mark.core
def test_a_bare_forward_with_grad_stores_no_graph(llama):
    """Stored keys are data: a forward with grad on leaves no autograd history in the cache's tensors."""
    cache = SparseServeCache(llama.config, SparseServeConfig(block_size=16, token_budget=64))
    llama(random_ids(1, 40), past_key_values=cache)  # grad on (the weights require grad)
    for layer in cache.layers:
        assert not layer.tail.requires_grad and layer.tail.grad_fn is None
    assert not cache.store.metadata.requires_grad
