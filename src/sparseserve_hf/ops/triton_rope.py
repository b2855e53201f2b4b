"""Llama's rotary embedding of the query and key (`reference.rope`) as one Triton launch.

Eager PyTorch rotates q and k with five kernels each (two products, a negation, a concatenation
and a sum); at decode each is launch and latency. Here one program rotates one (row, head,
token) vector of q or of k. Every product and the sum are rounded to the tensors' dtype exactly
where PyTorch rounds them, and the compiler may not contract a product into the sum (no fused
multiply-add), so the result is PyTorch's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotated(x_ptr, cos_ptr, sin_ptr, out_ptr, HALF: tl.constexpr):
    """out = x * cos + rotate_half(x) * sin for one vector, rounded as PyTorch rounds it."""
    first = tl.arange(0, HALF)
    second = first + HALF
    dtype = out_ptr.dtype.element_ty
    x1 = tl.load(x_ptr + first).to(tl.float32)
    x2 = tl.load(x_ptr + second).to(tl.float32)
    c1, c2 = tl.load(cos_ptr + first).to(tl.float32), tl.load(cos_ptr + second).to(tl.float32)
    s1, s2 = tl.load(sin_ptr + first).to(tl.float32), tl.load(sin_ptr + second).to(tl.float32)
    low = (x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)
    high = (x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)
    tl.store(out_ptr + first, low.to(dtype))
    tl.store(out_ptr + second, high.to(dtype))


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    q_heads, k_heads, tokens, q_vectors,
    qs_b, qs_h, qs_t, ks_b, ks_h, ks_t, qos_b, qos_h, qos_t, kos_b, kos_h, kos_t,
    cs_b, cs_t, ss_b, ss_t,
    HALF: tl.constexpr,
):  # fmt: skip
    """Program v < q_vectors rotates q's vector v (over (B, Hq, T) in order), the rest k's."""
    v = tl.program_id(0).to(tl.int64)
    if v < q_vectors:
        t = v % tokens
        h = (v // tokens) % q_heads
        b = v // (tokens * q_heads)
        x_ptr = q_ptr + b * qs_b + h * qs_h + t * qs_t
        out_ptr = q_out_ptr + b * qos_b + h * qos_h + t * qos_t
    else:
        w = v - q_vectors
        t = w % tokens
        h = (w // tokens) % k_heads
        b = w // (tokens * k_heads)
        x_ptr = k_ptr + b * ks_b + h * ks_h + t * ks_t
        out_ptr = k_out_ptr + b * kos_b + h * kos_h + t * kos_t
    _rotated(x_ptr, cos_ptr + b * cs_b + t * cs_t, sin_ptr + b * ss_b + t * ss_t, out_ptr, HALF)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rope` for a call `fused_ops.rope_fusable` accepts, one launch. q (B, Hq, T, D), k (B, Hk, T, D),
    cos and sin (B, T, D) (or (1, T, D), broadcast over B) -> rotated q and k, laid out as q and k."""
    batch, q_heads, tokens, width = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    q_vectors = batch * q_heads * tokens
    _rope_kernel[(q_vectors + batch * k.shape[1] * tokens,)](
        q, k, cos, sin, q_out, k_out, q_heads, k.shape[1], tokens, q_vectors,
        *_strides(q, 3), *_strides(k, 3), *_strides(q_out, 3), *_strides(k_out, 3), *_strides(cos, 2), *_strides(sin, 2),
        HALF=width // 2, num_warps=1, enable_fp_fusion=False,
    )  # fmt: skip
    return q_out, k_out


def _strides(t: torch.Tensor, dims: int) -> list[int]:
    """The first `dims` strides, 0 along a dimension of size 1 (broadcast: every index reads entry 0)."""
    return [0 if t.shape[i] == 1 else t.stride(i) for i in range(dims)]
