"""eval.serving.http_overhead and eval/h200_http.sh: the same trace through the server and in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from eval.bench.decode_step_setup import SHAPES
from eval.serving.http_load import synthetic_trace, warmup_trace
from eval.serving.http_overhead import compare, markdown, ours_engine_config, serve_flags
from served import ROOT
from transformers import LlamaConfig

from sparseserve_hf import SparseServeConfig
from sparseserve_hf.serve import cli

GIB = 1 << 30


def test_serve_flags_give_the_serve_command_ours_config_at_the_8b_shape(tmp_path):
    """The options `serve-flags` prints parse back, through the serve command, to eval.serving's config."""
    LlamaConfig(**SHAPES["llama3-8b"], max_position_embeddings=40960).save_pretrained(tmp_path)
    config = ours_engine_config(tmp_path, torch.bfloat16, 40 * GIB, 8 * GIB, 48 * GIB, 16)
    flags = serve_flags(config)
    assert cli.engine_config(cli.parse_args(["serve", *flags])) == config
    assert config.cuda_graphs and config.max_batch == 16 and config.dram_bytes == 48 * GIB
    assert "--cuda-graphs" in flags
    assert 0 < config.hbm_cache_bytes < 17 * GIB  # the cap less ~15 GiB of weights, the headroom and metadata


def test_the_serve_command_paces_prefill_to_a_target_time_between_tokens():
    config = SparseServeConfig(target_tbt_ms=80.0, max_inject_tokens=4096)
    flags = serve_flags(config)
    assert flags[flags.index("--target-tbt-ms") + 1] == "80.0"
    assert cli.engine_config(cli.parse_args(["serve", *flags])) == config
    with pytest.raises(ValueError, match="target_tbt_ms"):
        cli.engine_config(cli.parse_args(["serve", "--target-tbt-ms", "0"]))


def test_the_serve_command_reserves_decode_room_at_admission_unless_told_not_to():
    config = SparseServeConfig(reserve_decode=False)
    assert serve_flags(config) == ["--no-reserve-decode"]
    assert cli.engine_config(cli.parse_args(["serve", "--no-reserve-decode"])) == config
    assert cli.engine_config(cli.parse_args(["serve"])).reserve_decode


def test_serve_flags_refuse_a_field_the_serve_command_cannot_set():
    with pytest.raises(ValueError, match="offload"):
        serve_flags(SparseServeConfig(offload=False))


def test_the_warmup_is_the_traces_first_requests_all_at_time_zero():
    trace = synthetic_trace(5, prompt_tokens=8, output_tokens=3, vocab=50, seed=1)
    warm = warmup_trace(trace, 2)
    assert [r.index for r in warm.requests] == [-1, -2]
    assert [r.prompt for r in warm.requests] == [r.prompt for r in trace.requests[:2]]
    assert warm.arrivals(0.5) == [0.0, 0.0]


def test_compare_subtracts_in_process_from_http():
    def run(ttft: float, failed: int) -> dict:
        return {"rate": 1.0, "trace": synthetic_trace(2, 4, 2, 50, 0).summary(), "run": {"device": "cpu", "git_commit": ""},
                "summary": {"p50_ttft_s": ttft, "p99_ttft_s": None, "failed": failed}}  # fmt: skip

    comparison = compare(run(0.25, 1), run(0.125, 0))
    assert comparison["metrics"]["p50_ttft_s"]["http_minus_in_process"] == 0.125
    assert comparison["metrics"]["p99_ttft_s"]["http_minus_in_process"] is None
    assert comparison["metrics"]["failed"]["http_minus_in_process"] == 1
    table = markdown(comparison)
    assert "| TTFT p50 (ms) | 250.00 | 125.00 | 125.00 |" in table and "| failed (errors) | 1 | 0 | 1 |" in table


def test_the_script_runs_end_to_end_on_the_tiny_model(tmp_path):
    """TINY=1 bash eval/h200_http.sh: model folder, server, http_load, SIGTERM (exit 0), in-process, comparison."""
    env = os.environ | {"TINY": "1", "PYTHON": sys.executable, "MODEL_DIR": str(tmp_path / "model"),
                        "REQUESTS": "4", "OUTPUT_TOKENS": "6", "WARMUP": "1", "STARTUP_S": "180"}  # fmt: skip
    done = subprocess.run(
        ["bash", "eval/h200_http.sh", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "server stopped: exit status 0" in done.stdout
    for name in ("http_load_cpu.json", "in_process_cpu.json"):
        result = json.loads((tmp_path / "out" / name).read_text())
        assert result["summary"]["completed"] == 4 and result["summary"]["failed"] == 0, name
        assert result["warmup"]["completed"] == 1
        assert all(len(r["token_times"]) == 6 for r in result["records"])
    overhead = json.loads((tmp_path / "out" / "http_overhead.json").read_text())
    assert overhead["metrics"]["completed"] == {"http": 4, "in_process": 4, "http_minus_in_process": 0}
    assert (tmp_path / "out" / "http_overhead.md").read_text().startswith("# HTTP overhead")
