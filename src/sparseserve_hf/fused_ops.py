"""The model's own small ops, fused, inside a captured decode step.

Eager transformers runs a decode layer's RMSNorms as eight kernels each and its rotary embedding
as ten; in a step of a few KiB per row each of those is launch and latency. While the
`StaticDecoder` runs its static step (the one a CUDA graph captures) it swaps in the op
set's fused versions, and only then:
- the rotary embedding (`ops.rope`, `config.fused_rope`, bit for bit the model's): the defining module's
  `apply_rotary_pos_emb`, where it is Llama's function instruction for instruction, is wrapped
  while a step runs (counted, so steps on several threads share one wrapper): the wrapper takes
  the fused path on the threads running a step, for the calls it computes exactly
  (`rope_fusable`), and otherwise calls the function it wraps;
- the RMSNorms (`ops.rms_norm`, `config.fused_norms`, bit for bit the model's own: the mean
  square's additions in the order PyTorch's CUDA reduction makes them), as an instance `forward`
  of each module whose forward is Llama's RMSNorm, removed after the step;
- with the RMSNorms, the residual add before each (`ops.add_rms_norm`): in each module whose forward
  is Llama's decoder layer, as an instance `forward` running the same modules, the add after
  attention joins the post-attention norm's launch and the add after the MLP joins the next
  layer's input norm's (that norm's call, on the very tensor the layer returned, takes the result);
- the MLP activation `silu(gate) * up` (`ops.silu_mul`, `config.fused_activation`), as an instance
  `forward` of each module whose forward is Llama's MLP with a SiLU, the three projections its own;
- on CUDA, independent projections side by side (`config.projections_beside`): in each module whose
  forward is Llama's attention, the k and v projections run on a second stream while q's runs (as
  instance `forward`s of the three `nn.Linear`s: q's call starts all three, k's and v's hand over
  their result), and with the fused activation the MLP's up projection beside its gate. At a
  decode batch's few rows k's and v's GEMMs are too small to fill the GPU: beside q's they cost
  little. The same kernels on the same inputs, so the same bits; checked once like the others.
Any other norm, embedding or MLP (Gemma's `1 + weight`, a LayerNorm, partial rotary, GELU) keeps its own.
Each fused op first runs once on the model's device and dtype against the model's own op (the
rotary embedding, the norm and the activation must match bit for bit); one that fails or differs
is left out, with a warning, and the step runs the model's op.
"""

from __future__ import annotations

import functools
import inspect
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
LLAMA_ATTENTION = _code_of(inspect.unwrap(modeling_llama.LlamaAttention.forward))  # under its kwarg-renaming decorator
LLAMA_DECODER = _code_of(inspect.unwrap(modeling_llama.LlamaDecoderLayer.forward))
PROJECTIONS = ("q_proj", "k_proj", "v_proj")
MLP_UP_BESIDE = True  # with `beside`, the MLP's up projection beside its gate's too
ADD_INTO_NORMS = True  # with the fused norms, the residual adds before them too (an ablation knob)
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


