"""DecoderStack: a stock HF causal LM taken apart into the pieces that prefill drives one at a time.

`model(ids)` runs embeddings -> every decoder layer -> final norm -> lm_head in one call, with one
mask per layer type sized from the cache. Layer-segmented and chunked prefill need to stop after
any layer (or any chunk of one layer) and resume later, so this adapter exposes the same steps
separately and rebuilds, for every layer it runs, what the model's forward would have given that
layer: its mask (causal or sliding, padding, sized by that layer's own cache fill level), its
rotary embedding (per layer type on Gemma-3) and the cache under the right keyword. One exception:
an unpadded full-attention layer of a SparseServeCache gets no mask, since its attention applies
causality itself and HF's mask for a chunk over its past is a (T, past + T) tensor.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from ..cache.cache import attention_layer_types
from ..cache.forward_log import PositionLimit
from ..cache.layer import SparseServeLayer
from ..compat import cache_kwarg

FULL = "full_attention"
SLIDING = "sliding_attention"
_MASK_FUNCTIONS = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}


class DecoderStack:
    """Adapter over a stock HF CausalLM (Llama, Mistral, Qwen2, Qwen3, Gemma-3 text).

    Holds the embeddings, decoder layers, final norm, rotary embedding and lm_head, and knows
    each layer's attention type ("full_attention" or "sliding_attention"). Runs under the
    caller's grad mode (wrap calls in `torch.no_grad()` for inference).

    Args:
        model: a `*ForCausalLM` (or a model whose `get_decoder()` has `embed_tokens`, `layers`,
            `norm` and `rotary_emb`, e.g. Gemma-3's multimodal wrapper).

    Example:
        >>> stack = DecoderStack(model)
        >>> hidden = stack.embed(ids)                                   # (1, T, H)
        >>> hidden = stack.run_layers(hidden, 0, stack.num_layers, cache=cache)
        >>> next_token = stack.logits(hidden[:, -1:])[:, -1].argmax(-1)
    """

    def __init__(self, model: torch.nn.Module) -> None:
        decoder = _find_decoder(model)
        self.model = model
        self.config = decoder.config  # the text config: masks read its attention implementation
        self.positions = PositionLimit.of(self.config)
        if getattr(self.config, "use_bidirectional_attention", False):
            raise NotImplementedError("DecoderStack drives causal decoders; use_bidirectional_attention is set")
        self.embed_tokens = decoder.embed_tokens  # Gemma's scaled embedding scales inside its forward
        self.layers = decoder.layers
        self.norm = decoder.norm
        self.rotary_emb = decoder.rotary_emb
        self.lm_head = model.get_output_embeddings()
        if self.lm_head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head); pass a *ForCausalLM")
        self.num_layers: int = len(self.layers)
        self.layer_types: list[str] = _layer_types(self.config, self.num_layers)
        self.softcap: float | None = getattr(self.config, "final_logit_softcapping", None)
        self._cache_kw = cache_kwarg(self.layers[0])  # "cache" on 5.24+, "past_key_values" on 5.17
        self._rotary_by_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters

    @property
    def device(self) -> torch.device:
        """Where the decoder runs (that of its embedding weights)."""
        return self.embed_tokens.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: (B, T) ids -> (B, T, H) hidden states (Gemma's sqrt(H) scale included)."""
        return self.embed_tokens(input_ids.to(self.device))

    def run_layers(
        self,
        hidden: torch.Tensor,
        start: int,
        stop: int,
        *,
        cache: Cache | None,
        position_ids: torch.Tensor | None = None,
        attention_mask_2d: torch.Tensor | None = None,
        cache_position: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run decoder layers [start, stop) over `hidden` (B, T, H); returns their output (B, T, H).

        Args:
            hidden: input of layer `start` for T new tokens.
            start, stop: the layer range, 0 <= start <= stop <= num_layers.
            cache: any HF `Cache` (each layer writes its new K/V there and attends over the past it
                holds for that layer), or None for a cache-free pass over `hidden` alone.
            position_ids: (B|1, T) positions of the new tokens. Default: `cache_position` if
                given, else the positions right after what the cache holds for layer `start`.
            attention_mask_2d: (B, past + T) padding mask (1 = real token), None = no padding.
            cache_position: (T,) positions; only used to derive `position_ids` (the supported
                transformers versions take positions from `position_ids`).
        """
        if not 0 <= start <= stop <= self.num_layers:
            raise ValueError(f"layer range [{start}, {stop}) is not within the model's {self.num_layers} layers")
        position_ids = self._positions(hidden, start, cache, position_ids, cache_position)
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        masks: dict[tuple, Any] = {}
        for i in range(start, stop):
            kind = self.layer_types[i]
            if kind not in rope:
                rope[kind] = self._rotary(hidden, position_ids, kind)
            mask = self._mask(masks, i, hidden, cache, position_ids, attention_mask_2d)
            out = self.layers[i](
                hidden,
                attention_mask=mask,
                position_embeddings=rope[kind],
                position_ids=position_ids,
                use_cache=cache is not None,
                **{self._cache_kw: cache},
            )
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head (+ Gemma's final logit soft-capping): (B, T, H) -> (B, T, V)."""
        logits = self.lm_head(self.norm(hidden_last))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # ---- per-layer inputs ------------------------------------------------------------------

    def _positions(
        self,
        hidden: torch.Tensor,
        start: int,
        cache: Cache | None,
        position_ids: torch.Tensor | None,
        cache_position: torch.Tensor | None,
    ) -> torch.Tensor:
        if position_ids is not None:
            return position_ids.to(hidden.device)
        if cache_position is not None:
            return cache_position.to(hidden.device)[None]
        past = _seq_length(cache, start)
        return torch.arange(past, past + hidden.shape[1], device=hidden.device)[None]  # (1, T)

    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        # Gemma-3 rotates sliding (local) and full (global) layers with different bases.
        if self._rotary_by_type:
            return self.rotary_emb(hidden, position_ids, kind)
        return self.rotary_emb(hidden, position_ids)

    def _mask(
        self,
        memo: dict[tuple, Any],
        layer_idx: int,
        hidden: torch.Tensor,
        cache: Cache | None,
        position_ids: torch.Tensor,
        attention_mask_2d: torch.Tensor | None,
    ) -> Any:
        """The mask `model(...)` would give this layer, built once per (type, cache fill level);
        None where the layer's attention is causal by itself (`_causal_built_in`).

        Sized by this layer's own cache state (`layer_idx`), not by the model's first layer:
        during layer-segmented prefill, layers before the current one already hold the prompt.
        """
        if self._causal_built_in(layer_idx, cache, attention_mask_2d):
            return None
        kind = self.layer_types[layer_idx]
        key = (kind, _seq_length(cache, layer_idx), _mask_sizes(cache, hidden.shape[1], layer_idx))
        if key not in memo:
            # The cache goes positionally: its keyword is `past_key_values` on 5.17, `cache` on 5.24.
            memo[key] = _MASK_FUNCTIONS[kind](
                self.config, hidden, attention_mask_2d, cache, position_ids=position_ids, layer_idx=layer_idx
            )
        return memo[key]

    def _causal_built_in(self, layer_idx: int, cache: Cache | None, attention_mask_2d: torch.Tensor | None) -> bool:
        """True when this layer's attention needs no mask: an unpadded full-attention layer of a
        SparseServeCache under "sparseserve" attention applies causality itself (lower-right SDPA).

        HF would build a (T, past + T) bool mask for a chunk over its past, which the attention
        never reads: 8 GiB for the second 64K-token half of a 128K prompt, the peak of the prefill.
        """
        if attention_mask_2d is not None or self.layer_types[layer_idx] != FULL or cache is None:
            return False
        if getattr(self.config, "_attn_implementation", None) != "sparseserve" or layer_idx >= len(cache.layers):
            return False
        return isinstance(cache.layers[layer_idx], SparseServeLayer)


def _find_decoder(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "model", None)
    candidates = [inner, getattr(inner, "language_model", None)]
    if hasattr(model, "get_decoder"):
        try:
            candidates.append(model.get_decoder())
        except (AttributeError, ValueError):
            pass
    for module in candidates:
        if module is not None and all(
            hasattr(module, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")
        ):
            return module
    raise ValueError(
        f"DecoderStack needs a decoder with embed_tokens, layers, norm and rotary_emb (Llama-style); "
        f"{type(model).__name__} has none"
    )


def _layer_types(config: Any, num_layers: int) -> list[str]:
    types = attention_layer_types(config)[:num_layers]  # the rule the cache uses too
    unknown = sorted(set(types) - set(_MASK_FUNCTIONS))
    if unknown:
        raise NotImplementedError(f"DecoderStack supports layer types {sorted(_MASK_FUNCTIONS)}, not {unknown}")
    return types


def _seq_length(cache: Cache | None, layer_idx: int) -> int:
    if cache is None or layer_idx >= len(cache.layers):  # DynamicCache() grows its layers lazily
        return 0
    return cache.get_seq_length(layer_idx)


def _mask_sizes(cache: Cache | None, query_length: int, layer_idx: int) -> tuple[int, int] | None:
    if cache is None:
        return None
    return tuple(cache.get_mask_sizes(query_length, layer_idx))
