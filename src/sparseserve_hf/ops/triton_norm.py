"""Llama's RMSNorm (`reference.rms_norm`) as one Triton launch, bit for bit the model's own on a GPU.

Eager PyTorch runs the norm as eight kernels (two casts, square, mean, add, rsqrt and two
products); at decode a row is a few KiB, so each of them is launch and latency, twice per
layer. Here a program loads its row, forms the mean square and writes the scaled result.
Every rounding is the reference's: the squares, the mean's additions in the order PyTorch's CUDA
reduction makes them (`reference.cuda_row_mean`: per-lane running sums over strided 4-vectors,
then folded by halves), the scale by 1/H, rsqrt, the normalized row rounded to the input's
dtype before the weight's product; no multiply-add is fused.

`add_rms_norm` folds the residual add before a norm (`residual + hidden`, rounded to the
input's dtype as PyTorch's add rounds it) into the same launch, and writes the sum too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference


@triton.jit
def _fold_halves(total, LANES: tl.constexpr):
    """(LANES,) -> (LANES // 2,): lane t adds lane t + LANES // 2 (a shared-memory or shuffle fold)."""
    return tl.sum(tl.reshape(total, (2, LANES // 2)), axis=0)


@triton.jit
def _load_row(row_ptr, res_ptr, offsets, mask, HAS_RESIDUAL: tl.constexpr):
    """A row's values at `offsets` as float32: x, or (x + residual) rounded to x's dtype."""
    x = tl.load(row_ptr + offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(res_ptr + offsets, mask=mask, other=0.0)
        x = (residual.to(tl.float32) + x.to(tl.float32)).to(row_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _row_sum_of_squares(
    row_ptr, res_ptr, width, LANES: tl.constexpr, ROUNDS: tl.constexpr, VEC: tl.constexpr, HAS_RESIDUAL: tl.constexpr
):
    """The float32 sum of a row's squares, added in `reference.cuda_row_mean`'s order (LANES >= 32)."""
    lanes = tl.arange(0, LANES)
    element = tl.arange(0, VEC)
    running = tl.zeros([LANES, VEC], tl.float32)
    for step in tl.static_range(ROUNDS):
        offsets = (step * LANES + lanes)[:, None] * VEC + element[None, :]
        x = _load_row(row_ptr, res_ptr, offsets, offsets < width, HAS_RESIDUAL)
        running = running + x * x
    total = tl.sum(tl.where(element[None, :] == 0, running, 0.0), axis=1)  # adding zeros: exact
    for e in tl.static_range(1, VEC):
        total = total + tl.sum(tl.where(element[None, :] == e, running, 0.0), axis=1)
    if LANES >= 512:
        total = _fold_halves(total, 512)
    if LANES >= 256:
        total = _fold_halves(total, 256)
    if LANES >= 128:
        total = _fold_halves(total, 128)
    if LANES >= 64:
        total = _fold_halves(total, 64)
    total = _fold_halves(total, 32)
    total = _fold_halves(total, 16)
    total = _fold_halves(total, 8)
    total = _fold_halves(total, 4)
    total = _fold_halves(total, 2)
    return tl.sum(total, axis=0)  # one element


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, sum_ptr, weight_ptr, out_ptr, width, stride_x, stride_out, eps, inv_width,
    BLOCK: tl.constexpr, LANES: tl.constexpr, ROUNDS: tl.constexpr, VEC: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """Program r: out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)).to(x.dtype); with a residual,
    x[r] is (residual[r] + x[r]) in x's dtype, also written to sum[r] (rows of x's stride)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_x
    cols = tl.arange(0, BLOCK)
    live = cols < width
    # Every load before the first store: a store may alias a later load, so the compiler would not
    # issue that load until the store, one more wait for memory at the end of a short kernel.
    weight = tl.load(weight_ptr + cols, mask=live, other=0.0)
    mean_square = _row_sum_of_squares(row_ptr, res_row, width, LANES, ROUNDS, VEC, HAS_RESIDUAL) * inv_width
    x = _load_row(row_ptr, res_row, cols, live, HAS_RESIDUAL)
    normed = (x * tl.math.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=live)
    if HAS_RESIDUAL:
        tl.store(sum_ptr + row * stride_x + cols, x.to(sum_ptr.dtype.element_ty), mask=live)


def exact(hidden: torch.Tensor) -> bool:
    """Whether PyTorch's own norm adds this input's mean square in `reference.cuda_row_mean`'s
    order: a contiguous CUDA input of a width that order describes."""
    return hidden.is_cuda and hidden.is_contiguous() and reference.cuda_row_mean_applies(hidden.shape[-1])


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMSNorm bit for bit: the fused kernel where `exact` says PyTorch adds in the CUDA
    order, the reference's ops (the model's own) elsewhere. (..., H) -> (..., H)."""
    return fused_rms_norm(hidden, weight, eps) if exact(hidden) else reference.rms_norm(hidden, weight, eps)


def add_rms_norm(
    hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.add_rms_norm`: (the norm of residual + hidden, that sum), bit for bit the model's
    add and norm; one launch where `exact` holds for both inputs (same shape and dtype)."""
    if exact(hidden) and exact(residual) and hidden.shape == residual.shape and hidden.dtype == residual.dtype:
        return fused_add_rms_norm(hidden, residual, weight, eps)
    return reference.add_rms_norm(hidden, residual, weight, eps)


def fused_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.rms_norm(..., cuda_order=True)` in one launch, for contiguous (..., H) rows whose
    width `reference.cuda_row_mean_applies` to, H = weight's length."""
    return _launch(hidden, None, weight, eps)[0]


def fused_add_rms_norm(
    hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.add_rms_norm(..., cuda_order=True)` in one launch, for contiguous rows of one
    shape and dtype whose width `reference.cuda_row_mean_applies` to."""
    assert residual.shape == hidden.shape and residual.dtype == hidden.dtype and residual.is_contiguous()
    return _launch(hidden, residual, weight, eps)


def _launch(
    hidden: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, sum) of the rows (sum = hidden when there is no residual)."""
    width = hidden.shape[-1]
    assert hidden.is_contiguous() and reference.cuda_row_mean_applies(width)
    rows = hidden.view(-1, width)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, hidden.dtype), device=hidden.device)
    summed = torch.empty_like(rows) if residual is not None else rows
    lanes = reference.cuda_reduce_lanes(rows.shape[0], width)
    vectors = width // reference.CUDA_REDUCE_VECTOR
    block = triton.next_power_of_2(width)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, rows if residual is None else residual.view(-1, width), summed, weight, out, width, rows.stride(0),
        out.stride(0), eps, reference.cuda_mean_scale(width),
        BLOCK=block, LANES=lanes, ROUNDS=triton.cdiv(vectors, lanes), VEC=reference.CUDA_REDUCE_VECTOR,
        HAS_RESIDUAL=residual is not None, num_warps=max(1, min(16, block // 256)), enable_fp_fusion=False,
    )  # fmt: skip
    return out.view(hidden.shape), summed.view(hidden.shape)
