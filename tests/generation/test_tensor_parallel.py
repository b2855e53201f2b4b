"""SparseServeCache and the Generator under transformers' tensor parallelism (`tp_plan="auto"`),
2 CPU ranks over gloo.

Each rank's attention sees half of the KV heads; the cache sizes itself to them (one HBM partition
per local KV head) and selects per local KV head, so nothing about blocks crosses ranks. The
Generator's ranks agree on admission's numbers each step (`generation.lockstep`) and so take the
same steps. Greedy tokens must equal a single process's with the same config, on every rank.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import tiny_model

WORKER = Path(__file__).with_name("tp_worker.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(command: list[str], out: Path, cwd: Path | None = None) -> dict:
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.core
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_tensor_parallel_generate_equals_one_process(tmp_path, kv_heads):
    folder = tmp_path / "tiny"
    tiny_model("llama", attn="sdpa", num_heads=2 * kv_heads, num_kv_heads=kv_heads).save_pretrained(folder)
    alone = run([sys.executable, str(WORKER), str(folder), str(tmp_path / "one.json")], tmp_path / "one.json")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    ranks = run([*launch, str(WORKER), str(folder), str(tmp_path / "tp.json"), "--tp"], tmp_path / "tp.json")
    assert ranks["world"] == 2 and alone["world"] == 1
    assert ranks["tokens"] == alone["tokens"]
    assert ranks["cache_kv_heads"] == ranks["tail_kv_heads"] == kv_heads // 2 and alone["cache_kv_heads"] == kv_heads
    assert ranks["hbm_partitions"] * 2 == alone["hbm_partitions"]  # one per (sparse layer, local KV head)
    assert ranks["misses"] > 0 and alone["misses"] > 0


@pytest.mark.core
@pytest.mark.parametrize("paced", [False, True], ids=["unpaced", "prefill-paced"])
def test_tensor_parallel_generator_equals_one_process(tmp_path, paced):
    """With `target_tbt_ms` each rank times its own work, so its pacer may allow another budget (here
    rank 0's one unit per iteration, rank 1's all of it): the ranks agree on the smallest, or their
    prefills would part and the next collective would pair different layers' all-reduces."""
    folder = tmp_path / "tiny"
    tiny_model("llama", attn="sdpa", num_heads=8, num_kv_heads=4).save_pretrained(folder)
    flags = ["--generator", *(["--paced"] if paced else [])]
    alone = run([sys.executable, str(WORKER), str(folder), str(tmp_path / "one.json"), *flags], tmp_path / "one.json")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    command = [*launch, str(WORKER), str(folder), str(tmp_path / "tp.json"), "--tp", *flags]
    ranks = run(command, tmp_path / "tp.json")
    assert (ranks["pacing_token_layer_us"] is not None) == paced
    assert ranks["tokens"] == alone["tokens"] and all(len(t) == 16 for t in ranks["tokens"])
    assert ranks["cache_kv_heads"] == 2 and alone["cache_kv_heads"] == 4
    assert ranks["hbm_partitions"] * 2 == alone["hbm_partitions"]
    assert ranks["misses"] > 0 and ranks["mean_decode_batch"] > 1  # rows really decoded together


def test_tp_step_benchmark_dry_run_compares_two_ranks_with_one(tmp_path):
    """eval.bench.tp_step at TP=1 then TP=2 (gloo) into one JSON: the step ratio, and equal tokens with
    the loads following the selection trace by each rank's own KV heads."""
    out, models = tmp_path / "tp.json", tmp_path / "models"
    repo = Path(__file__).resolve().parents[2]
    common = ["-m", "eval.bench.tp_step", "--dry-run", "--model-dir", str(models), "--out", str(out)]
    run([sys.executable, *common], out, cwd=repo)  # `-m eval...` from the repository root
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    result = run([*launch, *common], out, cwd=repo)
    assert result["tp1"]["kv_heads_per_rank"] == 2 and result["tp2"]["kv_heads_per_rank"] == 1
    assert result["tp2_step_over_tp1"] > 0 and result["tp2_tokens_equal_tp1"] is True
    assert all(len(tokens) == 6 for tokens in result["tp2"]["tokens"]) and result["tp2"]["decode_iterations"] == 4
