"""The drop-in: `model.generate(past_key_values=SparseServeCache(...))` against stock `generate`.

    python -m eval.bench.dropin --out eval/results/dropin.json      # H200: ~4 min
    python -m eval.bench.dropin --dry-run                          # tiny shapes on CPU

Llama-3-8B shape, random bf16 weights, B=4 x 32K, greedy. Each cache is filled with random KV as
in `decode_step` (no prefill), and the prompt is one token longer than what it holds, so
`generate` runs only decode steps. Decode ms/step goes through the user's entry point, with
`generate`'s own per-step work: (time of `generate` with N + 1 new tokens - time with 1) / N,
after a warm-up call of the same shapes; between calls the cache is cropped back to the context.

Systems, one after another in the same process: stock (`attn_implementation="sdpa"`,
`DynamicCache`); ours with the default config and an HBM cache of 25% of the dense KV, each
sparse layer's attention replayed as a captured piece (`layer_graphs=True`, the default); ours
with `layer_graphs=False` (every kernel launched from Python). Ours loads the blocks of the
recorded selection trace (real locality; `--locality random` lets the random model select).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eval.bench.common import pick_device, prepare_triton, print_table, run_record, sync, write_json
from eval.bench.decode_step_setup import build_model, dense_cache, sparse_cache
from eval.bench.selection_trace import SelectionTrace, TraceReplay
from sparseserve_hf import SparseServeConfig

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "results" / "selection_trace.npz"
GIB = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=32576)
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps timed per call")
    parser.add_argument("--hbm-cache-fraction", type=float, default=0.25, help="HBM cache / the batch's dense KV")
    parser.add_argument("--locality", choices=("real", "random"), default="real")
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (tests the script)")
    return parser.parse_args(argv)


def generate_seconds(model, cache, prompt: torch.Tensor, new_tokens: int) -> float:
    """Wall seconds of one greedy `generate` of exactly `new_tokens`, the cache cropped back after."""
    sync(prompt.device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            prompt, past_key_values=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
    sync(prompt.device)
    seconds = time.perf_counter() - start
    cache.crop(-new_tokens)  # back to the context: the next call decodes the same positions
    return seconds


def decode_ms_per_step(model, cache, prompt: torch.Tensor, new_tokens: int) -> dict[str, float]:
    """Warm-up, then (generate(N + 1) - generate(1)) / N in ms."""
    generate_seconds(model, cache, prompt, new_tokens + 1)
    one = generate_seconds(model, cache, prompt, 1)
    full = generate_seconds(model, cache, prompt, new_tokens + 1)
    return {"decode_ms_per_step": (full - one) * 1e3 / new_tokens, "first_step_s": one, "call_s": full}


def measure_stock(args, device, dtype, shape: str, prompt: torch.Tensor) -> dict[str, Any]:
    model = build_model(shape, "sdpa", device, dtype, args.context + args.new_tokens + 64)
    cache = dense_cache(model, args.batch, args.context)
    _reset_peak(device)
    row = {"system": "stock DynamicCache (sdpa)"} | decode_ms_per_step(model, cache, prompt, args.new_tokens)
    row["peak_gib"] = _peak_gib(device)
    del model, cache
    _free(device)
    return row


def measure_ours(args, device, dtype, shape: str, prompt: torch.Tensor, layer_graphs: bool) -> dict[str, Any]:
    model = build_model(shape, "sparseserve", device, dtype, args.context + args.new_tokens + 64)
    text = model.config
    dense_kv = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * dtype.itemsize
    dense_kv *= args.batch * args.context
    config = SparseServeConfig(
        hbm_cache_bytes=max(int(dense_kv * args.hbm_cache_fraction), 1 << 20),
        max_batch=args.batch,
        layer_graphs=layer_graphs,
        **({"block_size": 16, "token_budget": 64} if args.dry_run else {}),
    )
    start = time.perf_counter()
    cache = sparse_cache(model, config, args.batch, args.context, spare_blocks=args.new_tokens // config.block_size + 4)
    fill_s = time.perf_counter() - start
    if args.locality == "real":
        trace = SelectionTrace.load(args.trace)
        cache.store.selection_override = TraceReplay(trace, text.num_hidden_layers, text.num_key_value_heads, device)
    _reset_peak(device)
    row = {"system": f"ours, layer_graphs={layer_graphs}"} | decode_ms_per_step(model, cache, prompt, args.new_tokens)
    row["peak_gib"] = _peak_gib(device)
    stats = cache.stats()
    graphs = cache.store.layer_graphs
    row |= {
        "fill_s": fill_s,
        "hit_rate": stats["hit_rate"],
        "loaded_fraction": stats["loaded_fraction"],
        "loaded_tokens_per_kv_head": stats["loaded_tokens_per_kv_head"],
        "metadata_bytes_read_per_step": stats["metadata_bytes_read_per_step"],
        "piece_captures": None if graphs is None else graphs.num_captures,
        "config": asdict(config),
    }
    del model, cache
    _free(device)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = pick_device(args.dry_run)
    prepare_triton(device)
    shape, dtype = ("tiny", torch.float32) if args.dry_run else ("llama3-8b", torch.bfloat16)
    if args.dry_run:
        args.batch, args.context, args.new_tokens = 2, 200, 4
    vocab = 256 if args.dry_run else 128256
    prompt = torch.randint(1, vocab, (args.batch, args.context + 1), device=device)
    rows = [measure_stock(args, device, dtype, shape, prompt)]
    for layer_graphs in (True, False):
        rows.append(measure_ours(args, device, dtype, shape, prompt, layer_graphs))
    stock_ms = rows[0]["decode_ms_per_step"]
    for row in rows:
        row["vs_stock"] = row["decode_ms_per_step"] / stock_ms
    result = run_record(device) | {"workload": vars(args), "shape": shape, "dtype": str(dtype), "rows": rows}
    print_table(rows, ["system", "decode_ms_per_step", "vs_stock", "first_step_s", "peak_gib", "hit_rate", "piece_captures"])
    write_json(args.out, result)
    return result


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
