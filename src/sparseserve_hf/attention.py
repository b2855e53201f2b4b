"""The attention function registered as "sparseserve".

Dense path: prefill chunks, 1-token prompts, dense layers and models run without a
SparseServeCache, all through HF's own SDPA function so the numbers match stock `sdpa`.
Sparse path (decode with a SparseServeLayer): score every full block against the query with
its metadata, keep sink + window + top-k blocks, fetch the misses into the HBM block cache,
and attend over the selected blocks plus the row's tail block.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention.bias import causal_lower_right
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from .cache import forward_log
from .cache.layer import SparseServeLayer
from .config import SparseServeConfig
from .scoring import SCORERS, SELECTIONS

logger = logging.getLogger(__name__)


def sparseserve_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention backend. query (B, Hq, T, D); key/value (B, Hkv, T', D); returns (B, T, Hq, D)."""
    got = forward_log.take(getattr(module, "layer_idx", -1), key)
    if got is None:
        _hint_no_cache()
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    try:
        if got.layer_idx == 0:  # once per forward: the model is the cache's, the positions fit
            got.log.check_forward(getattr(module, "config", None))
        out = _attend(got.layer, got.static, module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    except BaseException:
        got.log.undo()  # no layer keeps this forward's tokens: the cache is as before it
        raise
    got.log.finish(got.layer_idx)
    return out, None


def _attend(
    layer: SparseServeLayer | None,
    static: bool,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    **kwargs,
) -> torch.Tensor:
    """(B, T, Hq, D) attention of one layer of a SparseServeCache, committing its staged keys.
    `static`: the cache's static step (`SparseServeCache.static_step`)."""
    if layer is None:  # a dense or sliding-window layer: HF's own SDPA over what its layer returned
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )[0]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    num_new = query.shape[2]
    real = new_token_mask(attention_mask, num_new, query.shape[0])
    if num_new == 1 and layer.num_positions > num_new:
        layer.commit(real, static=static)
        return sparse_decode_attention(layer, query, scaling, static)
    out = dense_attention_with_past(module, layer, query, key, value, attention_mask, scaling, dropout, **kwargs)
    layer.commit(real, prompt_queries=query)
    return out


def new_token_mask(attention_mask: torch.Tensor | None, num_new: int, batch: int) -> torch.Tensor | None:
    """(B, T) True where a new token is real (not padding), read off the last query row; None: all real."""
    if attention_mask is None:
        return None
    allowed = _as_bool(attention_mask)[:, 0, -1, -num_new:]
    return allowed.expand(batch, num_new)


def dense_attention_with_past(
    module: torch.nn.Module,
    layer: SparseServeLayer,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float,
    **kwargs,
) -> torch.Tensor:
    """Dense causal attention of new tokens over the stored past (read back from DRAM) and themselves."""
    batch, _, num_new, _ = query.shape
    if layer.num_positions == num_new:  # no past: exactly stock SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )[0]
    if batch == 1 and getattr(module, "sliding_window", None) is None and _unpadded(attention_mask, num_new):
        # One full-attention row without padding (the Generator's prefill): its past is whole, so the
        # mask is causal aligned to the last key. A materialized (T, L + T) mask costs GiBs at 64K tokens.
        keys, values = layer.past_with(key, value)  # (1, Hkv, L + T, D)
        return causal_attention_over_past(query, keys, values, scaling, dropout)
    past_keys, past_values, past_valid = layer.past()  # (B, Hkv, L, D), (B, L)
    keys, values = torch.cat((past_keys, key), dim=2), torch.cat((past_values, value), dim=2)
    if attention_mask is None:
        new_part = torch.ones(num_new, num_new, dtype=torch.bool, device=query.device).tril()
    else:
        new_part = _as_bool(attention_mask)[..., -num_new:]
    mask = torch.cat(
        (past_valid[:, None, None, :].expand(batch, 1, num_new, -1), new_part.expand(batch, 1, num_new, num_new)),
        dim=-1,
    )  # (B, 1, T, L + T)
    mask |= ~mask.any(dim=-1, keepdim=True)  # fully masked (padding) queries: any finite output will do
    return sdpa_attention_forward(module, query, keys, values, mask, dropout=dropout, scaling=scaling, **kwargs)[0]


def _unpadded(attention_mask: torch.Tensor | None, num_new: int) -> bool:
    """True when every new token of the single row is real (reads the mask back: prefill only)."""
    return attention_mask is None or bool(new_token_mask(attention_mask, num_new, 1).all())


