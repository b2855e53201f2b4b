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
