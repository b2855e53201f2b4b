"""Block ops behind one seam: `get_ops(backend, device)` returns the implementation set for a backend.

The plain-PyTorch reference (`ops.reference`) is the specification and runs on CPU and CUDA.
The Triton kernels (`ops.triton_*`) implement the same signatures and are tested against it;
they are imported only when the "triton" backend is resolved, so `import sparseserve_hf`
never imports triton (CPU-first). The "flash" backend is the Triton set with `sparse_decode`
on flash-attn-4's paged kernel (`ops.flash_decode`, imported only from `get_ops("flash")`).

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

from . import channels, lru, reference

__all__ = ["BlockOps", "flash_available", "get_ops", "reference", "resolve_backend", "triton_available"]


@dataclass(frozen=True)
class BlockOps:
    """The op set one backend provides (signatures as in `ops.reference`)."""

    name: str
    block_metadata: Callable[..., torch.Tensor]
    score_table: Callable[..., torch.Tensor]
    channel_logsumexp: Callable[..., torch.Tensor]  # metadata="channels" (`ops.channels.block_logsumexp`)
    # its estimates, fed back, to masses (`ops.channels.feedback_mass`); may raise the estimates in place
    channel_mass: Callable[..., torch.Tensor]
    aggregate_group_scores: Callable[..., torch.Tensor]
    select_blocks: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    union_over_group: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    select_group_union: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    sparse_decode: Callable[..., torch.Tensor]
    # `sparse_decode` in two halves around a lookup (`reference.begin_decode`); None: not split
    begin_decode: Callable[..., object] | None
    finish_decode: Callable[..., torch.Tensor] | None
    gather_blocks: Callable[..., None]
    scatter_blocks: Callable[..., None]
    resolve_blocks: Callable[..., tuple[torch.Tensor, ...]]  # signature as `ops.lru.resolve_`
    # `resolve_blocks` in two halves around the misses' first copy (`triton_resolve.claim_`); None: not split
    claim_blocks: Callable[..., tuple[torch.Tensor, ...]] | None
    install_blocks: Callable[..., tuple[torch.Tensor, ...]] | None
    reorder_blocks: Callable[..., None] | None  # the install's eviction-order upkeep alone (`triton_resolve.reorder_`)
    picked_blocks: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # signature as `ops.lru.picked_blocks`
    account_loads: Callable[..., None]
    rms_norm: Callable[..., torch.Tensor]  # the model's own ops in a captured step (`fused_ops`)
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None  # None: the model's own function is the spec
    silu_mul: Callable[..., torch.Tensor] | None  # None: the model's own activation
    append_token: Callable[..., None]  # a decode token into its row's tail block


TORCH_OPS = BlockOps(
    name="torch",
    block_metadata=reference.block_metadata,
    score_table=reference.score_table,
    channel_logsumexp=channels.block_logsumexp,
    channel_mass=channels.feedback_mass,
    aggregate_group_scores=reference.aggregate_group_scores,
    select_blocks=reference.select_blocks,
    union_over_group=reference.union_over_group,
    select_group_union=reference.select_group_union,
    sparse_decode=reference.sparse_decode,
    begin_decode=reference.begin_decode,
    finish_decode=reference.finish_decode,
    gather_blocks=reference.gather_blocks,
    scatter_blocks=reference.scatter_blocks,
    resolve_blocks=lru.resolve_,
    claim_blocks=None,
    install_blocks=None,
    reorder_blocks=None,
    picked_blocks=lru.picked_blocks,
    account_loads=reference.account_loads,
    rms_norm=reference.rms_norm,
    add_rms_norm=reference.add_rms_norm,
    rope=None,
    silu_mul=None,
    append_token=reference.append_token,
)


def triton_available() -> bool:
    """True when triton is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def flash_available() -> bool:
    """True when flash-attn-4 (`flash_attn.cute`) is installed, checked without importing it.

    `find_spec("flash_attn.cute")` would import `flash_attn` (flash-attn 2's `__init__` loads its
    CUDA extension), so the submodule is looked for in the package's search path instead.
    """
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        return False
    locations = spec.submodule_search_locations if spec is not None else None
    return any(os.path.isfile(os.path.join(path, "cute", "__init__.py")) for path in locations or ())