def causal_attention_over_past(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, dropout: float = 0.0
) -> torch.Tensor:
    """(B, T, Hq, D) attention of T new queries over L + T keys, query t seeing keys up to L + t.

    query (B, Hq, T, D); keys/values (B, Hkv, L + T, D). PyTorch's lower-right causal bias runs
    flash / memory-efficient SDPA on CUDA without building the mask (CPU builds it). Flash reads
    each KV head for its whole query group; elsewhere the KV heads are repeated first.
    """
    bias = causal_lower_right(query.shape[2], keys.shape[2])
    grouped = flash_takes_groups(query, keys, values, dropout)
    if not grouped:
        groups = query.shape[1] // keys.shape[1]
        keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)  # (B, Hq, L + T, D)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=bias, dropout_p=dropout, scale=scaling, enable_gqa=grouped
    )
    return out.transpose(1, 2).contiguous()


def flash_takes_groups(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dropout: float) -> bool:
    """Whether flash SDPA runs these inputs with KV heads shared by query groups (CUDA only): then no
    (B, Hq, L + T, D) copy of the past is made. The memory-efficient kernel takes no groups."""
    if query.device.type != "cuda" or query.shape[1] == keys.shape[1]:
        return False
    params = SDPAParams(query, keys, values, None, dropout, False, True)
    return can_use_flash_attention(params)


def sparse_decode_attention(
    layer: SparseServeLayer, query: torch.Tensor, scaling: float, static: bool = False
) -> torch.Tensor:
    """One decode token per row over the selected blocks + tail. query (B, Hq, 1, D) -> (B, 1, Hq, D).

    An eager caller on CUDA replays the layer's captured piece (`LayerGraphs`); the static step
    (`static`: its caller, `graph.StaticDecoder`, runs the whole step, eager or capturing) runs it inline."""
    q = query[:, :, 0]  # (B, Hq, D)
    graphs = layer.store.layer_graphs
    if graphs is not None and not static and not _capturing(q):
        out = graphs.attend(layer, q, functools.partial(select_and_attend, layer, scaling=scaling))
    else:
        out = select_and_attend(layer, q, scaling, trim=q.device.type == "cpu" and not static)
    return out.unsqueeze(1)


def select_and_attend(layer: SparseServeLayer, q: torch.Tensor, scaling: float, trim: bool = False) -> torch.Tensor:
    """The sparse decode of one layer: pick and fetch blocks, attend over them and the tails.
    q (B, Hq, D) -> (B, Hq, D). `trim`: drop union columns no row uses first (`used_columns`).

    Where the store looks up beside attention (`TieredBlockStore.lookup_beside`), the blocks already
    in the HBM cache and the tails are attended while the lookup and the copy of the misses run,
    then the misses, and the two halves are merged."""
    store, tail = layer.store, layer.tail
    if trim or not store.lookup_beside:
        slots, head_mask, scales = select_and_fetch(layer, q, scaling)
        block_lse = layer.feedback_lse  # None unless the store feeds back (`remember_pick` made it)
        if trim and block_lse is None:  # the fed-back numbers are by column: every column stays
            slots, head_mask, scales = used_columns(slots, head_mask, scales)
        return store.ops.sparse_decode(
            q, store.hbm.pool, slots, head_mask, tail[:, :, 0], tail[:, :, 1], layer.tail_len, scaling,
            scales=scales, block_lse=block_lse,
        )  # fmt: skip
    picked, valid, head_mask = select_blocks(layer, q, scaling)
    block_lse = layer.feedback_lse
    reads = (layer.num_blocks, layer.tail_len)  # counted in the same launch: what this step reads
    block_ids, resident, join = store.fetch_beside(layer.block_ids, picked, valid, layer.first_partition, reads)
    pending = store.ops.begin_decode(
        q, store.hbm.pool, resident, head_mask, tail[:, :, 0], tail[:, :, 1], layer.tail_len, scaling,
        scales=store.scales_of(block_ids), block_lse=block_lse,
    )  # fmt: skip
    out = store.ops.finish_decode(pending, block_ids, join())
    store.settle()
    return out


