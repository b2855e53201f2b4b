"""The drop-in: `model.generate(past_key_values=SparseServeCache(...))` against stock `generate`.

    python -m eval.bench.dropin --out eval/results/dropin.json                  # H200: ~6 min
    python -m eval.bench.dropin --points 32k --first-call --out ...            # + the first-call overhead
    python -m eval.bench.dropin --dry-run                                      # tiny shapes on CPU

Llama-3-8B shape, random bf16 weights, greedy, at two points: B=4 x 32K and B=2 x 128K. Each cache
is filled with random KV as in `decode_step` (no prefill), and the prompt is one token longer than
what it holds, so `generate` runs only decode steps. Decode ms/step goes through the user's entry
point, `generate`'s own per-step work included: (time of `generate` with N + 1 new tokens - time
with 1) / N, after a warm-up call of the same shapes; between calls the cache is cropped back.

Systems, one after another in the same process: stock (`attn_implementation="sdpa"`,
`DynamicCache`, also in a child process under `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`;
`--static` adds its `StaticCache`, compiled; best stock is the fastest); ours
with `SparseServeConfig()` and an HBM cache of 25% of the dense KV, three ways: `whole_step` (the
README's `SparseServeCache(model, ...)`: each decode step of the whole model replayed as one CUDA
graph), `layer_graphs` (a cache built from `model.config`: each sparse layer's attention replayed,
the rest of the model eager) and `launched` (from the config, `layer_graphs=False`: op by op). Ours runs at
real locality (blocks loaded follow the recorded selection trace) and with random KV (the random
model's own selections) in blocks `real_locality` and `random_kv`. Each system's ms/step is the
fastest of `--windows` timed pairs of calls. Peak HBM is `torch.cuda.max_memory_allocated` over
each system's timed calls.

`--first-call`: a fresh process runs one real 32K prefill + 64 new tokens through a new
SparseServeCache twice; the first call's time minus the second's is the first-call overhead
(kernel loading, pinning, allocator growth). Run twice with one fresh Triton cache directory: the
first process compiles into it (`first_call_overhead_s_32k_empty_triton_cache`), the second
finds its kernels on disk, as every process after a user's first does
(`first_call_overhead_s_32k`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any

import torch
from transformers import StaticCache

from eval.bench.common import (
    EXPANDABLE_SEGMENTS,
    add_config_overrides,
    bench_setup,
    config_overrides,
    free_memory,
    json_child,
    peak_gib,
    print_table,
    reset_peak,
    run_record,
    timed_generate,
    write_json,
)
from eval.bench.decode_step_setup import build_model, dense_cache, sparse_cache
from eval.bench.selection_trace import RECORDED_TRACE, SelectionTrace, TraceReplay
from sparseserve_hf import SparseServeCache, SparseServeConfig

GIB = 1 << 30
POINTS = {"32k": (4, 32576), "128k": (2, 130944), "256k": (1, 262016)}  # name -> (batch, context); the tail keeps room
DRY_POINTS = {"32k": (2, 200), "128k": (1, 400), "256k": (1, 600)}
LOCALITIES = {"real_locality": "real", "random_kv": "random"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default="32k,128k", help=f"comma-separated, of {sorted(POINTS)}")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps timed per call")
    parser.add_argument("--hbm-cache-fraction", type=float, default=0.25, help="HBM cache / the batch's dense KV")
    parser.add_argument("--localities", default="real_locality,random_kv")
    parser.add_argument("--trace", default=str(RECORDED_TRACE))
    parser.add_argument("--static", action="store_true", help="also stock's StaticCache (compiled)")
    parser.add_argument("--windows", type=int, default=3, help="timed windows per system; the fastest counts")
    parser.add_argument(
        "--no-stock-expandable",
        dest="stock_expandable",
        action="store_false",
        help="skip stock's DynamicCache under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (a child process)",
    )
    parser.add_argument("--stock-child", default=None, help=argparse.SUPPRESS)  # a point name: its stock row
    add_config_overrides(parser, "kv_dtype=float8_e4m3fn (ours only)")
    parser.add_argument("--first-call", action="store_true", help="measure the first call of a new process")
    parser.add_argument("--first-call-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (tests the script)")
    return parser.parse_args(argv)


# ---- timing through generate ---------------------------------------------------------------------


def generate_seconds(model, cache, prompt: torch.Tensor, new_tokens: int, crop: bool = True) -> float:
    """Wall seconds of one greedy `generate` of exactly `new_tokens` (the cache cropped back after:
    `crop_static` for a StaticCache, which transformers 5.17 cannot crop)."""
    seconds = timed_generate(model, prompt, new_tokens, cache)
    if crop and isinstance(cache, StaticCache):
        crop_static(cache, prompt.shape[1] - 1)
    elif crop:
        cache.crop(-new_tokens)  # back to the context: the next call decodes the same positions
    return seconds


def crop_static(cache, length: int) -> None:
    """Set a StaticCache back to `length` positions: its layers count them in `cumulative_length`
    (transformers 5.17 and later), later updates overwrite the stale ones, the mask hides them."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(length)


