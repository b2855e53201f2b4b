"""Llama's RMSNorm (`reference.rms_norm`) as one Triton launch: one program per row.

Eager PyTorch runs the norm as eight kernels (two casts, square, mean, add, rsqrt and two
products); at decode a row is a few KiB, so each of them is launch and latency, twice per
layer. Here a program loads its row once, keeps it in registers and writes the scaled result.
The arithmetic follows the reference op for op (float32 mean square, the normalized row rounded
to the input's dtype before the weight's product); only the order of the mean's additions differs,
so results agree to float32 rounding of the mean, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, width, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    """Program r: out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)).to(x.dtype)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / width
    normed = (x * tl.math.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=live, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=live)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.rms_norm` for (..., H) rows, H = weight's length, one launch."""
    width = hidden.shape[-1]
    rows = hidden.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, hidden.dtype), device=hidden.device)
    block = triton.next_power_of_2(width)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight, out, width, rows.stride(0), out.stride(0), eps,
        BLOCK=block, num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip
    return out.view(hidden.shape)