def fusable_attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` whose forward is Llama's attention (`q_proj`, `k_proj`, `v_proj` called
    in that order on one input), each projection a plain `nn.Linear` running its class's forward."""
    return [
        module
        for module in model.modules()
        if "forward" not in module.__dict__
        and _code_of(inspect.unwrap(type(module).forward)) == LLAMA_ATTENTION
        and all(type(getattr(module, name, None)) is torch.nn.Linear for name in PROJECTIONS)
        and not any("forward" in getattr(module, name).__dict__ for name in PROJECTIONS)
    ]


def fusable_decoders(model: torch.nn.Module, norms: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules of `model` whose forward is Llama's decoder layer (norm, attention, add, norm,
    MLP, add), in the model's order, both norms among the fused `norms`."""
    fused = {id(norm) for norm in norms}
    return [
        module
        for module in model.modules()
        if "forward" not in module.__dict__
        and _code_of(inspect.unwrap(type(module).forward)) == LLAMA_DECODER
        and id(getattr(module, "input_layernorm", None)) in fused
        and id(getattr(module, "post_attention_layernorm", None)) in fused
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
    """The fused ops one decoder's static step uses on `model` (see the module docstring).

    Args:
        model: the causal LM.
        rms_norm: the op set's `rms_norm`, used when `norms` is True.
        rope: the op set's `rope`, or None (the torch reference set: the model's own is the spec).
        norms: fuse the RMSNorms (`config.fused_norms`).
        head_dim: D of the model's attention (the cache's model shape), for the rotary embedding's check.
        silu_mul: the op set's `silu_mul` (`config.fused_activation`), or None: the model's own.
        beside: run independent projections side by side on CUDA (`config.projections_beside`).
        add_rms_norm: the op set's `add_rms_norm`, with `norms`: the residual adds join the norms.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        rms_norm: Callable,
        rope: Callable | None,
        norms: bool,
        head_dim: int,
        silu_mul: Callable | None = None,
        beside: bool = False,
        add_rms_norm: Callable | None = None,
    ) -> None:
        self.norms = fusable_norms(model) if norms else []
        if self.norms and not _checked("rms_norm", lambda: _norm_agrees(rms_norm, self.norms[0])):
            self.norms = []
        self.rms_norm = rms_norm
        self.add_rms_norm = add_rms_norm
        self.decoders = fusable_decoders(model, self.norms) if add_rms_norm is not None and ADD_INTO_NORMS else []
        if self.decoders and not _checked("residual add", lambda: _add_norm_agrees(add_rms_norm, self.norms[0])):
            self.decoders = []
        self._handed: tuple | None = None  # (a layer's output, its next norm, that norm of it) until taken
        self._swapped: list[torch.nn.Module] = []  # the modules whose forward `enter` set
        self.homes = _llama_rope_homes(model) if rope is not None else []
        if self.homes and not _checked("rope", lambda: _rope_agrees(rope, model, head_dim)):
            self.homes = []
        self.rope = rope if self.homes else None
        self.mlps = fusable_mlps(model) if silu_mul is not None else []
        if self.mlps and not _checked("activation", lambda: _activation_agrees(silu_mul, self.mlps[0])):
            self.mlps = []
        self.silu_mul = silu_mul
        device = next(model.parameters()).device
        side = torch.cuda.Stream(device) if beside and device.type == "cuda" else None
        self.attentions = [ProjectionsBeside(module, side) for module in fusable_attentions(model)] if side else []
        if self.attentions and not _checked("projections beside", self.attentions[0].agrees):
            self.attentions = []
        self.mlp_side = side if self.mlps and MLP_UP_BESIDE else None
        if self.mlp_side is not None and not _checked("up projection beside", lambda: _mlp_beside_agrees(self)):
            self.mlp_side = None

    def __bool__(self) -> bool:
        return bool(self.norms) or self.rope is not None or bool(self.mlps) or bool(self.attentions)

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
        self._swapped = []
        for module in self.norms:
            self._swap(module, functools.partial(self._norm, module))
        ours = {id(module) for module in self._swapped}  # a layer joins its adds only to norms of ours
        for layer, following in zip(self.decoders, [*self.decoders[1:], None]):
            next_norm = following.input_layernorm if following is not None else None
            if id(layer.post_attention_layernorm) in ours:
                next_norm = next_norm if id(next_norm) in ours else None
                self._swap(layer, functools.partial(_fused_decoder_layer, self, layer, next_norm))
        for module in self.mlps:
            self._swap(module, functools.partial(_fused_mlp, module, self.silu_mul, self.mlp_side))
        for attention in self.attentions:
            attention.enter()

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
        for module in self._swapped:
            module.__dict__.pop("forward", None)
        self._swapped = []
        self._handed = None
        for attention in self.attentions:
            attention.exit()

    def _swap(self, module: torch.nn.Module, forward: Callable) -> None:
        """Set `module`'s forward for the step, unless one was set since the ops were chosen (a
        hook, a test's fault): that one stays in place."""
        if "forward" not in module.__dict__:
            module.forward = forward
            self._swapped.append(module)

    def _norm(self, norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """`norm`'s fused forward: the result the layer before computed with its residual add,
        when `hidden` is that layer's output, else the fused norm."""
        handed, self._handed = self._handed, None
        if handed is not None and handed[0] is hidden and handed[1] is norm:
            return handed[2]
        return self.rms_norm(hidden, norm.weight, norm.variance_epsilon)

    def _add_and_norm(self, hidden: torch.Tensor, residual: torch.Tensor, norm: torch.nn.Module) -> tuple:
        """(norm(residual + hidden), residual + hidden) in one op."""
        return self.add_rms_norm(hidden, residual, norm.weight, norm.variance_epsilon)


def _fused_decoder_layer(
    fused: FusedModelOps, layer: torch.nn.Module, next_norm: torch.nn.Module | None, hidden_states, *args, **kwargs
) -> torch.Tensor:
    """Llama's decoder layer with each residual add joined to the norm after it: the post-attention
    norm's here, the next layer's input norm's through `fused._handed` (None: the last layer, a
    plain add). Positional arguments beyond the hidden states: the layer's own forward."""
    if args:
        return type(layer).forward(layer, hidden_states, *args, **kwargs)
    residual = hidden_states
    hidden, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **kwargs)
    hidden, residual = fused._add_and_norm(hidden, residual, layer.post_attention_layernorm)
    hidden = layer.mlp(hidden)
    if next_norm is None:
        return residual + hidden
    normed, out = fused._add_and_norm(hidden, residual, next_norm)
    fused._handed = (out, next_norm, normed)
    return out


def _add_norm_agrees(add_rms_norm: Callable, norm: torch.nn.Module) -> bool:
    """The fused add and norm equal the model's `residual + hidden` and its norm of the sum, bit
    for bit, at every row layout of `NORM_CHECK_ROWS`, in the model's dtype on its device."""
    gen = torch.Generator().manual_seed(1)
    for rows in NORM_CHECK_ROWS:
        hidden, residual = (_decode_rows(norm.weight, rows, gen, spread=True) for _ in range(2))
        want_sum = residual + hidden
        want = type(norm).forward(norm, want_sum)
        got, got_sum = add_rms_norm(hidden, residual, norm.weight, norm.variance_epsilon)
        if got.dtype != want.dtype or not (torch.equal(got, want) and torch.equal(got_sum, want_sum)):
            return False
    return True


def _decode_rows(like: torch.Tensor, rows: int, gen: torch.Generator, spread: bool = False) -> torch.Tensor:
    """Random (rows, 1, in-width) decode input in `like`'s (a weight's) dtype and device, with rows
    `spread` decades apart when asked (so a mean's order of additions shows in its last bits)."""
    x = torch.randn(rows, 1, like.shape[-1], generator=gen)
    if spread:
        x = x * 10 ** (torch.rand(rows, 1, 1, generator=gen) * 4 - 2)
    return x.to(like.device, like.dtype)


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
    for rows in NORM_CHECK_ROWS:
        hidden = _decode_rows(norm.weight, rows, gen, spread=True)
        got, want = rms_norm(hidden, norm.weight, norm.variance_epsilon), type(norm).forward(norm, hidden)
        if got.dtype != want.dtype or not torch.equal(got, want):
            return False
    return True


def _fused_mlp(
    mlp: torch.nn.Module, silu_mul: Callable, side: torch.cuda.Stream | None, x: torch.Tensor
) -> torch.Tensor:
    """Llama's MLP forward with its activation and product as one op; with a `side` stream the up
    projection runs there beside the gate's (see `ProjectionsBeside` on the streams' memory)."""
    if side is None:
        return mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    main = torch.cuda.current_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        up = mlp.up_proj(x)
    gate = mlp.gate_proj(x)
    main.wait_stream(side)
    return mlp.down_proj(silu_mul(gate, up))


def _mlp_beside_agrees(fused: FusedModelOps) -> bool:
    """The MLP with its up projection beside the gate's equals it without, bit for bit, at a decode
    batch's shape in the model's dtype on its device."""
    mlp = fused.mlps[0]
    x = _decode_rows(mlp.gate_proj.weight, 4, torch.Generator().manual_seed(0))
    got = _fused_mlp(mlp, fused.silu_mul, fused.mlp_side, x)
    return torch.equal(got, _fused_mlp(mlp, fused.silu_mul, None, x))


class ProjectionsBeside:
    """One attention module's q, k and v projections inside a step: q's call (the first of the
    three in Llama's attention) starts k's and v's on the `side` stream, then runs q's; k's and v's
    calls on the same input wait for the side stream and hand over their results. A call out of
    that order runs the projection's own forward.

    Memory across the two streams: k's and v's outputs are allocated on the side stream and read
    on the step's; the side stream's next allocation comes after its next fork, which waits for
    every kernel the step's stream had queued, those reads included, so a freed block is never
    reused under a pending read. The input, the step's, is freed only after the join.
    """

    def __init__(self, attention: torch.nn.Module, side: torch.cuda.Stream) -> None:
        self.q_proj, self.k_proj, self.v_proj = (getattr(attention, name) for name in PROJECTIONS)
        self.side = side
        self._pending: list | None = None  # [input, k or None, v or None] between q's call and k's, v's
        self._entered = False  # whether `enter` swapped the forwards in

    def enter(self) -> None:
        """Swap the three forwards in, unless one of them has an instance forward of its own."""
        self._entered = not any("forward" in linear.__dict__ for linear in (self.q_proj, self.k_proj, self.v_proj))
        if self._entered:
            self.q_proj.forward = self.project
            self.k_proj.forward = functools.partial(self.hand_over, 1, self.k_proj)
            self.v_proj.forward = functools.partial(self.hand_over, 2, self.v_proj)

    def exit(self) -> None:
        """Put the three projections' own forwards back (those `enter` swapped)."""
        self._pending = None
        if self._entered:
            for linear in (self.q_proj, self.k_proj, self.v_proj):
                linear.__dict__.pop("forward", None)
        self._entered = False

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """q's projection of `x`; k's and v's start beside it."""
        main = torch.cuda.current_stream(x.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            k = torch.nn.Linear.forward(self.k_proj, x)
            v = torch.nn.Linear.forward(self.v_proj, x)
        self._pending = [x, k, v]
        return torch.nn.Linear.forward(self.q_proj, x)

    def hand_over(self, index: int, linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """k's (index 1) or v's (2) projection of `x`: the one started beside q's, or its own."""
        pending = self._pending
        if pending is None or pending[0] is not x or pending[index] is None:
            return torch.nn.Linear.forward(linear, x)
        torch.cuda.current_stream(x.device).wait_stream(self.side)
        result, pending[index] = pending[index], None
        if pending[1] is None and pending[2] is None:
            self._pending = None
        return result

    def agrees(self) -> bool:
        """Side by side equals one after another, bit for bit, at a decode batch's shape in the
        model's dtype on its device."""
        x = _decode_rows(self.q_proj.weight, 4, torch.Generator().manual_seed(0))
        want = [torch.nn.Linear.forward(linear, x) for linear in (self.q_proj, self.k_proj, self.v_proj)]
        self.enter()
        try:
            got = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        finally:
            self.exit()
        return all(torch.equal(a, b) for a, b in zip(got, want))


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
