"""eval.bench.kernel_sass: a kernel built for sm_90 without a GPU, its registers and loop instructions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def kernel_sass(*args: str) -> subprocess.CompletedProcess:
    """The CLI in its own process: the suite runs Triton's interpreter, which builds nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "eval.bench.kernel_sass", *args]
    return subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_channel_kernel_loop_holds_its_multiply_adds(tmp_path):
    out = tmp_path / "sass.json"
    run = kernel_sass("channels", "--knob", "BLOCK_N=8", "--warps", "1", "--json", str(out))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert 0 < result["registers"] <= 255 and result["constants"]["BLOCK_N"] == 8
    assert f"{result['registers']} registers" in run.stdout
    # one pass of the loop over 4 stored channels: 32 tokens x 8 blocks x 4 heads x 4 channels of
    # multiply-adds over a warp's 32 lanes, 128 per lane, beside the decode and the loads
    (loop,) = result["loops"]
    assert 128 <= loop["kinds"]["FFMA"] < 2 * 128
    assert loop["instructions"] < result["instructions"] and loop["kinds"]["LDG"] > 0


@pytest.mark.parametrize("knob", ["TILE=8", "BLOCK_N=eight"])
def test_a_knob_the_kernel_does_not_have_is_refused(knob):
    run = kernel_sass("channels", "--knob", knob)
    assert run.returncode != 0 and "NAME=INTEGER" in run.stderr


def test_the_decode_kernel_is_built_as_launched_aligned_and_pipelined(tmp_path):
    """Built as a launch specializes it (16-byte aligned pointers), a 64-token tile of K and V (32 KiB)
    moves in 16-byte copies: 16 per thread of 4 warps, a few more for the slots and the tail."""
    from sparseserve_hf.ops import triton_decode

    pipelined, single = tmp_path / "pipelined.json", tmp_path / "single.json"
    runs = [
        kernel_sass("decode", "--json", str(pipelined)),
        kernel_sass("decode", "--stages", "1", "--json", str(single)),
    ]
    assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
    pipelined, single = json.loads(pipelined.read_text()), json.loads(single.read_text())
    assert pipelined["num_stages"] == triton_decode.SPLIT_STAGES and single["num_stages"] == 1
    for result, copy in ((pipelined, "LDGSTS"), (single, "LDG")):
        (loop,) = result["loops"]
        assert loop["kinds"]["HMMA"] == 32  # q.k^T and p.v of a 16-row group tile over 64 tokens, per warp
        assert 16 <= loop["kinds"][copy] <= 32, loop["kinds"]
        assert 1 <= result["programs_per_sm"] <= 16 and result["shared_bytes"] > 0
    assert "LDGSTS" not in single["loops"][0]["kinds"] and single["shared_bytes"] < pipelined["shared_bytes"]
    assert "programs per SM at most" in runs[0].stdout


def test_programs_per_sm_take_the_tightest_of_registers_shared_memory_and_threads():
    from eval.bench.kernel_sass import programs_per_sm

    assert programs_per_sm(registers=127, num_warps=4, shared_bytes=39936) == 4  # 4,096 registers a warp
    assert programs_per_sm(registers=64, num_warps=4, shared_bytes=100 * 1024) == 2  # shared memory
    assert programs_per_sm(registers=32, num_warps=1, shared_bytes=0) == 64  # threads: 2,048 / 32


def test_the_union_kernel_builds_and_reports_its_spills(tmp_path):
    out = tmp_path / "union.json"
    run = kernel_sass("union", "--json", str(out))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert 0 < result["registers"] <= 255 and result["stack_bytes"] >= 0 and result["constants"]["K"] == 63
    assert f"{result['registers']} registers ({result['stack_bytes']} bytes spilled)" in run.stdout
    assert result["kinds"]["LDG"] > 0  # the group's scores are read


def test_the_lookup_listing_kernel_is_built_as_launched(tmp_path):
    """The lookup's entry-wide listing of its misses: a small program (4 warps) that fits beside attention."""
    out = tmp_path / "append.json"
    run = kernel_sass("append", "--json", str(out))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["num_warps"] == 4 and 0 < result["registers"] <= 128 and result["programs_per_sm"] >= 4


def test_the_channel_kernel_builds_for_an_a100_decoding_8bit_values_from_their_bits(tmp_path):
    out = tmp_path / "sm80.json"
    run = kernel_sass("channels", "--arch", "80", "--knob", "NATIVE_FP8=0", "--json", str(out))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["arch"] == "sm_80" and result["constants"]["NATIVE_FP8"] == 0 and result["stack_bytes"] == 0
