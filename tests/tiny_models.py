"""Tiny random-weight models of every supported architecture (from_config, no downloads), and helpers.

Importable from any test folder (tests/ is on sys.path); a uniquely named module, because several
folders have a `conftest` of their own and `from conftest import` would find whichever came first.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

import sparseserve_hf  # noqa: F401  (registers "sparseserve")

VOCAB = 256
PAD = 0
HEAD_DIM = 16


def tiny_config(arch: str = "llama", num_heads: int = 4, num_kv_heads: int = 2, num_layers: int = 2):
    """A small config of `arch` with the given GQA shape; head_dim 16, fp32."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=num_heads * HEAD_DIM,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
        pad_token_id=PAD,
        eos_token_id=None,
        bos_token_id=None,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    if arch == "qwen3":
        return Qwen3Config(use_sliding_window=False, **common)
    if arch == "gemma3":
        types = ["sliding_attention", "full_attention"] * (num_layers // 2) + ["sliding_attention"] * (num_layers % 2)
        return Gemma3TextConfig(sliding_window=24, layer_types=types, query_pre_attn_scalar=HEAD_DIM, **common)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", attn: str = "sparseserve", seed: int = 0, **shape) -> torch.nn.Module:
    """A tiny eval-mode fp32 model; the same (arch, seed, shape) always gives the same weights."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **shape), attn_implementation=attn)
    return model.eval()


def random_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=generator)


def greedy(model, input_ids, cache=None, attention_mask=None, max_new_tokens: int = 24) -> torch.Tensor:
    """Greedy generate returning only the new tokens."""
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD)
    if cache is not None:
        kwargs["past_key_values"] = cache
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    with torch.no_grad():
        out = model.generate(input_ids, **kwargs)
    return out[:, input_ids.shape[1] :]


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors into (ids, attention_mask)."""
    longest = max(r.numel() for r in rows)
    ids = torch.full((len(rows), longest), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, longest - r.numel() :] = r
        mask[i, longest - r.numel() :] = 1
    return ids, mask
