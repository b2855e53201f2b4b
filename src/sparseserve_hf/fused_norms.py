"""The model's RMSNorms as one fused launch each inside a captured decode step (`config.fused_norms`).

A module qualifies when its class's `forward` is Llama's RMSNorm forward instruction for
instruction (Llama, Mistral, Qwen2, Qwen3 and the other families that copy it); any other norm
(Gemma's `1 + weight`, a LayerNorm) keeps its own forward. The swap is an instance attribute set
only while the step's forward runs, so the model is the user's own again outside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm


def _code_of(forward: Callable) -> tuple:
    code = forward.__code__
    return code.co_code, code.co_consts, code.co_names, code.co_varnames


LLAMA_RMS_NORM = _code_of(LlamaRMSNorm.forward)


def fusable_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` whose forward is Llama's RMSNorm (`weight`, `variance_epsilon`)."""
    return [
        module
        for module in model.modules()
        if _code_of(getattr(type(module).forward, "__func__", type(module).forward)) == LLAMA_RMS_NORM
    ]


def fuse(norms: list[torch.nn.Module], rms_norm: Callable[..., torch.Tensor]) -> None:
    """Make each module's forward `rms_norm(hidden, weight, eps)` (an instance attribute)."""
    for module in norms:
        module.forward = functools.partial(rms_norm, weight=module.weight, eps=module.variance_epsilon)


def unfuse(norms: list[torch.nn.Module]) -> None:
    """Give each module its class's forward back."""
    for module in norms:
        module.__dict__.pop("forward", None)
