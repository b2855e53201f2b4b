"""Backend resolution, and the CPU-first rule: only `get_ops("triton")` imports the kernel modules."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kernel_support import DEVICE, ON_GPU
from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.ops import TORCH_OPS, get_ops, resolve_backend

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_auto_is_triton_on_cuda_and_torch_on_cpu():
    assert resolve_backend("auto", CUDA) == "triton"  # triton is installed in the test venv
    assert resolve_backend("auto", CPU) == "torch"
    assert resolve_backend("auto", None) == "torch"
    assert get_ops("auto", CPU) is TORCH_OPS


@pytest.mark.skipif(ON_GPU, reason="on the GPU the kernels are compiled: no interpreter to resolve to")
def test_triton_on_cpu_runs_interpreted():
    assert resolve_backend("triton", CPU) == "triton"  # tests/ops/conftest.py set TRITON_INTERPRET=1
    assert get_ops("triton", CPU).name == "triton"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(NotImplementedError, match="runs on CUDA devices"):
        resolve_backend("triton", CPU)


def test_flash_is_not_built_yet():
    with pytest.raises(NotImplementedError, match="flash"):
        resolve_backend("flash", CUDA)
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("cuda", CUDA)


def test_triton_ops_keep_the_reference_for_selection():
    ops = get_ops("triton", DEVICE)
    assert ops.select_blocks is TORCH_OPS.select_blocks and ops.union_over_group is TORCH_OPS.union_over_group
    assert ops.sparse_decode is not TORCH_OPS.sparse_decode and ops.gather_blocks is not TORCH_OPS.gather_blocks


def run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_package_import_loads_no_kernel_module():
    out = run_python(
        "import sys, sparseserve_hf; print(sorted(m for m in sys.modules if m.startswith('sparseserve_hf.ops.triton')))"
    )
    assert out == "[]"


def test_everything_but_triton_works_without_triton_installed():
    out = run_python(
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail, as if not installed
        "import torch, sparseserve_hf\n"
        "from sparseserve_hf.ops import get_ops, resolve_backend\n"
        "print(get_ops('auto', torch.device('cuda')).name)\n"
        "try:\n    resolve_backend('triton', torch.device('cuda'))\n"
        "except NotImplementedError as e:\n    print('refused:', e)\n"
    )
    assert out.splitlines()[0] == "torch" and "needs triton" in out


def test_cache_validates_the_backend_at_construction():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    with pytest.raises(NotImplementedError, match="flash"):
        SparseServeCache(config, SparseServeConfig(backend="flash"))
