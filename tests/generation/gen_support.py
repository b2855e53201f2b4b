"""Shared helpers of the Generator tests: the tiny models of tests/integration/conftest.py, by path.

Loaded under its own module name: several test folders have a `conftest` module of their own.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "integration_conftest", Path(__file__).resolve().parents[1] / "integration" / "conftest.py"
)
_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_models)

VOCAB, PAD = _models.VOCAB, _models.PAD
tiny_model, random_ids, tiny_config = _models.tiny_model, _models.random_ids, _models.tiny_config
greedy, left_pad = _models.greedy, _models.left_pad


def integration_helpers() -> dict[str, object]:
    """The public non-fixture names of tests/integration/conftest.py (see this folder's conftest.py)."""
    return {
        name: value
        for name, value in vars(_models).items()
        if not name.startswith("_")
        and "fixture" not in type(value).__name__.lower()
        and not hasattr(value, "_pytestfixturefunction")
    }


def prompt(length: int, seed: int) -> list[int]:
    """A random prompt of `length` ids (no pad id)."""
    return random_ids(1, length, seed=seed)[0].tolist()


def stock_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """New tokens of stock greedy `model.generate` on one prompt (no special cache)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD)
    return out[0, len(ids) :].tolist()
