"""Fixtures of the Generator tests (tiny random models from tests/tiny_models.py)."""

from __future__ import annotations

import pytest

from tiny_models import tiny_model


@pytest.fixture(scope="module")
def llama():
    """Tiny fp32 Llama, 4 query / 2 KV heads, 2 layers, loaded with attn_implementation="sparseserve"."""
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llama_sdpa():
    """The same weights under stock SDPA attention."""
    return tiny_model("llama", "sdpa")
