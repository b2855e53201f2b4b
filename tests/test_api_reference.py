"""docs/api.md is what `docs/api_reference.py` writes from today's docstrings, and covers the public API."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import sparseserve_hf

ROOT = Path(__file__).resolve().parents[1]


def load_generator():
    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "docs" / "api_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_is_current():
    generator = load_generator()
    assert generator.main(["--check"]) == 0, "run: python docs/api_reference.py"


def test_the_reference_covers_every_public_name_and_the_users_methods():
    text = load_generator().render()
    for name in sparseserve_hf.__all__:
        assert f"### `sparseserve_hf.{name}`" in text, name
    for method in ("Generator.generate", "Generator.stream", "Generator.submit", "SparseServeCache.stats"):
        assert f"#### `{method}`" in text, method  # inherited from the package's own bases too
    assert "(no docstring)" not in text
    assert "| `--token-budget` |" in text  # the server command's options, from its parser
    assert "'int'" not in text  # annotations as written, not as quoted strings
