"""Backend resolution, and the CPU-first rule: only `get_ops("triton"/"flash")` imports the kernel modules."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest
import torch

from kernel_support import DEVICE, ON_GPU
from sparseserve_hf import SparseServeCache, SparseServeConfig, ops
from sparseserve_hf.ops import TORCH_OPS, flash_available, get_ops, resolve_backend

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


def test_flash_without_fa4_says_how_to_install(monkeypatch):
    monkeypatch.setattr(ops, "flash_available", lambda: False)
    with pytest.raises(NotImplementedError, match=r"pip install 'sparseserve_hf\[flash\]'.*flash-attn-4==4.0.0b36"):
        resolve_backend("flash", CUDA)
    with pytest.raises(ValueError, match="unknown backend"):
        resolve_backend("cuda", CUDA)


def test_flash_runs_on_cuda_only(monkeypatch):
    monkeypatch.setattr(ops, "flash_available", lambda: True)
    with pytest.raises(NotImplementedError, match="runs on CUDA devices"):
        resolve_backend("flash", CPU)


def test_flash_resolves_when_fa4_is_installed_but_auto_stays_triton(monkeypatch):
    monkeypatch.setattr(ops, "flash_available", lambda: True)
    if ON_GPU and torch.cuda.get_device_capability()[0] not in ops.FLASH_ARCHS:
        with pytest.raises(NotImplementedError, match="Hopper or datacenter Blackwell"):
            resolve_backend("flash", CUDA)
        return
    assert resolve_backend("flash", CUDA) == "flash"
    assert resolve_backend("auto", CUDA) == "triton"  # until fa4 is measured faster on the GPU


def test_flash_ops_are_the_triton_ops_with_fa4_decode(monkeypatch):
    monkeypatch.setattr(ops, "flash_available", lambda: True)
    monkeypatch.setattr(ops, "_check_flash", lambda device: None)  # any machine: no GPU check
    fake = types.ModuleType("sparseserve_hf.ops.flash_decode")
    fake.sparse_decode = lambda *args, **kwargs: None
    monkeypatch.setitem(sys.modules, "sparseserve_hf.ops.flash_decode", fake)  # no flash_attn import
    monkeypatch.setattr(ops, "flash_decode", fake, raising=False)
    flash, triton = get_ops("flash", DEVICE), get_ops("triton", DEVICE)
    assert flash.name == "flash" and flash.sparse_decode is fake.sparse_decode
    assert flash.score_table is triton.score_table and flash.gather_blocks is triton.gather_blocks
    assert flash.select_blocks is TORCH_OPS.select_blocks


@pytest.mark.skipif(flash_available(), reason="flash-attn-4 is installed: the stand-in packages would be shadowed")
def test_flash_available_finds_the_cute_submodule_without_importing_it(tmp_path, monkeypatch):
    package = tmp_path / "flash_attn"
    package.mkdir()  # a namespace package, as flash-attn-4's wheel ships it
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert not flash_available()  # flash_attn without cute (another flash-attn)
    (package / "cute").mkdir()
    (package / "cute" / "__init__.py").write_text("raise ImportError('flash_available must not import me')\n")
    importlib.invalidate_caches()
    assert flash_available() and "flash_attn.cute" not in sys.modules


def test_triton_ops_keep_the_reference_for_selection():
    ops = get_ops("triton", DEVICE)
    assert ops.select_blocks is TORCH_OPS.select_blocks and ops.union_over_group is TORCH_OPS.union_over_group
    assert ops.sparse_decode is not TORCH_OPS.sparse_decode and ops.gather_blocks is not TORCH_OPS.gather_blocks


def run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_package_import_loads_no_kernel_module():
    out = run_python(
        "import sys, sparseserve_hf; print(sorted(m for m in sys.modules if m.startswith("
        "('sparseserve_hf.ops.triton', 'sparseserve_hf.ops.flash_decode', 'flash_attn', 'cutlass'))))"
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


def test_cache_validates_the_backend_at_construction(monkeypatch):
    from transformers import LlamaConfig

    monkeypatch.setattr(ops, "flash_available", lambda: False)
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1)
    with pytest.raises(NotImplementedError, match="flash-attn-4"):
        SparseServeCache(config, SparseServeConfig(backend="flash"))
