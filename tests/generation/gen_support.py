"""Shared helpers of the Generator tests (tiny models from tests/tiny_models.py)."""

from __future__ import annotations

import torch

from tiny_models import PAD, VOCAB, greedy, left_pad, random_ids, tiny_config, tiny_model  # noqa: F401


def prompt(length: int, seed: int) -> list[int]:
    """A random prompt of `length` ids (no pad id)."""
    return random_ids(1, length, seed=seed)[0].tolist()


def stock_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """New tokens of stock greedy `model.generate` on one prompt (no special cache)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD)
    return out[0, len(ids) :].tolist()
