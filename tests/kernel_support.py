"""Constants and tolerances of the kernel tests (tests/ops), under a unique module name.

Several test folders have a `conftest` module; `from conftest import` would find whichever pytest
imported first, so shared names live here (tests/ is on sys.path).
"""

from __future__ import annotations

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The interpreter mis-handles bf16 tensors (triton's interpreter on CPU): bf16 runs on the GPU only.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if ON_GPU else [])


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances for a kernel output in `dtype` against the fp32-accumulating reference."""
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    if dtype == torch.float16:
        return dict(atol=2e-3, rtol=2e-3)
    return dict(atol=1.6e-2, rtol=1.6e-2)
