"""eval/bench/decode_step.py runs end to end at tiny shapes (--dry-run, with --graph) on CPU and writes T8's keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_decode_step_dry_run_writes_its_ratios(tmp_path):
    out = tmp_path / "decode_step.json"
    subprocess.run(
        [sys.executable, "-m", "eval.bench.decode_step", "--dry-run", "--graph", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result = json.loads(out.read_text())
    for key in ("step_over_floor", "dense_ms", "sparse_ms", "floor_ms", "hbm_copy_gb_per_s", "pcie_h2d_gb_per_s"):
        assert result[key] > 0, key
    assert 0 < result["hit_rate"] <= 1 and "--dry-run" in result["command"] and result["device"]
    assert set(result["breakdown_ms"]) >= {"scoring", "topk", "table", "transfer", "attention", "other"}
    assert result["selected_kv_bytes"] > 0 and result["metadata_bytes"] > 0 and "random" in result["kv_setup"]
    # --graph: CUDA-graph replays on a GPU, the static step run eagerly on CPU; its tokens checked
    assert result["graph_ms"] > 0 and result["graph_step_over_floor"] > 0
    assert result["graph_captured"] is torch.cuda.is_available()
    equality = result["graph_equality"]
    assert equality["tokens_equal_eager_step"] and equality["tokens_equal_eager_path"] and equality["steps"] > 8
