"""Decode step benchmark: one full decode step, stock transformers vs SparseServeCache.

    python -m eval.bench.decode_step --graph --out eval/results/decode_step.json   # ~8 min on the H200
    python -m eval.bench.decode_step --dry-run --graph                             # tiny shapes on CPU

Llama-3-8B shape with random bf16 weights, B=16 rows of ~32K tokens (32576: with both locality
blocks' steps the DRAM pool holds every block the run saves in exactly 64 GiB of pinned memory, a
power of two as the caching host allocator rounds), `SparseServeConfig()` defaults except the HBM
block cache (25% of the batch's dense KV) and the DRAM pool. Baselines in the same run, all warm:
stock `model(...)` with SDPA and a `DynamicCache` (the fastest of `--stock-windows` timed windows:
its per-step concatenation of every layer's KV makes it move with the allocator's state), the same
in a child process with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, and stock's static path
(a `StaticCache` and the model's compiled call, as `generate(cache_implementation="static")` runs
it); `stock_best_ms` is the fastest.

The KV is random and written straight into the caches (`decode_step_setup`; no 16 x 32K
prefill); tokens are the model's own greedy picks from a random start. The sparse step runs in
two blocks on one cache:
- `random_kv`: the model's own selection over random keys, which moves every step;
- `real_locality`: scoring and top-k still run, but the blocks loaded follow a recorded trace of
  the real default model's selections (`selection_trace.TraceReplay` through the store's
  `selection_override`), so the HBM cache sees a real model's step-to-step locality.
Each block reports `overlap_1step` / `overlap_union12` of the selections it ran, ms/step eager
(`sparse_ms`) and as CUDA-graph replays (`graph_ms`, `graph.StaticDecoder`), the hit rate,
the floor ((weights + loaded KV + metadata bytes) / HBM copy bandwidth + missed-block bytes /
PCIe H2D bandwidth, both measured in this run), `speedup_vs_best_stock`, one layer's selection +
lookup (`attention.select_and_fetch`) as a graph replay (`bookkeeping_us_per_layer`) beside its
metadata read time, what attention waits for with the lookup beside it (the selection and the
picked blocks' resident slots, `before_attention_us_per_layer`), and a breakdown from an
instrumented eager pass (CUDA events around scoring, top-k, table lookup, FlashH2D transfer,
attention; `other` = projections, MLPs, launches), which runs the lookup before attention
(beside it, as the step does by default, the parts overlap).

`--graph` also checks the graph's tokens: a 4-layer model of the same shape, three caches with
the same random KV, decoded by the graph, by the same step run eagerly and by the ordinary
eager path (`graph_equality`; its context puts a tail-block save inside the steps).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from eval.bench.common import (
    EXPANDABLE_SEGMENTS,
    add_config_overrides,
    add_knob_option,
    apply_knobs,
    config_overrides,
    free_memory,
    graph_ms,
    json_child,
    pick_device,
    prepare_triton,
    print_table,
    run_record,
    sync,
    time_ms,
    write_json,
)
from eval.bench.decode_step_setup import SHAPES, RegionTimer, build_model, dense_cache, instrument, sparse_cache
from eval.bench.selection_trace import (
    RECORDED_TRACE,
    UNION_WINDOW,
    SelectionTrace,
    TraceReplay,
    describe,
    loaded_mask,
    overlaps,
    sha256,
)
from sparseserve_hf import SparseServeConfig
from sparseserve_hf.attention import select_and_fetch, select_blocks
from sparseserve_hf.compat import cache_kwarg
from sparseserve_hf.graph import StaticDecoder
from sparseserve_hf.ops.reference import kv_storage_dtype

GIB = 1 << 30
GRAPH_WARMUP = 3  # graph steps before timing; the first one captures
EQUALITY_LAYERS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=32576)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--hbm-cache-gib", type=float, default=None, help="fixed HBM cache size (else the fraction)")
    parser.add_argument("--hbm-cache-fraction", type=float, default=0.25, help="HBM cache / the batch's dense KV")
    parser.add_argument("--locality", choices=("random", "real", "both"), default="both")
    parser.add_argument("--trace", default=str(RECORDED_TRACE), help="selection trace for --locality real|both")
    parser.add_argument("--skip-static", action="store_true", help="skip stock's StaticCache + compiled step")
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--breakdown-steps", type=int, default=8)
    parser.add_argument("--dense-steps", type=int, default=10)
    parser.add_argument("--skip-dense", action="store_true")
    parser.add_argument(
        "--stock-windows",
        type=int,
        default=3,
        help="timed windows of --dense-steps for stock's dynamic step; the fastest counts",
    )
    parser.add_argument(
        "--no-stock-expandable",
        dest="stock_expandable",
        action="store_false",
        help="skip stock's dynamic step under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (a child process)",
    )
    parser.add_argument("--stock-only", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    parser.add_argument("--graph", action="store_true", help="also time the CUDA-graph step and check its tokens")
    parser.add_argument("--equal-context", type=int, default=4090, help="--graph token check: context per row")
    parser.add_argument("--equal-steps", type=int, default=40, help="--graph token check: steps compared")
    parser.add_argument("--out", default=None, help="JSON output path")
    add_config_overrides(parser, "metadata_dtype=float8_e4m3fn")
    add_knob_option(parser, "triton_decode.PROGRAMS_PER_SM=2")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (tests the script)")
    return parser.parse_args(argv)


def bandwidths(device: torch.device) -> dict[str, float]:
    """HBM copy GB/s (bytes read + written) and bulk pinned H2D GB/s, 1 GiB each (1 MiB on CPU)."""
    nbytes = GIB if device.type == "cuda" else 1 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    h2d_ms = time_ms(lambda: dst.copy_(host, non_blocking=True), device)
    return {"hbm_copy_gb_per_s": 2 * nbytes / copy_ms / 1e6, "pcie_h2d_gb_per_s": nbytes / h2d_ms / 1e6}


def run_steps(model, cache, tokens: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """Greedy decode `steps` tokens (kept on the device); returns (ms per step, last tokens)."""
    kwargs = {cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
    sync(tokens.device)
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            tokens = model(input_ids=tokens, **kwargs).logits[:, -1:].argmax(-1)  # (B, 1)
    sync(tokens.device)
    return (time.perf_counter() - start) * 1e3 / max(steps, 1), tokens


def measure_dense(args, device, dtype, shape: str) -> tuple[float, list[float]]:
    """Stock's DynamicCache step, warm: (the fastest of `--stock-windows` timed windows, every window).

    Its update concatenates each layer's whole KV every step, so its time depends on the caching
    allocator's state and moves between windows and runs: best stock is its fastest window."""
    model = build_model(shape, "sdpa", device, dtype, args.context + 1024)
    cache = dense_cache(model, args.batch, args.context)
    tokens = torch.randint(1, model.config.vocab_size, (args.batch, 1), device=device)
    _, tokens = run_steps(model, cache, tokens, 4)
    windows = []
    for _ in range(max(args.stock_windows, 1)):
        ms, tokens = run_steps(model, cache, tokens, args.dense_steps)
        windows.append(ms)
    del model, cache
    free_memory(device)
    return min(windows), windows