def used_columns(
    slots: torch.Tensor, head_mask: torch.Tensor | None, scales: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`slots` (B, Hkv, U), `head_mask` (B, Hq, U) and `scales` (B, Hkv, U, 2) without the columns that are -1 in every row
    and head: the same attention without gathering, and multiplying by zero, blocks nobody loaded
    (a group union is G x K wide and mostly unused while rows are short). Its shape depends on the
    data, so only the eager CPU path takes it: there reading the mask back costs no sync, and no
    static (graph-mode) step runs it."""
    columns = (slots >= 0).flatten(0, 1).any(0).nonzero().flatten()  # (U',)
    if columns.numel() == slots.shape[-1]:
        return slots, head_mask, scales
    kept_scales = None if scales is None else scales[..., columns, :]
    return slots[..., columns], None if head_mask is None else head_mask[..., columns], kept_scales


def select_and_fetch(
    layer: SparseServeLayer, q: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The decode step's bookkeeping for one layer: score the row's blocks, pick them, resolve them to
    HBM slots (loading misses). q (B, Hq, D); `scaling` the attention's softmax scale. Returns slots (B, Hkv, U), -1 unused, the
    per-query-head mask (B, Hq, U) or None, and the blocks' (B, Hkv, U, 2) scales where they are
    stored in 8 bits (else None). Records the pick in `layer.last_pick` and what the step reads
    in the store's load counters."""
    store = layer.store
    picked, valid, head_mask = select_blocks(layer, q, scaling)
    block_ids = torch.where(valid, torch.gather(layer.block_ids, 2, picked), -1)  # (B, Hkv, U) DRAM ids
    store.account(layer.first_partition, valid, layer.num_blocks, layer.tail_len)  # what this step reads
    return store.fetch(block_ids, layer.first_partition), head_mask, store.scales_of(block_ids)


def select_blocks(
    layer: SparseServeLayer, q: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The decode step's selection for one layer: score the row's blocks and pick them. q (B, Hq, D);
    `scaling` the attention's softmax scale (channel scores estimate that softmax).

    Returns the blocks each KV head loads (B, Hkv, U) as indices into the row's table, their
    validity (B, Hkv, U), and the per-query-head mask (B, Hq, U) or None. Records the pick in
    `layer.last_pick`."""
    config, store = layer.config, layer.store
    num_kv_heads = layer.tail.shape[1]
    table = layer.block_ids  # (B, Hkv, N)
    fed_back = None if layer.feedback_lse is None else (layer.feedback_picked, layer.feedback_lse)  # the last step's
    scores = store.scorer.score(store.ops, q, store.metadata, table, config, scaling, fed_back)  # (B, Hq, N)
    picked, valid, head_mask = pick_blocks(store.ops, config, scores, layer.num_blocks, num_kv_heads, table.shape[2])
    if store.selection_override is not None:  # benchmark/test seam: scoring ran, loads follow the override
        picked, valid = store.selection_override(layer.layer_idx, layer.num_blocks, picked.shape[-1])
        head_mask = None
    layer.last_pick = (picked, valid, head_mask, q.shape[1] // num_kv_heads)  # expanded per query head only when read
    if store.feeds_back:
        layer.remember_pick(picked, q.shape[1])  # this step's pick, for the next step's scorer
    return picked, valid, head_mask


def pick_blocks(
    ops, config: SparseServeConfig, scores: torch.Tensor, num_blocks: torch.Tensor, num_kv_heads: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The blocks each KV head loads and which of them each query head attends, from (B, Hq, N) scores.

    Shared by the decode path and `eval.accuracy.selection_diagnostics` (which must measure exactly this).

    Args:
        ops: the backend op set (`ops.reference` or a `BlockOps`).
        config: the cache's config (selection, group_aggregation, budget, sink/window).
        scores: (B, Hq, N) block scores, -inf past a row's blocks.
        num_blocks: (B,) full blocks per row.
        num_kv_heads: Hkv.
        capacity: N, the width of the block table.
    Returns:
        picked, valid: (B, Hkv, U) block indices each KV head loads and their validity.
        head_mask: (B, Hq, U) which of them each query head attends; None = all of them.
    """
    selection = SELECTIONS[config.selection]
    floor = SCORERS[config.metadata].score_floor(config)
    return selection.pick(ops, config, scores, num_blocks, num_kv_heads, capacity, floor)


def _capturing(tensor: torch.Tensor) -> bool:
    """True while a CUDA graph captures on the current stream (a piece cannot be captured inside it)."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2  # additive float masks: 0 = attend


@functools.cache
def _hint_no_cache() -> None:
    logger.warning(
        "attn_implementation='sparseserve' without a SparseServeCache runs dense attention. For sparse decode "
        "pass one: model.generate(..., past_key_values=SparseServeCache(model.config, SparseServeConfig()))"
    )