def decode_ms_per_step(
    model, cache, prompt: torch.Tensor, new_tokens: int, device: torch.device, windows: int = 1
) -> dict[str, Any]:
    """Warm-up, then (generate(N + 1) - generate(1)) / N in ms, the fastest of `windows` timed pairs
    (every system alike: a stock DynamicCache's per-step concatenations make it move between
    windows), and the peak HBM of the timed calls. generate(1) is the faster of two calls: one
    slow call alone (a busy host) would otherwise make a pair's difference meaningless."""
    warm_s = generate_seconds(model, cache, prompt, new_tokens + 1)
    reset_peak(device)
    steps_ms, full = [], 0.0
    for _ in range(max(windows, 1)):
        one = min(generate_seconds(model, cache, prompt, 1) for _ in range(2))
        full = generate_seconds(model, cache, prompt, new_tokens + 1)
        steps_ms.append((full - one) * 1e3 / new_tokens)
    return {
        "decode_ms_per_step": min(steps_ms),
        "windows_ms": steps_ms,
        "warmup_call_s": warm_s,
        "call_s": full,
        "peak_gib": peak_gib(device),
    }


# ---- the systems -----------------------------------------------------------------------------------


def measure_stock(args, device, dtype, shape: str, batch: int, context: int, prompt) -> dict[str, Any]:
    model = build_model(shape, "sdpa", device, dtype, context + args.new_tokens + 64)
    cache = dense_cache(model, batch, context)
    timing = decode_ms_per_step(model, cache, prompt, args.new_tokens, device, args.windows)
    row = {"system": "stock DynamicCache (sdpa)"} | timing
    del model, cache
    free_memory(device)
    return row


def measure_static(args, device, dtype, shape: str, batch: int, context: int, prompt) -> dict[str, Any] | None:
    """Stock's StaticCache filled with random KV, through `generate` (which compiles for it); None if it fails.

    Compiled code holds the model it was traced from (its guards reference it): the compile caches
    are reset afterwards, or its weights would stay allocated into the next system's peak."""
    try:
        return _static_row(args, device, dtype, shape, batch, context, prompt)
    except Exception as exc:  # noqa: BLE001  a baseline that cannot run is recorded as missing, with why
        print(f"stock static failed: {type(exc).__name__}: {exc}")
        return None
    finally:
        torch._dynamo.reset()
        free_memory(device)


def _static_row(args, device, dtype, shape: str, batch: int, context: int, prompt) -> dict[str, Any]:
    model = build_model(shape, "sdpa", device, dtype, context + args.new_tokens + 64)
    text = model.config
    cache = StaticCache(config=text, max_cache_len=context + args.new_tokens + 8)
    kv_shape = (batch, text.num_key_value_heads, context, text.head_dim)
    positions = {"cache_position": torch.arange(context, device=device)}
    for layer_idx in range(text.num_hidden_layers):
        keys = torch.randn(kv_shape, dtype=dtype, device=device)
        cache.update(keys, torch.randn_like(keys), layer_idx, positions)
    timing = decode_ms_per_step(model, cache, prompt, args.new_tokens, device, args.windows)
    return {"system": "stock StaticCache (compiled)"} | timing


SYSTEMS = {
    "whole_step": (True, True),
    "layer_graphs": (False, True),
    "launched": (False, False),
}  # (from_model, layer_graphs)


