"""eval.working_set_hits on the real default model, small: the cache at twice the working set, the steady hit rate."""

from __future__ import annotations

import json

import pytest

from eval import working_set_hits
from sparseserve_hf.data.models import ModelNotAvailableError, prepare_default_model

pytestmark = pytest.mark.slow


def test_twice_the_working_set_serves_steady_decode_with_the_same_tokens(tmp_path):
    try:
        prepare_default_model()
    except ModelNotAvailableError as exc:
        pytest.skip(f"real default model not installed: {exc}")
    out = tmp_path / "hits.json"
    result = working_set_hits.main(["--length", "1024", "--budgets", "128", "--steps", "16", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    (row,) = result["runs"]
    assert row["tokens_equal"]  # where a block is read from never changes what is attended
    assert row["hbm_cache_bytes"] >= 2 * row["working_set_peak_bytes"] and row["working_set_peak_blocks"] > 0
    assert 0.5 < row["steady_hit_rate"] <= 1.0 and row["steady_lookups"] > 0
    assert row["config"]["hbm_cache_bytes"] == row["hbm_cache_bytes"] and row["config"]["token_budget"] == 128
    with pytest.raises(ValueError, match="--steps must exceed"):
        working_set_hits.main(["--length", "1024", "--steps", "12"])
