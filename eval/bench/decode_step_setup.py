"""What `decode_step` builds: the model, caches filled with random KV without a prefill, and timers.

A 16 x 32K prefill of an 8B model would cost minutes per system, so both caches are filled
directly: the dense `DynamicCache` with random K/V on the device, the `SparseServeCache` by
saving random head-blocks through `TieredBlockStore.save` (the same call prefill ends in: DRAM
write + Quest metadata) and setting each layer's block table, block count and tail.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

import sparseserve_hf  # noqa: F401  (registers attn_implementation="sparseserve")
from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.cache.cache import hbm_partitions
from sparseserve_hf.cache.grow import grown
from sparseserve_hf.cache.store import TieredBlockStore
from sparseserve_hf.ops import get_ops

from .selection_trace import SelectionTrace, TraceReplay

SHAPES = {
    "llama3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256,
    ),
}  # fmt: skip
FILL_CHUNK_BYTES = 512 << 20  # random blocks generated on the device per save call


def build_model(
    shape: str, attn: str, device: torch.device, dtype: torch.dtype, max_positions: int, num_layers: int | None = None
):
    """A seeded random-weight Llama of `shape` (its first `num_layers` layers only, if given), built on `device`."""
    dims = SHAPES[shape] | ({} if num_layers is None else {"num_hidden_layers": num_layers})
    config = LlamaConfig(**dims, max_position_embeddings=max_positions, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model.eval()


def dense_cache(model, batch: int, context: int) -> DynamicCache:
    """A DynamicCache holding `context` random tokens per row in every layer."""
    text = model.config
    cache = DynamicCache()
    shape = (batch, text.num_key_value_heads, context, text.head_dim)
    for layer_idx in range(text.num_hidden_layers):
        keys = torch.randn(shape, dtype=model.dtype, device=model.device)
        cache.update(keys, torch.randn_like(keys), layer_idx)
    return cache


def sparse_cache(
    model, config: SparseServeConfig, batch: int, context: int, spare_blocks: int, from_model: bool = False
) -> SparseServeCache:
    """A SparseServeCache whose rows hold `context` random tokens, full blocks in DRAM.

    `spare_blocks`: table width beyond the prompt's blocks, so decode saves never regrow it.
    `from_model`: built from the model itself, as `SparseServeCache(model, ...)` (its `generate`
    replays whole decode steps on CUDA), not from its config.
    """
    text, size = model.config, config.block_size
    ops, partitions = get_ops(config.backend, model.device), hbm_partitions(text, config)
    store = TieredBlockStore(config, ops, text.head_dim, model.dtype, model.device, partitions)
    cache = SparseServeCache(model if from_model else text, config, store=store)
    num_full = (context - 1) // size  # the tail keeps 1..block_size tokens
    for layer in cache.layers:
        probe = torch.zeros((batch, text.num_key_value_heads, 1, text.head_dim), dtype=model.dtype, device=model.device)
        layer.lazy_initialization(probe, probe)
        table = fill_blocks(store, batch, text.num_key_value_heads, num_full)  # (B, Hkv, N)
        layer.block_ids = grown(table, num_full + spare_blocks, fill=-1, dim=2)
        layer.num_blocks.fill_(num_full)
        layer.tail.normal_()
        layer.tail_len.fill_(context - num_full * size)
        layer.num_positions = context
    return cache


def replayed_cut(model, batch: int, context: int, trace: str, dry_run: bool, **fields: Any) -> SparseServeCache:
    """The cache of a few-layer cut of the decode step, timed per layer (`profile_step`, `step_knobs`):
    the default config (and `fields`) with an HBM cache of 25% of the cut's dense KV, `context`
    random tokens per row, and block loads following the selection trace at `trace`."""
    text = model.config
    dense_kv = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * model.dtype.itemsize
    budget = {"token_budget": 64} if dry_run else {}  # the tiny shapes' context is 200 tokens
    config = SparseServeConfig(
        block_size=16 if dry_run else 32,
        hbm_cache_bytes=max(dense_kv * batch * context // 4, 1 << 20),
        max_batch=batch,
        **budget,
    )
    config = replace(config, **fields)
    cache = sparse_cache(model, config, batch, context, spare_blocks=4)
    replay = TraceReplay(SelectionTrace.load(trace), text.num_hidden_layers, text.num_key_value_heads, model.device)
    cache.store.selection_override = replay
    return cache


def fill_blocks(store: TieredBlockStore, batch: int, num_kv_heads: int, num_full: int) -> torch.Tensor:
    """Save random head-blocks for every (row, KV head); returns their DRAM ids (B, Hkv, N)."""
    block_shape = store.dram.block_shape
    rows_per_chunk = max(1, FILL_CHUNK_BYTES // (num_kv_heads * num_full * store.block_bytes))
    tables = []
    for start in range(0, batch, rows_per_chunk):
        rows = min(rows_per_chunk, batch - start)
        blocks = torch.randn((rows * num_kv_heads * num_full, *block_shape), dtype=store.dtype, device=store.device)
        tables.append(store.save(blocks).view(rows, num_kv_heads, num_full))  # ids in (row, head, block) order
    return torch.cat(tables)


class RegionTimer:
    """Sums time spent inside wrapped callables: CUDA events on a GPU (stream time between the
    region's first and last launch), wall clock on CPU. Calls made while a CUDA graph is being
    captured are not timed (their launches only run, untimed, when the graph replays)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: dict[str, list[Any]] = defaultdict(list)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args, **kwargs):
            if self.cuda and torch.cuda.is_current_stream_capturing():
                return fn(*args, **kwargs)  # an event recorded into a capture has no time to read
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self.marks[name].append((start, end))
            else:
                begin = time.perf_counter()
                out = fn(*args, **kwargs)
                self.marks[name].append((time.perf_counter() - begin) * 1e3)
            return out

        return timed

    def totals_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {k: sum(s.elapsed_time(e) for s, e in v) for k, v in self.marks.items()}
        return {k: float(sum(v)) for k, v in self.marks.items()}


def instrument(store: TieredBlockStore, timer: RegionTimer) -> Callable[[], None]:
    """Time the sparse decode path's parts: scoring, top-k, table lookup (+ transfer), attention.

    The parts are timed one after another, so the lookup runs before attention, not beside it
    (`TieredBlockStore.lookup_beside` off until restored): beside it, the parts overlap.
    Returns a callable that takes the timers out again.
    """
    ops, fetch, gather, beside = store.ops, store.fetch, store.hbm.gather_blocks, store.lookup_beside
    store.lookup_beside = False
    store.ops = replace(
        ops,
        score_table=timer.wrap("scoring", ops.score_table),
        select_blocks=timer.wrap("topk", ops.select_blocks),
        union_over_group=timer.wrap("topk", ops.union_over_group),
        select_group_union=timer.wrap("topk", ops.select_group_union),
        aggregate_group_scores=timer.wrap("topk", ops.aggregate_group_scores),
        sparse_decode=timer.wrap("attention", ops.sparse_decode),
    )
    store.fetch = timer.wrap("fetch", store.fetch)  # table lookup + the FlashH2D launch
    store.hbm.gather_blocks = timer.wrap("transfer", store.hbm.gather_blocks)

    def restore() -> None:
        store.ops, store.hbm.gather_blocks, store.lookup_beside = ops, gather, beside
        del store.fetch  # the instance attribute shadowed the method
        assert store.fetch.__func__ is fetch.__func__

    return restore
