"""Peak HBM of prefilling one long prompt : dense full-model vs chunked vs layer-segmented.

    python -m eval.bench.prefill_memory --out eval/results/prefill_memory.json   # H200, ~2 min
    python -m eval.bench.prefill_memory --dry-run                                # CPU smoke (no peaks)

Llama-3-8B shape, random bf16 weights, one prompt of `--context` tokens (128K). Each way starts
from the weights alone on the device and records `torch.cuda.max_memory_allocated`:
  - dense: stock `model(ids, logits_to_keep=1)` with a DynamicCache (all layers' KV stay in HBM);
  - chunked / layer_segmented: the `Generator` prefilling the prompt with that `prefill_mode`
    (KV saved to the pinned DRAM pool as each block fills / each layer ends), its HBM block cache
    sized to what that prefill holds on the device (every layer's KV of the prompt / one layer's).
The bound, from the same run: weights + one layer's KV of the prompt + the measured peak of one
decoder-layer forward over the prompt (its activations above its input), + 10%.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import torch
from transformers import DynamicCache

from eval.bench.common import model_shape, pick_device, print_table, run_record, write_json
from eval.bench.decode_step_setup import build_model
from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.compat import cache_kwarg
from sparseserve_hf.generation.sizing import EngineSizes

GIB = 1 << 30
MODES = ("chunked", "layer_segmented")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=2048, help="chunked prefill: tokens per chunk")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on any device (tests the script)")
    return parser.parse_args(argv)


def peak_bytes(device: torch.device, fn) -> tuple[int | None, Any]:
    """Peak device bytes allocated while `fn()` runs (None on CPU) and what it returned."""
    if device.type != "cuda":
        return None, fn()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), out


def dense_prefill(model, ids: torch.Tensor) -> None:
    with torch.no_grad():
        model(ids, logits_to_keep=1, **{cache_kwarg(model): DynamicCache(config=model.config)})


def generator_prefill(model, ids: torch.Tensor, mode: str, chunk: int) -> dict[str, Any]:
    """One request through the Generator until its first token (the prefill, all layers).

    Returns the work it did; raises RuntimeError when the request did not finish normally (a
    refused or failed prefill would otherwise leave only the Generator's construction to measure).
    """
    config = SparseServeConfig(prefill_mode=mode, max_inject_tokens=chunk * model.config.num_hidden_layers, max_batch=1)
    sizes = EngineSizes(model.config, config, model.dtype)
    # Each way gets the HBM block cache its prefill needs (the Generator refuses a prompt whose prefill
    # outgrows the cache) plus the first decode step's working set; the cache is part of the peak.
    cache_bytes = sizes.prefill_bytes(ids.shape[1]) + sizes.one_row_hbm_cache_bytes
    dram_bytes = int(1.1 * sizes.lifetime_dram_blocks(ids.shape[1] + 1) * sizes.block_bytes)
    gen = Generator(model, None, replace(config, hbm_cache_bytes=cache_bytes, dram_bytes=dram_bytes))
    out = gen.generate([ids[0].tolist()], SamplingParams(max_new_tokens=1, ignore_eos=True))[0]
    if out.finish_reason != "length":
        raise RuntimeError(f"{mode} prefill ended with {out.finish_reason!r}: {getattr(out, 'error', None)}")
    totals = gen.metrics()["totals"]
    work = {"iterations": totals["iterations"], "prefill_token_layers": totals["prefill_token_layers"]}
    return work | {"hbm_cache_bytes": cache_bytes}


def layer_forward_extra(model, ids: torch.Tensor, device: torch.device) -> int | None:
    """Bytes one decoder layer's forward over the whole prompt allocates above its input (no cache)."""
    hidden = model.model.embed_tokens(ids)  # (1, T, H)
    positions = torch.arange(ids.shape[1], device=device)[None]
    rotary = model.model.rotary_emb(hidden, positions)
    layer = model.model.layers[0]
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    peak, _ = peak_bytes(
        device, lambda: layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    )
    return peak - base


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = pick_device(args.dry_run)
    shape, dtype = model_shape(args.dry_run)
    if args.dry_run:
        args.context, args.chunk = 300, 64
    ids = torch.randint(1, 200, (1, args.context), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    with torch.no_grad():
        model = build_model(shape, "sdpa", device, dtype, args.context + 2)
        weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        rows.append({"way": "dense", "peak_bytes": peak_bytes(device, lambda: dense_prefill(model, ids))[0]})
        extra = layer_forward_extra(model, ids, device)
        del model
        model = build_model(shape, "sparseserve", device, dtype, args.context + 2)
        for mode in MODES:
            peak, work = peak_bytes(device, lambda mode=mode: generator_prefill(model, ids, mode, args.chunk))
            rows.append({"way": mode, "peak_bytes": peak, **work})
    config = model.config
    layer_kv = 2 * args.context * config.num_key_value_heads * config.head_dim * dtype.itemsize
    bound = None if weights is None else 1.1 * (weights + layer_kv + extra)
    for row in rows:
        row["peak_gib"] = None if row["peak_bytes"] is None else row["peak_bytes"] / GIB
    print_table(rows, ["way", "peak_gib"])
    segmented = next(r["peak_bytes"] for r in rows if r["way"] == "layer_segmented")
    result = {
        **run_record(device), "context": args.context, "chunk": args.chunk, "weights_bytes": weights,
        "layer_kv_bytes": layer_kv, "layer_forward_extra_bytes": extra, "t6_bound_bytes": bound,
        "layer_segmented_over_bound": None if bound is None else segmented / bound, "rows": rows,
    }  # fmt: skip
    print(f"layer_segmented_over_bound={result['layer_segmented_over_bound']}")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
