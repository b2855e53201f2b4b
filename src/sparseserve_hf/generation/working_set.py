"""Working-set estimator: the blocks a request selected over its last w decode steps.

Consecutive decode steps select mostly the same blocks (a step's selection falls almost
entirely inside the union of the previous dozen on a real model), so the union of the last
w selections, across layers and KV heads, is what a request needs resident in the HBM block
cache to decode without misses. The union is kept on the device as one "last selected at"
stamp per DRAM block id: stamping a step's picks and counting fresh stamps are tensor ops.
"""

from __future__ import annotations

import torch

from ..cache import SparseServeCache
from ..cache.grow import grown
from ..cache.plain import plain_tensors
from ..config import SparseServeConfig
from ..scoring import SELECTIONS

NEVER = -(2**62)


class WorkingSetTracker:
    """Stamps every selected block with its request's decode step; counts each row's fresh blocks.

    Stamps are per request steps (a request that sits out an iteration does not age its own
    working set). Each block belongs to one request (the Generator never shares rows), and
    `forget` clears the stamps of a request's blocks before their ids are reused. The stamps are
    plain tensors (`plain_tensors`), updated in place in any mode: a tracker made or first used
    under `torch.inference_mode` keeps working outside it.

    Args:
        window: w, decode steps whose selections form the working set.
        device: where the stamps live (the block store's device).
    """

    @plain_tensors
    def __init__(self, window: int, device: torch.device) -> None:
        self.window = window
        self.stamp = torch.full((0,), NEVER, dtype=torch.long, device=device)  # (C,) per DRAM block id

    @plain_tensors
    def observe(self, cache: SparseServeCache, steps: torch.Tensor) -> torch.Tensor:
        """Record the step just decoded and return each row's working set in head-blocks.

        Fixed-shape tensor ops only: the caller reads the sizes back together with the sampled
        tokens (one host sync per step, not one per layer).

        Args:
            cache: the batch cache right after a decode step (its layers' `last_pick` set).
            steps: (B,) each row's decode-step count, this step included.
        Returns:
            (B,) long working-set sizes on the device (unique head-blocks over all layers and KV heads).
        """
        self._track(cache)
        steps = steps.to(self.stamp.device).view(-1, 1, 1)  # (B, 1, 1)
        fresh = torch.zeros_like(steps.view(-1))
        # All layers in one stack where their shapes agree: a handful of kernels per decode
        # iteration instead of a handful per layer (this runs after each CUDA-graph replay, on the
        # host's clock). Transient: two int64 copies of every layer's table (64 MiB each at B=16,
        # 2048 blocks, 32 layers).
        groups = _stacked(cache.layers)
        for tables, picked, valid in groups:  # (L, B, Hkv, N), (L, B, Hkv, U) x 2
            if picked is not None:
                ids = torch.gather(tables, 3, picked).clamp(min=0)
                # Unpicked entries offer NEVER, which "amax" ignores: no boolean mask, no host sync.
                stamps = torch.where(valid, steps, NEVER)
                self.stamp.scatter_reduce_(0, ids.flatten(), stamps.flatten(), "amax")
        for tables, _, _ in groups:  # every row's stamps are final: count them
            # -1 (unused) reads the last stamp, masked out by `tables >= 0`: no clamped copy.
            recent = self.stamp[tables] > steps - self.window
            fresh += (recent & (tables >= 0)).sum(dim=(0, 2, 3))
        return fresh

    @plain_tensors
    def forget(self, cache: SparseServeCache) -> None:
        """Clear the stamps of every block of `cache`'s rows (call before freeing them)."""
        self._track(cache)
        for layer in cache.layers:
            if layer.is_initialized:
                ids = layer.block_ids[layer.block_ids >= 0]
                self.stamp[ids.to(self.stamp.device)] = NEVER

    def _track(self, cache: SparseServeCache) -> None:
        if cache.store is not None:
            self.stamp = grown(self.stamp, cache.store.dram.capacity, fill=NEVER)


def _stacked(layers: list) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """Each layer's (block_ids, picked, valid) with a leading layer axis: one (L, ...) stack when
    every layer picked this step with the same shapes, else one (1, ...) entry per layer (picked
    and valid None where a layer picked nothing)."""
    picks = [layer.last_pick for layer in layers]
    shapes = {(layer.block_ids.shape, pick[0].shape) for layer, pick in zip(layers, picks) if pick is not None}
    if None not in picks and len(shapes) == 1:
        picked, valid = (torch.stack(part) for part in zip(*(pick[:2] for pick in picks)))
        return [(torch.stack([layer.block_ids for layer in layers]), picked, valid)]
    return [
        (layer.block_ids[None], *((pick[0][None], pick[1][None]) if pick is not None else (None, None)))
        for layer, pick in zip(layers, picks)
    ]


def initial_working_set(config: SparseServeConfig, model_config, num_tokens: int, tp_size: int = 1) -> int:
    """Head-blocks a request will select per decode step, right after prefill (no history yet).

    Per sparse layer and KV head: the most different blocks its pick holds (the selection
    granularity's `distinct_blocks`), capped at the row's blocks.
    `tp_size`: tensor-parallel ranks; a rank holds (and counts) its share of the KV heads.
    """
    text = model_config.get_text_config()
    model_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_head = SELECTIONS[config.selection].distinct_blocks(config, text.num_attention_heads // model_kv_heads)
    num_kv_heads = model_kv_heads // tp_size
    full_blocks = max(num_tokens - 1, 0) // config.block_size  # the tail keeps 1..block_size tokens
    num_sparse_layers = text.num_hidden_layers - len(config.dense_layers)
    return num_sparse_layers * num_kv_heads * min(per_head, full_blocks)
