"""Fixtures of the integration tests (helpers live in tests/tiny_models.py)."""

from __future__ import annotations

import pytest

from tiny_models import tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")
