"""One way to grow a tensor: every growable table of the cache goes through it."""

from __future__ import annotations

import torch


def grown(tensor: torch.Tensor, size: int, fill: float = 0, dim: int = 0) -> torch.Tensor:
    """`tensor` extended along `dim` to `size` entries, new entries set to `fill` (same dtype/device).

    Returns `tensor` itself when it is already at least that large. The result is allocated once
    and the old entries copied in: growing peaks at old + new bytes (a `torch.cat` with a filled
    extension would peak at old + extension + new; from empty, twice the table, which for the
    metadata of a large DRAM pool is GiBs that a capped device does not have).
    """
    have = tensor.shape[dim]
    if size <= have:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = size
    out = tensor.new_full(shape, fill)
    out.narrow(dim, 0, have).copy_(tensor)
    return out


def geometric_size(count: int, step: int = 1) -> int:
    """The size that holds `count`: `step` x the first of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^k and
    1.5 x 2^k) at least `count / step`; `step` for `count` <= `step`.

    For sizes a CUDA graph is captured at (block-table widths, a batch cache's rows): the sizes seen
    grow logarithmically with the need, at the price of under 1.5x the `step`-rounded need.
    """
    units = -(-count // step)
    if units <= 1:
        return step
    half = 1 << ((units - 1).bit_length() - 1)  # the largest power of two below `units`
    return step * (half * 3 // 2 if units <= half * 3 // 2 else 2 * half)
