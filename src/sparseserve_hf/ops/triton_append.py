"""A decode token's append to its row's tail block (`reference.append_token`) as one Triton launch.

Eager PyTorch takes four kernels (an index range, a stack, an indexed write and the length's
increment); in a decode step each is launch and latency, once per layer. Here program b reads
row b's tail length, writes the row's keys and values of every KV head at that position, and
then counts the token: the only program touching row b's length, so the read precedes the write.
With `num_blocks`, a row holding nothing (an unused slot of a batch cache) is left as it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _append_kernel(
    tail_ptr, tail_len_ptr, keys_ptr, values_ptr, num_blocks_ptr,
    heads, stride_tb, stride_th, stride_tkv, stride_ts, stride_kb, stride_kh, stride_vb, stride_vh,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SKIP_EMPTY: tl.constexpr,
):  # fmt: skip
    """Grid (B,): tail[b, :, 0, tail_len[b]] = keys[b, :, 0], [..., 1, ...] = values[b, :, 0]; tail_len[b] += 1
    (with SKIP_EMPTY, not where tail_len[b] == num_blocks[b] == 0)."""
    b = tl.program_id(0).to(tl.int64)
    length = tl.load(tail_len_ptr + b)
    taken = 1  # tokens the row takes
    if SKIP_EMPTY:
        taken = ((length > 0) | (tl.load(num_blocks_ptr + b) > 0)).to(length.dtype)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    inside = (h < heads * taken)[:, None] & (d < D)[None, :]  # no head of a row that takes nothing
    key = tl.load(keys_ptr + b * stride_kb + h[:, None] * stride_kh + d[None, :], mask=inside)
    value = tl.load(values_ptr + b * stride_vb + h[:, None] * stride_vh + d[None, :], mask=inside)
    at = tail_ptr + b * stride_tb + h[:, None] * stride_th + length * stride_ts + d[None, :]
    tl.store(at, key, mask=inside)
    tl.store(at + stride_tkv, value, mask=inside)
    tl.store(tail_len_ptr + b, length + taken)


def append_token(
    tail: torch.Tensor,
    tail_len: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    num_blocks: torch.Tensor | None = None,
) -> None:
    """`reference.append_token` in one launch: tail (B, Hkv, 2, S, D) with a unit-stride last dim,
    tail_len and num_blocks (B,) contiguous, keys/values (B, Hkv, 1, D)."""
    batch, heads, _, _, dim = tail.shape
    assert tail.stride(-1) == 1 and tail_len.is_contiguous()
    assert num_blocks is None or (num_blocks.shape == tail_len.shape and num_blocks.is_contiguous())
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    assert keys.shape == values.shape == (batch, heads, 1, dim) and keys.dtype == values.dtype == tail.dtype
    if batch == 0:
        return
    _append_kernel[(batch,)](
        tail, tail_len, keys, values, tail_len if num_blocks is None else num_blocks,
        heads, tail.stride(0), tail.stride(1), tail.stride(2), tail.stride(3),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        D=dim, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
        SKIP_EMPTY=num_blocks is not None, num_warps=2,
    )  # fmt: skip