def measure_ours(args, device, dtype, shape, batch, context, prompt, locality: str, system: str) -> dict:
    # What earlier systems left allocated counts in this one's peak: recorded, and ~0 when they freed it all.
    left_gib = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    model = build_model(shape, "sparseserve", device, dtype, context + args.new_tokens + 64)
    from_model, layer_graphs = SYSTEMS[system]
    config = ours_config(model.config, dtype, batch, context, args, layer_graphs)
    start = time.perf_counter()
    spare = args.new_tokens // config.block_size + 4
    cache = sparse_cache(model, config, batch, context, spare_blocks=spare, from_model=from_model)
    fill_s = time.perf_counter() - start
    if locality == "real":
        trace = SelectionTrace.load(args.trace)
        text = model.config
        cache.store.selection_override = TraceReplay(trace, text.num_hidden_layers, text.num_key_value_heads, device)
    row = {"system": f"ours, {system}"} | decode_ms_per_step(
        model, cache, prompt, args.new_tokens, device, args.windows
    )
    stats = cache.stats()
    graphs, route = cache.store.layer_graphs, cache.generate_graphs
    row |= {
        "fill_s": fill_s,
        "allocated_before_gib": left_gib,
        "hit_rate": stats["hit_rate"],
        "loaded_fraction": stats["loaded_fraction"],
        "loaded_tokens_per_kv_head": stats["loaded_tokens_per_kv_head"],
        "metadata_bytes_read_per_step": stats["metadata_bytes_read_per_step"],
        "piece_captures": None if graphs is None else graphs.num_captures,
        "step_captures": None if route is None else route.decoder.num_captures,
        "routed_steps": None if route is None else route.steps,
        "config": asdict(config),
    }
    del model, cache, graphs, route  # the pools go now, not when this function returns
    free_memory(device)
    print(f"{row['system']} ({locality}): {row['decode_ms_per_step']:.2f} ms/step", flush=True)
    return row


def ours_config(text, dtype, batch: int, context: int, args, layer_graphs: bool) -> SparseServeConfig:
    """`SparseServeConfig()` with an HBM cache of `--hbm-cache-fraction` of the batch's dense KV and
    a DRAM pool sized for the context and the new tokens (pinned once, before the clock)."""
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * dtype.itemsize
    dense_kv = per_token * batch * context
    config = SparseServeConfig(
        hbm_cache_bytes=max(int(dense_kv * args.hbm_cache_fraction), 1 << 20),
        dram_bytes=per_token * batch * (context + args.new_tokens + 64 * 2) + (1 << 26),
        max_batch=batch,
        layer_graphs=layer_graphs,
        **({"block_size": 16, "token_budget": 64} if args.dry_run else {}),
    )
    return replace(config, **config_overrides(args.overrides))


def stock_expandable(args, name: str) -> dict[str, Any] | None:
    """Stock's DynamicCache row in a child process under expandable segments; None when it fails."""
    child = ["--stock-child", name, "--windows", str(args.windows), "--new-tokens", str(args.new_tokens)]
    row = json_child("eval.bench.dropin", child + (["--dry-run"] if args.dry_run else []), EXPANDABLE_SEGMENTS)
    return None if row is None else row | {"system": "stock DynamicCache (sdpa), expandable segments"}


def measure_point(args, device, dtype, shape: str, name: str, batch: int, context: int) -> dict[str, Any]:
    vocab = 256 if args.dry_run else 128256
    prompt = torch.randint(1, vocab, (batch, context + 1), device=device)
    stock = measure_stock(args, device, dtype, shape, batch, context, prompt)
    expandable = stock_expandable(args, name) if args.stock_expandable else None
    static = measure_static(args, device, dtype, shape, batch, context, prompt) if args.static else None
    stocks = [row for row in (stock, expandable, static) if row is not None]
    best = min(stocks, key=lambda row: row["decode_ms_per_step"])
    point = {"batch": batch, "context": context, "stock": stock, "stock_expandable": expandable}
    point |= {"stock_static": static, "stock_best": best}
    for block in args.localities.split(","):
        rows = {
            system: measure_ours(args, device, dtype, shape, batch, context, prompt, LOCALITIES[block], system)
            for system in SYSTEMS
        }
        for row in rows.values():
            row["vs_best_stock"] = row["decode_ms_per_step"] / best["decode_ms_per_step"]
            row["peak_vs_stock"] = None if stock["peak_gib"] is None else row["peak_gib"] / stock["peak_gib"]
        point[block] = rows
    return point


# ---- the first call of a new process -------------------------------------------------------------------