def dense_or_why(args, device, dtype, shape: str) -> tuple[float | None, list[float] | None, str | None]:
    """`measure_dense`, or (None, None, why) where stock's cache does not fit the device: a DynamicCache of
    B=16 x 32K on the 8B shape (68 GB beside 15 GB of weights) fills an 80 GB card. Ours is measured
    either way; the JSON then says that stock could not run at this shape here."""
    try:
        return *measure_dense(args, device, dtype, shape), None
    except torch.OutOfMemoryError as exc:
        why = f"out of memory: {str(exc).splitlines()[0]}"
    free_memory(device)  # after the handler: the traceback held stock's model and cache
    print(f"stock DynamicCache step: {why}")
    return None, None, why


def measure_dense_expandable(argv: list[str]) -> float | None:
    """Stock's DynamicCache step in a child process under expandable segments; None when it fails."""
    child = [a for a in argv if a != "--graph"] + ["--stock-only", "--skip-static"]
    result = json_child("eval.bench.decode_step", child, EXPANDABLE_SEGMENTS)
    return None if result is None else result["stock_dynamic_ms"]


def measure_static(args, device, dtype, shape: str) -> float | None:
    """ms/step of stock transformers' static path: a `StaticCache` and the model's compiled call
    (what `generate(cache_implementation="static")` runs per decode step), warm. None when it fails."""
    try:
        return _static_ms(args, device, dtype, shape)
    except Exception as exc:  # noqa: BLE001  a baseline that cannot run is recorded as missing, with why
        print(f"static stock step failed: {type(exc).__name__}: {exc}")
        return None
    finally:
        free_memory(device)