FLASH_INSTALL = (
    "pip install 'sparseserve_hf[flash]' (flash-attn-4==4.0.0b36 and nvidia-cutlass-dsl==4.8.1; "
    "a Hopper or datacenter Blackwell GPU: sm_90, sm_100, sm_110)"
)
FLASH_ARCHS = (9, 10, 11)  # compute-capability majors where fa4 has paged KV (not SM80/SM120)


def _triton_interpreted() -> bool:
    # Triton's CPU interpreter runs kernels on CPU tensors; the test suite uses it without a GPU.
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, device: torch.device | None) -> str:
    """The backend that will run on `device` ("torch", "triton" or "flash"); raise for one that cannot.

    "auto" picks "triton" on CUDA when triton is installed, else "torch". "triton" needs triton
    and a CUDA device (or any device under TRITON_INTERPRET=1). "flash" needs flash-attn-4,
    triton (it keeps the Triton scoring and transfer kernels) and a Hopper or Blackwell CUDA
    device. `device=None` checks only what can be checked before the first tensor is seen.
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
        _check_flash(device)
        return "flash"
    raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'torch', 'triton' or 'flash'")


def _check_flash(device: torch.device | None) -> None:
    if not flash_available():
        raise NotImplementedError(f"backend='flash' needs flash-attn-4 (flash_attn.cute): {FLASH_INSTALL}")
    if not triton_available():
        raise NotImplementedError("backend='flash' also runs the Triton kernels: pip install 'sparseserve_hf[flash]'")
    on_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if not on_cuda:
        raise NotImplementedError(
            f"backend='flash' runs on CUDA devices, not on {device or 'CPU'}; use backend='auto' or 'torch'"
        )
    if device is not None and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        if major not in FLASH_ARCHS:
            raise NotImplementedError(
                f"backend='flash' needs a Hopper or datacenter Blackwell GPU (flash-attn-4 has no paged KV on "
                f"sm_{major}{minor}); use backend='triton'"
            )


def get_ops(backend: str, device: torch.device) -> BlockOps:
    """The op set for `backend` ("auto", "torch", "triton", "flash") on `device`."""
    resolved = resolve_backend(backend, device)
    if resolved == "torch":
        return TORCH_OPS
    if resolved == "flash":
        return _flash_ops()
    return _triton_ops()


def _triton_ops() -> BlockOps:
    from . import (  # import triton: only here
        triton_account,
        triton_activation,
        triton_append,
        triton_channels,
        triton_decode,
        triton_norm,
        triton_resolve,
        triton_rope,
        triton_score,
        triton_transfer,
        triton_two_level,
    )

    # select_blocks / union_over_group stay the reference's torch ops (the per-query-head and
    # per-KV-head selections); the group union has its own kernel.
    return replace(
        TORCH_OPS,
        name="triton",
        score_table=triton_score.score_table,
        channel_logsumexp=triton_channels.block_logsumexp,
        channel_mass=triton_channels.feedback_mass,
        select_group_union=triton_two_level.select_group_union,
        sparse_decode=triton_decode.sparse_decode,
        begin_decode=triton_decode.begin_decode,
        finish_decode=triton_decode.finish_decode,
        gather_blocks=triton_transfer.gather_blocks,
        scatter_blocks=triton_transfer.scatter_blocks,
        resolve_blocks=triton_resolve.resolve_,
        claim_blocks=triton_resolve.claim_,
        install_blocks=triton_resolve.install_,
        reorder_blocks=triton_resolve.reorder_,
        picked_blocks=triton_resolve.picked_blocks,
        account_loads=triton_account.account_loads,
        rms_norm=triton_norm.rms_norm,
        add_rms_norm=triton_norm.add_rms_norm,
        rope=triton_rope.rope,
        silu_mul=triton_activation.silu_mul,
        append_token=triton_append.append_token,
    )


def _flash_ops() -> BlockOps:
    from . import flash_decode  # imports flash_attn.cute (CuTe-DSL): only here, never at package import

    # Only decode attention changes (whole: fa4's kernel is not split around the lookup); scoring and
    # the block transfers stay the Triton kernels.
    return replace(
        _triton_ops(), name="flash", sparse_decode=flash_decode.sparse_decode, begin_decode=None, finish_decode=None
    )
