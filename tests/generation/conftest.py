"""Fixtures of the Generator tests (tiny random models from tests/integration/conftest.py)."""

from __future__ import annotations

import gen_support
import pytest
from gen_support import tiny_model

# tests/integration does `from conftest import ...`; when pytest is given several test folders at once,
# the `conftest` module it finds may be this one, so this one carries the same helpers.
globals().update(gen_support.integration_helpers())


@pytest.fixture(scope="module")
def llama():
    """Tiny fp32 Llama, 4 query / 2 KV heads, 2 layers, loaded with attn_implementation="sparseserve"."""
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llama_sdpa():
    """The same weights under stock SDPA attention."""
    return tiny_model("llama", "sdpa")
