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

from kernel_support import DEVICE

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    assert not any(name.startswith("sparseserve_hf.ops.triton_") for name in sys.modules), (
        "a Triton kernel module was imported before TRITON_INTERPRET was set: its kernels would be compiled"
    )

if importlib.util.find_spec("triton") is None:
    # No triton (e.g. a venv without the dev extra): nothing here can run; skip the directory.
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def poisoned(monkeypatch):
    """Make `torch.empty` return NaN-filled floating tensors, so an element a kernel never writes fails."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-(2**30))

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    return poisoned_empty
