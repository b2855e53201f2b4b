"""Llama's MLP activation `silu(gate) * up` (`reference.silu_mul`) as one Triton launch.

Eager PyTorch runs it as two kernels (the SiLU, then the product), each a pass over a decode
step's few KiB per row. Here one pass rounds exactly where PyTorch rounds: SiLU computed in
fp32 as x / (1 + exp(-x)) and rounded to the input's dtype, then the product of the two 16-bit
values formed in fp32 and rounded once, so the result is PyTorch's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 1024  # elements per program


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, numel, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Grid (cdiv(numel, BLOCK),) over contiguous inputs and output. LIBDEVICE: CUDA's own expf
    (`tl.exp` is an approximation there; Triton's CPU interpreter has only `tl.exp`, numpy's)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    exp = libdevice.exp(-gate) if LIBDEVICE else tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + exp).to(dtype).to(tl.float32)  # an IEEE division, as CUDA's `/`
    tl.store(out_ptr + offsets, (silu * up).to(dtype), mask=inside)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`reference.silu_mul` in one launch: gate and up of one shape and dtype (made contiguous)."""
    assert gate.shape == up.shape and gate.dtype == up.dtype and gate.device == up.device
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    if out.numel():
        _silu_mul_kernel[(triton.cdiv(out.numel(), BLOCK),)](
            gate, up, out, out.numel(), BLOCK=BLOCK, LIBDEVICE=gate.is_cuda
        )
    return out
