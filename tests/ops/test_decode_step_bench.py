"""eval/bench/decode_step.py runs end to end at tiny shapes (--dry-run, with --graph) on CPU and writes the target keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_decode_step_dry_run_writes_its_ratios(tmp_path):
    out = tmp_path / "decode_step.json"
    subprocess.run(
        [
            sys.executable, "-m", "eval.bench.decode_step", "--dry-run", "--graph", "--out", str(out),
            "--set", "metadata_dtype=float8_e4m3fn", "--knob", "triton_decode.PROGRAMS_PER_SM=3",
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result = json.loads(out.read_text())
    stock_keys = ("stock_dynamic_ms", "stock_dynamic_expandable_ms", "stock_static_ms")
    for key in (*stock_keys, "stock_best_ms", "hbm_copy_gb_per_s", "pcie_h2d_gb_per_s"):
        assert result[key] > 0, key
    assert result["stock_best_ms"] == min(result[key] for key in stock_keys) and result["stock_dynamic_error"] is None
    windows = result["stock_dynamic_windows_ms"]
    assert len(windows) == 3 and result["stock_dynamic_ms"] == min(windows)  # the fastest window counts
    assert "--dry-run" in result["command"] and result["device"] and result["config"]["metadata"] == "channels"
    assert result["config"]["metadata_dtype"] == "float8_e4m3fn"  # --set reached the config
    assert result["workload"]["knob"] == ["triton_decode.PROGRAMS_PER_SM=3"]  # recorded: it changes a launch
    assert result["trace"]["sha256"] and 0 < result["trace"]["overlap_1step"] <= 1
    for name in ("random_kv", "real_locality"):
        block = result[name]
        for key in ("sparse_ms", "graph_ms", "floor_ms", "step_over_floor", "graph_step_over_floor"):
            assert block[key] > 0, (name, key)
        assert 0 < block["hit_rate"] <= 1 and 0 <= block["overlap_1step"] <= 1
        assert set(block["breakdown_ms"]) >= {"scoring", "topk", "table", "transfer", "attention", "other"}
        assert block["selected_kv_bytes"] > 0 and block["metadata_read_us_per_layer"] > 0
        assert block["speedup_vs_best_stock"] == pytest.approx(result["stock_best_ms"] / block["graph_ms"])
        assert block["bookkeeping_eager_us_per_layer"] > 0  # the graph replay time needs CUDA
        assert block["before_attention_eager_us_per_layer"] > 0  # what attention waits for beside the lookup
        assert block["loads"]["decode_steps"] > 0 and 0 < block["loads"]["loaded_fraction"] < 1
    # --graph: CUDA-graph replays on a GPU, the static step run eagerly on CPU; its tokens checked
    equality = result["graph_equality"]
    assert equality["captured"] is torch.cuda.is_available()
    assert equality["tokens_equal_eager_step"] and equality["tokens_equal_eager_path"] and equality["steps"] > 8


def test_the_breakdown_times_the_lookup_before_attention():
    """Beside attention the parts overlap (and the lookup runs on another stream): the instrumented
    pass turns that off while it times, and puts it back."""
    from eval.bench.decode_step_setup import RegionTimer, instrument

    from sparseserve_hf import SparseServeConfig
    from sparseserve_hf.cache.store import TieredBlockStore
    from sparseserve_hf.ops import get_ops

    cpu = torch.device("cpu")
    store = TieredBlockStore(
        SparseServeConfig(block_size=16, hbm_cache_bytes=1 << 20), get_ops("torch", cpu), 16, torch.float32, cpu
    )
    assert store.lookup_beside
    restore = instrument(store, RegionTimer(cpu))
    assert not store.lookup_beside
    restore()
    assert store.lookup_beside


def test_stock_that_does_not_fit_the_card_is_recorded_with_why(monkeypatch):
    """Stock's DynamicCache of B=16 x 32K on the 8B shape (68 GB of KV beside 15 GB of weights) fills an 80 GB card:
    the benchmark records why stock is missing and goes on to measure ours."""
    from eval.bench import decode_step

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1018.00 MiB.\nmore detail")

    monkeypatch.setattr(decode_step, "measure_dense", out_of_memory)
    dense, windows, why = decode_step.dense_or_why(None, torch.device("cpu"), torch.float32, "tiny")
    assert dense is None and windows is None
    assert why == "out of memory: CUDA out of memory. Tried to allocate 1018.00 MiB."
    monkeypatch.setattr(decode_step, "measure_dense", lambda *args: (2.0, [2.5, 2.0]))
    assert decode_step.dense_or_why(None, torch.device("cpu"), torch.float32, "tiny") == (2.0, [2.5, 2.0], None)