def _static_ms(args, device, dtype, shape: str) -> float:
    from transformers import StaticCache

    model = build_model(shape, "sdpa", device, dtype, args.context + 1024)
    steps = 3 + args.dense_steps
    cache = StaticCache(config=model.config, max_cache_len=args.context + steps + 8)
    text = model.config
    shape_kv = (args.batch, text.num_key_value_heads, args.context, text.head_dim)
    positions = {"cache_position": torch.arange(args.context, device=device)}
    for layer_idx in range(text.num_hidden_layers):
        keys = torch.randn(shape_kv, dtype=dtype, device=device)
        cache.update(keys, torch.randn_like(keys), layer_idx, positions)
        del keys
    compiled = model.get_compiled_call(None) if device.type == "cuda" else model
    tokens = torch.randint(1, text.vocab_size, (args.batch, 1), device=device)
    kwargs = {cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
    with torch.no_grad():
        for _ in range(3):  # compile and warm up (cudagraph trees record on the second call)
            tokens = compiled(input_ids=tokens, **kwargs).logits[:, -1:].argmax(-1).clone()
        sync(device)
        start = time.perf_counter()
        for _ in range(args.dense_steps):
            tokens = compiled(input_ids=tokens, **kwargs).logits[:, -1:].argmax(-1).clone()
        sync(device)
    return (time.perf_counter() - start) * 1e3 / max(args.dense_steps, 1)


def measure_sparse(args, device, dtype, shape: str, config: SparseServeConfig) -> dict[str, Any]:
    """One cache, then each locality in turn: eager steps, graph steps, bookkeeping, breakdown."""
    model = build_model(shape, "sparseserve", device, dtype, args.context + 1024)
    total_steps = decode_steps(args)
    filled = time.perf_counter()
    cache = sparse_cache(model, config, args.batch, args.context, spare_blocks=total_steps // config.block_size + 2)
    fill_s = time.perf_counter() - filled
    store = cache.store
    tokens = torch.randint(1, model.config.vocab_size, (args.batch, 1), device=device)
    out: dict[str, Any] = {
        "fill_seconds": fill_s,
        "dram_pool_bytes": store.dram.capacity * store.block_bytes,
        "hbm_cache_slots": store.hbm.num_slots,
    }
    for locality in localities(args):
        replay = None
        if locality == "real_locality":
            trace = SelectionTrace.load(args.trace)
            replay = TraceReplay(trace, len(cache.layers), model.config.num_key_value_heads, device)
            out["trace"] = {"path": args.trace, "sha256": sha256(args.trace)} | describe(trace)
        store.selection_override = replay
        out[locality], tokens = measure_locality(args, model, cache, tokens, replay)
        out[locality]["loads"] = store.load_summary()  # its last measured steps' reads (measure_locality resets)
    del model, cache, store
    free_memory(device)
    return out


def measure_locality(args, model, cache, tokens, replay) -> tuple[dict[str, Any], torch.Tensor]:
    """The sparse step's numbers under the store's current `selection_override`."""
    device, store = tokens.device, cache.store
    _, tokens = run_steps(model, cache, tokens, args.warmup)
    observed = UNION_WINDOW + 2  # untimed steps whose selections give the block's overlaps
    if replay is not None:
        replay.keep = True
        with paused_layer_graphs(store):  # a replayed piece would record nothing
            _, tokens = run_steps(model, cache, tokens, observed)
        longest = int(cache.layers[0].num_blocks.max())
        locality = overlaps(replay.replayed_loaded(model.config.num_hidden_layers, longest))
        replay.keep, replay.replayed = False, []
    else:
        locality, tokens = selection_overlaps(model, cache, tokens, observed)
    store.reset_stats()  # count the steady steps only
    ms, tokens = run_steps(model, cache, tokens, args.steps)
    stats = store.read_stats()
    looked_up = stats.hits + stats.misses
    result = {
        "sparse_ms": ms,
        "hit_rate": stats.hits / looked_up if looked_up else 0.0,
        "miss_bytes_per_step": stats.h2d_bytes / args.steps,
        **locality,
    }
    result |= step_bytes(model, cache)
    if args.graph:  # before the breakdown pass: its CUDA-event timers cannot be captured
        graph, tokens = measure_graph(args, model, cache, tokens)
        result |= graph
    result |= bookkeeping(cache, device)
    timer = RegionTimer(device)
    restore = instrument(store, timer)
    with paused_layer_graphs(store):  # op by op: a replayed piece calls none of the timed parts
        step_ms, tokens = run_steps(model, cache, tokens, args.breakdown_steps)
    restore()
    parts = {k: v / args.breakdown_steps for k, v in timer.totals_ms().items()}
    parts["table"] = parts.get("fetch", 0.0) - parts.get("transfer", 0.0)
    named = ("scoring", "topk", "table", "transfer", "attention")
    breakdown = {k: parts.get(k, 0.0) for k in named}
    breakdown["other"] = step_ms - sum(breakdown.values())
    result["breakdown_ms"] = breakdown | {"instrumented_step": step_ms}
    return result, tokens


def paused_layer_graphs(store):
    """The store's layer pieces paused (eager calls), or nothing where it captures none."""
    return store.layer_graphs.paused() if store.layer_graphs is not None else contextlib.nullcontext()


def selection_overlaps(model, cache, tokens: torch.Tensor, steps: int) -> tuple[dict[str, float], torch.Tensor]:
    """Overlaps of the model's own selections over `steps` eager steps (random KV: no trace)."""
    num_blocks = int(cache.layers[0].num_blocks.max()) + steps
    loaded = []
    for _ in range(steps):
        _, tokens = run_steps(model, cache, tokens, 1)
        per_layer = []
        for layer in cache.layers:
            picked, valid = layer.last_pick[0], layer.last_pick[1]  # (B, Hkv, U)
            per_layer.append(loaded_mask(picked, valid, num_blocks).cpu())
        loaded.append(torch.stack(per_layer, dim=1))  # (B, L, Hkv, N)
    return overlaps(torch.stack(loaded, dim=1).numpy()), tokens  # (B, T, L, Hkv, N)


def bookkeeping(cache, device: torch.device) -> dict[str, Any]:
    """Per layer: selection + lookup (`select_and_fetch`, scoring to slots, misses loaded) as a graph
    replay, and the time the layer's metadata takes to read at the measured copy bandwidth."""
    layer = cache.layers[len(cache.layers) // 2]
    num_q_heads = cache.layers[0].tail.shape[1] * _group(cache)
    query = torch.randn(
        (layer.tail.shape[0], num_q_heads, layer.tail.shape[-1]), dtype=layer.tail.dtype, device=device
    )  # (B, Hq, D)
    store = layer.store
    meta_bytes = int((layer.block_ids >= 0).sum()) * store.metadata[:1].numel() * store.metadata.element_size()
    scaling = query.shape[-1] ** -0.5  # Llama's softmax scale
    replay_ms = graph_ms(lambda: select_and_fetch(layer, query, scaling), device)
    eager_ms = time_ms(lambda: select_and_fetch(layer, query, scaling), device)
    before_ms = graph_ms(lambda: before_attention(layer, query, scaling), device)
    before_eager_ms = time_ms(lambda: before_attention(layer, query, scaling), device)
    return {
        "bookkeeping_us_per_layer": None if replay_ms is None else replay_ms * 1e3,
        "bookkeeping_eager_us_per_layer": eager_ms * 1e3,
        "before_attention_us_per_layer": None if before_ms is None else before_ms * 1e3,
        "before_attention_eager_us_per_layer": before_eager_ms * 1e3,
        "metadata_bytes_per_layer": meta_bytes,
    }


def before_attention(layer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """What decode attention waits for when the lookup runs beside it (`lookup_beside_attention`):
    the selection, then the picked blocks' ids and resident slots. Returns the resident slots."""
    picked, valid, _ = select_blocks(layer, query, scaling)
    return layer.store.ops.picked_blocks(layer.block_ids, picked, valid, layer.store.hbm.tables)[1]


def _group(cache) -> int:
    pick = cache.layers[0].last_pick
    return pick[3] if pick is not None else 1


def measure_graph(args, model, cache, tokens: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """ms per step of the same greedy decode as CUDA-graph replays (on CPU: the static step, eagerly)."""
    device, store = tokens.device, cache.store
    decoder = StaticDecoder(model, cache, capture=device.type == "cuda")
    decoder.start(tokens)
    sync(device)
    start = time.perf_counter()
    for _ in range(GRAPH_WARMUP):
        decoder.step()
    sync(device)
    first_s = time.perf_counter() - start
    store.reset_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        tokens = decoder.step()
    sync(device)
    ms = (time.perf_counter() - start) * 1e3 / max(args.steps, 1)
    stats = store.read_stats()
    looked_up = stats.hits + stats.misses
    return {
        "graph_ms": ms,
        "graph_captured": decoder.capture,
        "graph_captures": decoder.num_captures,
        "graph_first_steps_seconds": first_s,  # GRAPH_WARMUP steps, the capture included
        "graph_hit_rate": stats.hits / looked_up if looked_up else 0.0,
        "graph_table_width": cache.layers[0].block_ids.shape[2],
    }, tokens.clone()


def graph_equality(args, device, dtype, shape: str, config: SparseServeConfig) -> dict[str, Any]:
    """Greedy tokens of the graph vs the same static step run eagerly vs the ordinary eager path.

    A model of the run's shape cut to a few layers, three caches filled with the same random KV.
    """
    layers = min(EQUALITY_LAYERS, SHAPES[shape]["num_hidden_layers"])
    context, steps, size = args.equal_context, args.equal_steps, config.block_size
    model = build_model(shape, "sparseserve", device, dtype, context + steps + 1024, num_layers=layers)
    dims = SHAPES[shape]
    blocks = layers * args.batch * dims["num_key_value_heads"] * ((context + steps) // size + 2)
    selection = (
        args.batch * dims["num_attention_heads"] * config.selected_full_blocks
    )  # B x Hkv x the largest union (G x K)
    block_bytes = 2 * size * dims["head_dim"] * dtype.itemsize
    # Each (layer, KV head) partition holds twice its selection: lookups evict, which the three runs must agree on.
    config = replace(config, dram_bytes=blocks * block_bytes, hbm_cache_bytes=2 * layers * selection * block_bytes)

    def filled():
        torch.manual_seed(1)  # the same random KV in every cache
        return sparse_cache(model, config, args.batch, context, spare_blocks=steps // size + 2)

    start = torch.randint(1, model.config.vocab_size, (args.batch, 1), device=device)
    graph = StaticDecoder(model, filled(), capture=device.type == "cuda")
    eager = StaticDecoder(model, filled(), capture=False)
    graph.start(start)
    eager.start(start)
    plain, plain_tokens = filled(), start
    mismatch = {"eager_step": None, "eager_path": None}
    max_diff = 0.0
    for step in range(steps):
        got, want = graph.step(), eager.step()
        _, plain_tokens = run_steps(model, plain, plain_tokens, 1)
        for name, other in (("eager_step", want), ("eager_path", plain_tokens)):
            if mismatch[name] is None and not torch.equal(got, other):
                mismatch[name] = step
        max_diff = max(max_diff, float((graph.logits.float() - eager.logits.float()).abs().max()))
    result = {
        "layers": layers, "batch": args.batch, "context": context, "steps": steps,
        "captured": graph.capture, "captures": graph.num_captures,
        "tokens_equal_eager_step": mismatch["eager_step"] is None,
        "tokens_equal_eager_path": mismatch["eager_path"] is None,
        "first_mismatch": mismatch, "logits_max_abs_diff_vs_eager_step": max_diff,
        "hbm_cache_bytes": config.hbm_cache_bytes,
    }  # fmt: skip
    return result


def step_bytes(model, cache) -> dict[str, int]:
    """Bytes one decode step must read from HBM: weights (not the embedding table: it reads B rows),
    the K/V of the blocks each KV head loaded at the last step plus the tails, and the metadata of
    every block scored."""
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    store = cache.store
    meta_per_block = store.metadata[:1].numel() * store.metadata.element_size()
    selected = metadata = 0
    for layer in cache.layers:
        valid = layer.last_pick[1]  # (B, Hkv, U)
        selected += int(valid.sum()) * store.block_bytes + layer.tail.numel() * layer.tail.element_size()
        metadata += int((layer.block_ids >= 0).sum()) * meta_per_block
    return {"weight_bytes": weights, "selected_kv_bytes": selected, "metadata_bytes": metadata}


def floor_ms(sparse: dict[str, Any], bw: dict[str, float]) -> float:
    """The step's floor: HBM bytes over the copy bandwidth plus missed-block bytes over PCIe."""
    hbm = sparse["weight_bytes"] + sparse["selected_kv_bytes"] + sparse["metadata_bytes"]
    return hbm / (bw["hbm_copy_gb_per_s"] * 1e6) + sparse["miss_bytes_per_step"] / (bw["pcie_h2d_gb_per_s"] * 1e6)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = pick_device(args.dry_run)
    prepare_triton(device)
    apply_knobs(args.knob)  # after prepare_triton: the interpreter switch comes before the kernel module
    shape, dtype = "llama3-8b", torch.bfloat16
    block_size = 32
    if args.dry_run:
        shape, dtype, block_size = "tiny", torch.float32, 16
        args.batch, args.context, args.budget, args.hbm_cache_gib = 2, 200, 64, 1 / 1024
        args.warmup, args.steps, args.breakdown_steps, args.dense_steps = 2, 3, 2, 2
        args.equal_context, args.equal_steps = 200, 12  # a tail-block save at step 8
    if device.type != "cuda":
        dtype = torch.float32  # CPU: no bf16 matmuls worth timing; the Triton interpreter mis-handles bf16
    dense_kv = dense_kv_bytes(args, shape, dtype)
    hbm_cache = int(args.hbm_cache_gib * GIB) if args.hbm_cache_gib else int(args.hbm_cache_fraction * dense_kv)
    config = SparseServeConfig(
        block_size=block_size, token_budget=args.budget, hbm_cache_bytes=hbm_cache,
        dram_bytes=dram_bytes(args, block_size, shape, dtype), backend="auto", max_batch=args.batch,
    )  # fmt: skip
    config = replace(config, **config_overrides(args.overrides))
    stored = kv_storage_dtype(config.kv_dtype, dtype)  # 8-bit blocks need half the pool
    config = replace(config, dram_bytes=dram_bytes(args, config.block_size, shape, stored))
    _check_ram(config.dram_bytes)
    if args.stock_only:  # the child of `measure_dense_expandable`: its result is its last stdout line
        dense, windows = measure_dense(args, device, dtype, shape)
        result = {"stock_dynamic_ms": dense, "stock_dynamic_windows_ms": windows}
        print(json.dumps(result))
        return result
    bw = bandwidths(device)
    free_memory(device)
    dense, windows, dense_error = (None, None, None) if args.skip_dense else dense_or_why(args, device, dtype, shape)
    expandable = measure_dense_expandable(argv) if args.stock_expandable and dense is not None else None
    static = None if args.skip_dense or args.skip_static else measure_static(args, device, dtype, shape)
    stock = [ms for ms in (dense, expandable, static) if ms is not None]
    stock_best = min(stock) if stock else None
    sparse = measure_sparse(args, device, dtype, shape, config)
    blocks = {name: ratios(sparse[name], bw, stock_best, args.graph) for name in localities(args)}
    equality = graph_equality(args, device, dtype, shape, config) if args.graph else None
    free_memory(device)
    result = {
        **run_record(device),
        "stock_dynamic_ms": dense,
        "stock_dynamic_windows_ms": windows,
        "stock_dynamic_error": dense_error,
        "stock_dynamic_expandable_ms": expandable,
        "stock_static_ms": static,
        "stock_best_ms": stock_best,
        "shape": shape,
        "dtype": str(dtype),
        "workload": {k: v for k, v in vars(args).items() if k != "out"} | {"block_size": block_size},
        "dense_kv_bytes": dense_kv,
        "kv_setup": "random K/V written straight into every cache (DynamicCache.update / StaticCache.update per "
        "layer; TieredBlockStore.save of random head-blocks + block tables for SparseServeCache), no prefill; "
        "random start token, then the model's greedy tokens. random_kv: the model's own selection over random "
        "keys; real_locality: scoring and top-k run, the blocks loaded follow the recorded trace (TraceReplay)",
        "config": config.to_dict(),
        **bw,
        **{k: v for k, v in sparse.items() if k not in blocks},
        **blocks,
        "graph_equality": equality,
    }
    columns = ["sparse_ms", "graph_ms", "floor_ms", "graph_step_over_floor", "speedup_vs_best_stock", "hit_rate"]
    columns += ["overlap_1step", "overlap_union12", "bookkeeping_us_per_layer", "before_attention_us_per_layer"]
    columns += ["metadata_read_us_per_layer"]
    print(f"stock: dynamic {dense} ms (windows {windows}), expandable segments {expandable} ms, static {static} ms")
    print(f"best stock {stock_best} ms")
    for name, block in blocks.items():
        print(name)
        print_table([block], [c for c in columns if c in block])
        print_table([block["breakdown_ms"]], list(block["breakdown_ms"]))
    if equality is not None:
        print(f"graph_equality={equality}")
    write_json(args.out, result)
    return result


def ratios(block: dict[str, Any], bw: dict[str, float], stock_best: float | None, graph: bool) -> dict[str, Any]:
    """A locality block with its floor and the ratios the target names."""
    floor = floor_ms(block, bw)
    step = block["graph_ms"] if graph else block["sparse_ms"]
    metadata_us = block["metadata_bytes_per_layer"] / (bw["hbm_copy_gb_per_s"] * 1e3)
    out = block | {
        "floor_ms": floor,
        "step_over_floor": block["sparse_ms"] / floor,
        "metadata_read_us_per_layer": metadata_us,
        "bookkeeping_target_us_per_layer": 1.3 * metadata_us + 15,
        "speedup_vs_best_stock": stock_best / step if stock_best else None,
    }
    if graph:
        out["graph_step_over_floor"] = block["graph_ms"] / floor
    return out


def localities(args) -> list[str]:
    """The locality blocks this run measures, in order."""
    return {"random": ["random_kv"], "real": ["real_locality"], "both": ["random_kv", "real_locality"]}[args.locality]


def dense_kv_bytes(args, shape: str, dtype: torch.dtype) -> int:
    """Bytes of the dense KV of the batch at the run's context (what stock holds on the device)."""
    dims = SHAPES[shape]
    per_token = 2 * dims["num_hidden_layers"] * dims["num_key_value_heads"] * dims["head_dim"] * dtype.itemsize
    return args.batch * args.context * per_token


def dram_bytes(args, block_size: int, shape: str, dtype: torch.dtype) -> int:
    """The host pool for every block the run saves, rounded up to a power of two (what pinning costs)."""
    dims = SHAPES[shape]
    tokens = args.context + decode_steps(args) + 2
    blocks = dims["num_hidden_layers"] * args.batch * dims["num_key_value_heads"] * (tokens // block_size + 1)
    need = blocks * 2 * block_size * dims["head_dim"] * dtype.itemsize
    return 1 << (need - 1).bit_length()


def decode_steps(args) -> int:
    """Tokens each row decodes in the main run (the DRAM pool and the tables are sized for them)."""
    graph = GRAPH_WARMUP + args.steps if args.graph else 0
    per_locality = args.warmup + UNION_WINDOW + 2 + args.steps + args.breakdown_steps + graph
    return per_locality * len(localities(args))


def _check_ram(pool_bytes: int) -> None:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if pool_bytes > 0.8 * ram:
        raise SystemExit(
            f"the DRAM pool would be {pool_bytes / GIB:.0f} GiB of {ram / GIB:.0f} GiB RAM: lower --context/--batch"
        )


if __name__ == "__main__":
    main()
