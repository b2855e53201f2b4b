"""Differences between the supported transformers versions, in one place."""

from __future__ import annotations

import dataclasses
import inspect

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword `model.generate` / `model.forward` take a cache by.

    transformers 5.24 renamed `past_key_values` to `cache` (the old name still works there, with a
    deprecation warning); 5.17 knows only `past_key_values`.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# The cache field of a model's output: `cache` from transformers 5.24 on (there the old name still
# works, with a deprecation warning), `past_key_values` before.
OUTPUT_CACHE_FIELD = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
)
