"""The model's own small ops, fused, inside a captured decode step.

Eager transformers runs a decode layer's RMSNorms as eight kernels each and its rotary embedding
as ten; in a step of a few KiB per row each of those is launch and latency. While the
`DecodeGraphRunner` runs its static step (the one a CUDA graph captures) it swaps in the op
set's fused versions, and only then:
- the rotary embedding (`ops.rope`, `config.fused_rope`, bit for bit the model's): the defining module's
  `apply_rotary_pos_emb`, where it is Llama's function instruction for instruction, is wrapped
  while a step runs (counted, so steps on several threads share one wrapper): the wrapper takes
  the fused path on the threads running a step, for the calls it computes exactly
  (`rope_fusable`), and otherwise calls the function it wraps;
- the RMSNorms (`ops.rms_norm`, `config.fused_norms`, bit for bit the model's own: the mean
  square's additions in the order PyTorch's CUDA reduction makes them), as an instance `forward`
  of each module whose forward is Llama's RMSNorm, removed after the step;
- the MLP activation `silu(gate) * up` (`ops.silu_mul`, `config.fused_activation`), as an instance
  `forward` of each module whose forward is Llama's MLP with a SiLU, the three projections its own.
Any other norm, embedding or MLP (Gemma's `1 + weight`, a LayerNorm, partial rotary, GELU) keeps its own.
Each fused op first runs once on the model's device and dtype against the model's own op (the
rotary embedding, the norm and the activation must match bit for bit); one that fails or differs
is left out, with a warning, and the step runs the model's op.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from collections.abc import Callable

import torch
from transformers import activations
from transformers.models.llama import modeling_llama

logger = logging.getLogger(__name__)
_active = threading.local()  # .rope: the fused rotary embedding this thread's step runs, or absent
_lock = threading.Lock()
_wrapped: dict[object, list] = {}  # module -> [its own apply_rotary_pos_emb, steps inside] while wrapped


def _code_of(function: Callable) -> tuple | None:
    """What identifies a function's instructions (None for a callable without Python code)."""
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    return None if code is None else (code.co_code, code.co_consts, code.co_names, code.co_varnames)


LLAMA_RMS_NORM = _code_of(modeling_llama.LlamaRMSNorm.forward)
LLAMA_ROPE = _code_of(modeling_llama.apply_rotary_pos_emb)
LLAMA_MLP = _code_of(modeling_llama.LlamaMLP.forward)
SILU = {_code_of(torch.nn.SiLU.forward), _code_of(getattr(activations, "SiLUActivation", torch.nn.SiLU).forward)}


def fusable_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` whose forward is Llama's RMSNorm (`weight`, `variance_epsilon`)."""
    return [module for module in model.modules() if _runs_class_forward(module, LLAMA_RMS_NORM)]


def fusable_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` whose forward is Llama's MLP (`down(act(gate(x)) * up(x))`) with a SiLU."""
    return [
        module
        for module in model.modules()
        if _runs_class_forward(module, LLAMA_MLP) and _code_of(type(getattr(module, "act_fn", None)).forward) in SILU
    ]


def _runs_class_forward(module: torch.nn.Module, code: tuple | None) -> bool:
    """Whether `module` runs its class's `forward` and that is `code`. A module whose `forward` was
    replaced on the instance (a hook such as accelerate's wraps it so) keeps its own: the step's
    swap, and its removal afterwards, would drop the hook."""
    return "forward" not in module.__dict__ and _code_of(type(module).forward) == code


def rope_fusable(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int) -> bool:
    """Whether the fused rotary embedding computes this call: (B, H, T, D) q and k, (B, T, D) cos and
    sin, one dtype and device, unit stride along D, D a power of two."""
    if not (q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3 and unsqueeze_dim == 1):
        return False
    width = q.shape[-1]
    return (
        len({q.dtype, k.dtype, cos.dtype, sin.dtype}) == 1
        and len({q.device, k.device, cos.device, sin.device}) == 1
        and width >= 2
        and width & (width - 1) == 0
        and k.shape[-1] == cos.shape[-1] == sin.shape[-1] == width
        and all(t.stride(-1) == 1 for t in (q, k, cos, sin))
    )


