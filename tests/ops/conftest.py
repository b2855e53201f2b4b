"""Kernel tests: Triton kernels against `ops.reference`.

Without CUDA the kernels run under Triton's CPU interpreter. TRITON_INTERPRET is read when a
kernel is decorated (when `sparseserve_hf.ops.triton_*` is first imported), not when triton
itself is imported, so setting it here works even though transformers already imported triton
(transformers -> torch._dynamo -> triton). Nothing imports the kernel modules before this file:
the package imports them lazily, from `get_ops("triton", ...)` only.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    assert not any(name.startswith("sparseserve_hf.ops.triton_") for name in sys.modules), (
        "a Triton kernel module was imported before TRITON_INTERPRET was set: its kernels would be compiled"
    )

if importlib.util.find_spec("triton") is None:
    # No triton (e.g. a venv without the dev extra): nothing here can run; skip the directory.
    collect_ignore_glob = ["test_*.py"]

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The interpreter mis-handles bf16 tensors (DESIGN.md section 3): bf16 runs on the GPU only.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if ON_GPU else [])


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for a kernel output in `dtype` against the fp32-accumulating reference."""
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    if dtype == torch.float16:
        return dict(atol=2e-3, rtol=2e-3)
    return dict(atol=1.6e-2, rtol=1.6e-2)


@pytest.fixture
def poisoned(monkeypatch):
    """Make `torch.empty` return NaN-filled floating tensors, so an element a kernel never writes fails."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-(2**30))

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    return poisoned_empty
