"""PositionLimit (beside the ModelShape a cache is built for): the one place that reads and enforces
`max_position_embeddings`."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparseserve_hf.cache.forward_log import PositionLimit

SRC = Path(__file__).resolve().parents[2] / "src" / "sparseserve_hf"


def test_positions_below_the_limit_exist_and_a_config_without_one_has_every_position():
    limit = PositionLimit.of(SimpleNamespace(max_position_embeddings=8))
    assert limit == PositionLimit(8) and limit.has(7) and not limit.has(8)
    unbounded = PositionLimit.of(SimpleNamespace())
    assert unbounded.limit is None and unbounded.has(10**9)
    unbounded.check(10**9, "anything")


def test_a_position_past_the_limit_is_refused_naming_what_needed_it():
    PositionLimit(8).check(7, "the prompt")
    with pytest.raises(
        ValueError, match=r"the prompt needs position 8, past the model's max_position_embeddings \(8: positions 0..7\)"
    ):
        PositionLimit(8).check(8, "the prompt")


def test_the_package_reads_max_position_embeddings_only_through_position_limit():
    readers = [
        path.relative_to(SRC).as_posix()
        for path in SRC.rglob("*.py")
        if re.search(r"""getattr\([^)]*["']max_position_embeddings["']|\.max_position_embeddings\b""", path.read_text())
    ]
    assert readers == ["cache/forward_log.py"]