class FusedModelOps:
    """The fused ops one runner's static step uses on `model` (see the module docstring).

    Args:
        model: the causal LM.
        rms_norm: the op set's `rms_norm`, used when `norms` is True.
        rope: the op set's `rope`, or None (the torch reference set: the model's own is the spec).
        norms: fuse the RMSNorms (`config.fused_norms`).
        head_dim: D of the model's attention (the cache's model shape), for the rotary embedding's check.
        silu_mul: the op set's `silu_mul` (`config.fused_activation`), or None: the model's own.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        rms_norm: Callable,
        rope: Callable | None,
        norms: bool,
        head_dim: int,
        silu_mul: Callable | None = None,
    ) -> None:
        self.norms = fusable_norms(model) if norms else []
        if self.norms and not _checked("rms_norm", lambda: _norm_agrees(rms_norm, self.norms[0])):
            self.norms = []
        self.rms_norm = rms_norm
        self.homes = _llama_rope_homes(model) if rope is not None else []
        if self.homes and not _checked("rope", lambda: _rope_agrees(rope, model, head_dim)):
            self.homes = []
        self.rope = rope if self.homes else None
        self.mlps = fusable_mlps(model) if silu_mul is not None else []
        if self.mlps and not _checked("activation", lambda: _activation_agrees(silu_mul, self.mlps[0])):
            self.mlps = []
        self.silu_mul = silu_mul

    def __bool__(self) -> bool:
        return bool(self.norms) or self.rope is not None or bool(self.mlps)

    def enter(self) -> None:
        """Before the step's forward: this thread's calls take the fused ops."""
        if self.rope is not None:
            _active.rope = self.rope
            with _lock:
                for home in self.homes:
                    entry = _wrapped.setdefault(home, [home.apply_rotary_pos_emb, 0])
                    if entry[1] == 0:
                        home.apply_rotary_pos_emb = _fused_when_active(entry[0])
                    entry[1] += 1
        for module in self.norms:
            module.forward = functools.partial(self.rms_norm, weight=module.weight, eps=module.variance_epsilon)
        for module in self.mlps:
            module.forward = functools.partial(_fused_mlp, module, self.silu_mul)

    def exit(self) -> None:
        """After it: the model's own ops again (the module's own function once no step is inside)."""
        if self.rope is not None:
            _active.rope = None
            with _lock:
                for home in self.homes:
                    entry = _wrapped[home]
                    entry[1] -= 1
                    if entry[1] == 0:
                        home.apply_rotary_pos_emb = entry[0]
                        del _wrapped[home]
        for module in (*self.norms, *self.mlps):
            module.__dict__.pop("forward", None)


def _checked(name: str, agrees: Callable[[], bool]) -> bool:
    """Whether the fused op `name` runs and agrees with the model's own (a warning when not)."""
    try:
        if agrees():
            return True
        reason = "its result differs from the model's own"
    except Exception as exc:  # noqa: BLE001  a kernel that cannot run here: the model's op instead
        reason = f"{type(exc).__name__}: {exc}"
    logger.warning("the fused %s is not used (%s); decode steps run the model's own", name, reason)
    return False


def _rope_agrees(rope: Callable, model: torch.nn.Module, head_dim: int) -> bool:
    """The fused rotary embedding equals Llama's bit for bit on a small decode-shaped input in the
    model's dtype, on its device, at its head size."""
    weight = next(model.parameters())
    dtype, device = weight.dtype, weight.device
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 1, 4, head_dim, generator=gen).to(device, dtype).transpose(1, 2)  # as the module makes it
    k = torch.randn(3, 1, 2, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
    angles = torch.rand(3, 1, head_dim // 2, generator=gen).repeat(1, 1, 2) * 50
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    return all(torch.equal(a, b) for a, b in zip(rope(q, k, cos, sin), want))


# Every lane layout PyTorch's CUDA mean gives a row (see `reference.cuda_reduce_lanes`).
NORM_CHECK_ROWS = (1, 2, 3, 4, 8, 16)


def _norm_agrees(rms_norm: Callable, norm: torch.nn.Module) -> bool:
    """The fused RMSNorm equals the module's own bit for bit on decode-shaped inputs in the model's
    dtype, on its device, for every row count that lays the mean's additions out differently."""
    gen = torch.Generator().manual_seed(0)
    width = norm.weight.shape[0]
    for rows in NORM_CHECK_ROWS:
        scale = 10 ** (torch.rand(rows, 1, 1, generator=gen) * 4 - 2)  # rows decades apart
        hidden = (torch.randn(rows, 1, width, generator=gen) * scale).to(norm.weight.device, norm.weight.dtype)
        got, want = rms_norm(hidden, norm.weight, norm.variance_epsilon), type(norm).forward(norm, hidden)
        if got.dtype != want.dtype or not torch.equal(got, want):
            return False
    return True


def _fused_mlp(mlp: torch.nn.Module, silu_mul: Callable, x: torch.Tensor) -> torch.Tensor:
    """Llama's MLP forward with its activation and product as one op."""
    return mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))


def _activation_agrees(silu_mul: Callable, mlp: torch.nn.Module) -> bool:
    """The fused `silu(gate) * up` equals the MLP's own activation and product bit for bit, in the
    model's dtype on its device, over values spanning the SiLU's range."""
    weight = mlp.gate_proj.weight
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(4, 1, 1024, generator=gen) * 8).to(weight.device, weight.dtype)
    up = torch.randn(4, 1, 1024, generator=gen).to(weight.device, weight.dtype)
    got, want = silu_mul(gate, up), mlp.act_fn(gate) * up
    return got.dtype == want.dtype and torch.equal(got, want)


def _llama_rope_homes(model: torch.nn.Module) -> list:
    """The modules defining `model`'s attention classes, when every one's `apply_rotary_pos_emb` is
    Llama's (else none: a step fuses all of its rotary embeddings or none)."""
    homes = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith("Attention")}
    own = [_wrapped[home][0] if home in _wrapped else getattr(home, "apply_rotary_pos_emb", None) for home in homes]
    return list(homes) if homes and all(_code_of(f) == LLAMA_ROPE for f in own) else []


def _fused_when_active(own: Callable) -> Callable:
    """`own` (Llama's `apply_rotary_pos_emb`), taking the fused path inside a step that asked for it."""

    @functools.wraps(own)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        fused = getattr(_active, "rope", None)
        if fused is not None and rope_fusable(q, k, cos, sin, unsqueeze_dim):
            return fused(q, k, cos, sin)
        return own(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb
