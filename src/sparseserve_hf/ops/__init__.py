"""Block ops behind one seam: `get_ops(backend, device)` returns the implementation set for a backend.

The plain-PyTorch reference (`ops.reference`) is the specification and runs on CPU and CUDA.
The Triton kernels (`ops.triton_*`) implement the same signatures and are tested against it;
they are imported only when the "triton" backend is resolved, so `import sparseserve_hf`
never imports triton (CPU-first).

Dimension letters used in shape comments across the package: B requests (batch rows),
Hq query heads, Hkv KV heads, G = Hq // Hkv, T tokens, N blocks of a row's table, K selected
blocks, U blocks a KV head loaded, S block_size tokens, D head_dim, M metadata vectors per
block, C DRAM pool blocks, P HBM pool slots.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from . import reference

__all__ = ["BlockOps", "get_ops", "reference", "resolve_backend", "triton_available"]


@dataclass(frozen=True)
class BlockOps:
    """The op set one backend provides (signatures as in `ops.reference`)."""

    name: str
    block_metadata: Callable[..., torch.Tensor]
    score_blocks: Callable[..., torch.Tensor]
    score_table: Callable[..., torch.Tensor]
    aggregate_group_scores: Callable[..., torch.Tensor]
    select_blocks: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    union_over_group: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    sparse_decode: Callable[..., torch.Tensor]
    gather_blocks: Callable[..., None]
    scatter_blocks: Callable[..., None]


TORCH_OPS = BlockOps(
    name="torch",
    block_metadata=reference.block_metadata,
    score_blocks=reference.score_blocks,
    score_table=reference.score_table,
    aggregate_group_scores=reference.aggregate_group_scores,
    select_blocks=reference.select_blocks,
    union_over_group=reference.union_over_group,
    sparse_decode=reference.sparse_decode,
    gather_blocks=reference.gather_blocks,
    scatter_blocks=reference.scatter_blocks,
)


def triton_available() -> bool:
    """True when triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _triton_interpreted() -> bool:
    # Triton's CPU interpreter runs kernels on CPU tensors; the test suite uses it without a GPU.
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, device: torch.device | None) -> str:
    """The backend that will run on `device` ("torch" or "triton"); raise for one that cannot.

    "auto" picks "triton" on CUDA when triton is installed, else "torch". "triton" needs triton
    and a CUDA device (or any device under TRITON_INTERPRET=1). `device=None` checks only what
    can be checked before the first tensor is seen.
    """
    if backend == "torch":
        return "torch"
    if backend == "auto":
        cuda = device is not None and torch.device(device).type == "cuda"
        return "triton" if cuda and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise NotImplementedError("backend='triton' needs triton: pip install 'sparseserve_hf[gpu]'")
        on_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
        if not (on_cuda or _triton_interpreted()):
            raise NotImplementedError(
                f"backend='triton' runs on CUDA devices (or under TRITON_INTERPRET=1), not on {device or 'CPU'}; "
                "use backend='auto' or 'torch'"
            )
        return "triton"
    if backend == "flash":
        raise NotImplementedError("backend='flash' (flash-attn-4) is not built yet; use 'auto', 'torch' or 'triton'")
    raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'torch', 'triton' or 'flash'")


def get_ops(backend: str, device: torch.device) -> BlockOps:
    """The op set for `backend` ("auto", "torch", "triton", "flash") on `device`."""
    if resolve_backend(backend, device) == "torch":
        return TORCH_OPS
    return _triton_ops()


def _triton_ops() -> BlockOps:
    from . import triton_decode, triton_score, triton_transfer  # import triton: only here, never at package import

    # select_blocks / union_over_group stay the reference's torch ops: topk and sort on the
    # device, no host sync, nothing a kernel would speed up at these sizes.
    return replace(
        TORCH_OPS,
        name="triton",
        score_blocks=triton_score.score_blocks,
        score_table=triton_score.score_table,
        sparse_decode=triton_decode.sparse_decode,
        gather_blocks=triton_transfer.gather_blocks,
        scatter_blocks=triton_transfer.scatter_blocks,
    )
