"""Block ops behind one seam: `get_ops(backend)` returns the implementation set for a backend.

Only the plain-PyTorch reference exists so far; it runs on CPU and CUDA. The GPU kernels
(Triton, flash-attn) plug in here with the same signatures and are tested against it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import reference

__all__ = ["BlockOps", "get_ops", "reference", "resolve_backend"]


@dataclass(frozen=True)
class BlockOps:
    """The op set one backend provides (signatures as in `ops.reference`)."""

    name: str
    block_metadata: Callable[..., torch.Tensor]
    score_blocks: Callable[..., torch.Tensor]
    aggregate_group_scores: Callable[..., torch.Tensor]
    select_blocks: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    union_over_group: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    sparse_decode: Callable[..., torch.Tensor]


TORCH_OPS = BlockOps(
    name="torch",
    block_metadata=reference.block_metadata,
    score_blocks=reference.score_blocks,
    aggregate_group_scores=reference.aggregate_group_scores,
    select_blocks=reference.select_blocks,
    union_over_group=reference.union_over_group,
    sparse_decode=reference.sparse_decode,
)


def resolve_backend(backend: str, device: torch.device | None) -> str:
    """Map "auto" to the fastest backend built for `device`; reject backends not built yet."""
    if backend in ("auto", "torch"):
        return "torch"
    raise NotImplementedError(
        f"backend={backend!r} is not available yet: the GPU kernels are a separate issue; "
        "use backend='auto' or 'torch' (the PyTorch path runs on CPU and CUDA)"
    )


def get_ops(backend: str, device: torch.device) -> BlockOps:
    """The op set for `backend` ("auto", "torch", "triton", "flash") on `device`."""
    resolve_backend(backend, device)
    return TORCH_OPS
