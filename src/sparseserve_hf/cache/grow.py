"""One way to grow a tensor: every growable table of the cache goes through it."""

from __future__ import annotations

import torch


def grown(tensor: torch.Tensor, size: int, fill: float = 0, dim: int = 0) -> torch.Tensor:
    """`tensor` extended along `dim` to `size` entries, new entries set to `fill` (same dtype/device).

    Returns `tensor` itself when it is already at least that large.
    """
    have = tensor.shape[dim]
    if size <= have:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = size - have
    return torch.cat((tensor, tensor.new_full(shape, fill)), dim=dim)
