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


def run(command: list[str], out: Path) -> dict:
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
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
def test_tensor_parallel_generator_equals_one_process(tmp_path):
    folder = tmp_path / "tiny"
    tiny_model("llama", attn="sdpa", num_heads=8, num_kv_heads=4).save_pretrained(folder)
    alone = run(
        [sys.executable, str(WORKER), str(folder), str(tmp_path / "one.json"), "--generator"], tmp_path / "one.json"
    )
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    command = [*launch, str(WORKER), str(folder), str(tmp_path / "tp.json"), "--tp", "--generator"]
    ranks = run(command, tmp_path / "tp.json")
    assert ranks["tokens"] == alone["tokens"] and all(len(t) == 16 for t in ranks["tokens"])
    assert ranks["cache_kv_heads"] == 2 and alone["cache_kv_heads"] == 4
    assert ranks["hbm_partitions"] * 2 == alone["hbm_partitions"]
    assert ranks["misses"] > 0 and ranks["mean_decode_batch"] > 1  # rows really decoded together