def first_call_child(args, device, dtype, shape: str) -> dict[str, float]:
    """In a fresh process: two real prefill + decode calls through new caches; their times."""
    batch, context = (DRY_POINTS if args.dry_run else POINTS)["32k"]
    model = build_model(shape, "sparseserve", device, dtype, context + args.new_tokens + 64)
    config = ours_config(model.config, dtype, batch, context, args, layer_graphs=True)
    prompt = torch.randint(1, model.config.vocab_size, (batch, context), device=device)
    calls = []
    for _ in range(2):
        cache = SparseServeCache(model, config)  # the README's drop-in: decode steps replayed whole
        calls.append(generate_seconds(model, cache, prompt, args.new_tokens, crop=False))
        del cache
    return {"first_call_s": calls[0], "warm_call_s": calls[1], "overhead_s": calls[0] - calls[1]}


def first_call(args) -> dict[str, Any]:
    """Two fresh processes over one new Triton cache directory: empty, then filled by the first."""
    out = {}
    with tempfile.TemporaryDirectory() as triton_cache:
        for name in ("empty_triton_cache", "warm_triton_cache"):
            child = ["--first-call-child", "--new-tokens", str(args.new_tokens)]
            child += (["--dry-run"] if args.dry_run else []) + [a for s in args.overrides for a in ("--set", s)]
            out[name] = json_child("eval.bench.dropin", child, {"TRITON_CACHE_DIR": triton_cache}, check=True)
    return out


# ---- main ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, shape, dtype = bench_setup(args.dry_run)
    if args.dry_run:
        args.new_tokens = 8  # enough decode steps that (N + 1) - 1 stays well above timing noise
    if args.first_call_child:
        print(json.dumps(first_call_child(args, device, dtype, shape)))
        return {}
    points = DRY_POINTS if args.dry_run else POINTS
    if args.stock_child:
        batch, context = points[args.stock_child]
        prompt = torch.randint(1, 256 if args.dry_run else 128256, (batch, context + 1), device=device)
        print(json.dumps(measure_stock(args, device, dtype, shape, batch, context, prompt)))
        return {}
    result = run_record(device) | {"workload": vars(args), "shape": shape, "dtype": str(dtype), "points": {}}
    for name in args.points.split(","):
        result["points"][name] = measure_point(args, device, dtype, shape, name, *points[name])
    result |= headline(result["points"])
    if args.first_call:
        calls = result["first_call"] = first_call(args)
        result["first_call_overhead_s_32k"] = calls["warm_triton_cache"]["overhead_s"]
        result["first_call_overhead_s_32k_empty_triton_cache"] = calls["empty_triton_cache"]["overhead_s"]
    for name, point in result["points"].items():
        stocks = [point[k] for k in ("stock", "stock_expandable", "stock_static") if point.get(k) is not None]
        rows = stocks + [point[b][k] for b in LOCALITIES if b in point for k in SYSTEMS]
        print(f"{name}: B={point['batch']} x {point['context']}")
        columns = ["system", "decode_ms_per_step", "vs_best_stock", "peak_gib", "hit_rate", "step_captures"]
        print_table(rows, columns + ["piece_captures"])
    write_json(args.out, result)
    return result


def headline(points: dict[str, Any]) -> dict[str, Any]:
    """The target keys: stock ms, ours over best stock at real locality (`whole_step`, the README's
    drop-in; `_layer_graphs` and `_launched` beside it), peak HBM against stock."""
    out: dict[str, Any] = {}
    for name, point in points.items():
        real = point.get("real_locality")
        out[f"stock_{name}_ms"] = point["stock_best"]["decode_ms_per_step"]
        out[f"stock_{name}_peak_gib"] = point["stock"]["peak_gib"]
        if real is not None:
            out[f"decode_ms_{name}"] = real["whole_step"]["decode_ms_per_step"]
            out[f"decode_vs_stock_{name}"] = real["whole_step"]["vs_best_stock"]
            out[f"decode_vs_stock_{name}_layer_graphs"] = real["layer_graphs"]["vs_best_stock"]
            out[f"decode_vs_stock_{name}_launched"] = real["launched"]["vs_best_stock"]
            out[f"peak_hbm_vs_stock_{name}"] = real["whole_step"]["peak_vs_stock"]
    return out


if __name__ == "__main__":
    main()
