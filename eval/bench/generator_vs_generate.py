"""The `Generator` against stock `model.generate`: closed loop, under an HBM cap, and prefill (GPU benchmark).

    python -m eval.bench.generator_vs_generate --points closed_loop --out eval/results/generator_vs_generate.json
    python -m eval.bench.generator_vs_generate --points capacity --localities real_locality --out ...
    python -m eval.bench.generator_vs_generate --points prefill --out ...
    python -m eval.bench.generator_vs_generate --points prefill256k --localities real_locality --out ...
    python -m eval.bench.generator_vs_generate --points closed_loop --variant load2x:load_budget=4096 ...
    python -m eval.bench.generator_vs_generate --dry-run                      # tiny shapes on CPU

Llama-3-8B shape, random bf16 weights, seeded random-token prompts, the same requests for every
system, EOS ignored (every system generates every token), greedy. Points:
- closed_loop: 16 requests x 16K tokens x 1024 new. Stock: `generate` over all of them as one
  batch (DynamicCache, sdpa). Ours: the requests submitted at once to a `Generator`.
- capacity: 16 x 32K x 1024 new with every process's CUDA allocations capped (40 GiB): stock
  runs the largest batch that fits (tried from 16 down, on CUDA with and without the allocator's
  expandable segments; `capacity_stock_batch`) over the requests
  in turn, its times summed; ours serves all 16 with the DRAM pool in host memory and an HBM
  block cache of what the cap leaves after the weights, the block metadata (on the device, one
  entry per DRAM pool block) and a headroom.
- prefill: one 32K prompt. Stock: `generate(max_new_tokens=1)`; ours: submit to an idle
  `Generator` until its first token (its TTFT). prefill256k: the same with one 256K prompt.
Every system first runs one full call of the point's shapes (16 new tokens, or 1 for prefill)
outside the clock. Ours is `SparseServeConfig(cuda_graphs=True)` with an HBM cache of
`--hbm-cache-fraction` of the dense KV (closed loop, prefill), at real locality (the recorded
selection trace drives the loads, `TraceReplay`) and with random KV, blocks `real_locality` and
`random_kv`. Tokens/s counts generated tokens over the wall time of the call, prefill included.
`--out` merges the points run into an existing JSON (each point fits one 10-minute GPU call).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eval.bench.common import (
    bench_setup,
    free_memory,
    peak_gib,
    print_table,
    profiled_region,
    reset_peak,
    run_record,
    sync,
    timed_generate,
    write_json,
    write_profile,
)
from eval.bench.decode_step_setup import build_model
from eval.bench.selection_trace import RECORDED_TRACE, SelectionTrace, TraceReplay
from eval.common import parse_variant
from eval.serving.ours import engine_totals_since
from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.generation.sizing import EngineSizes
from sparseserve_hf.ops import reference

GIB = 1 << 30
POINTS = {  # name -> (requests, prompt tokens, new tokens)
    "closed_loop": (16, 16384, 1024),
    "capacity": (16, 32768, 1024),
    "prefill": (1, 32768, 1),
    "prefill256k": (1, 262016, 1),
}
DRY_POINTS = {"closed_loop": (3, 160, 6), "capacity": (3, 160, 6), "prefill": (1, 200, 1), "prefill256k": (1, 400, 1)}
WARM_NEW_TOKENS = 16
LOCALITIES = ("real_locality", "random_kv")
STOCK_BATCHES = (16, 12, 8, 6, 4, 3, 2, 1)  # tried under the cap, largest first


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--points", default="closed_loop,capacity,prefill", help=f"comma-separated, of {sorted(POINTS)}"
    )
    parser.add_argument("--localities", default="real_locality,random_kv")
    parser.add_argument("--hbm-cache-fraction", type=float, default=0.25, help="HBM cache / the requests' dense KV")
    parser.add_argument("--cap-gib", type=float, default=40.0, help="capacity: CUDA allocations of every system")
    parser.add_argument("--headroom-gib", type=float, default=8.0, help="capacity: of the cap, left to activations")
    parser.add_argument("--trace", default=str(RECORDED_TRACE))
    parser.add_argument("--out", default=None, help="JSON path; points already in it are kept")
    parser.add_argument(
        "--profile", default=None, help="markdown path: profile of one more idle-Generator prefill (prefill point)"
    )
    parser.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=[],
        metavar="NAME:FIELD=VALUE[:FIELD=VALUE]",
        help="ours again with these SparseServeConfig fields, beside the default (repeatable; "
        "closed_loop and capacity): block LOCALITY@NAME, e.g. load2x:load_budget=4096",
    )
    parser.add_argument(
        "--skip-stock",
        action="store_true",
        help="closed_loop: ours only (stock's one batch of 16 needs ~76 GiB: more than an 80 GB card holds)",
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (tests the script)")
    args = parser.parse_args(argv)
    args.variants = [parse_variant(text) for text in args.variants]  # ValueError names a bad field
    return args


# ---- stock --------------------------------------------------------------------------------------------


def measure_stock(model, prompts: torch.Tensor, new_tokens: int, batch: int) -> dict[str, Any]:
    """Warm-up call of (batch, T) shapes, then the requests in batches of `batch`, times summed."""
    timed_generate(model, prompts[:batch], min(new_tokens, WARM_NEW_TOKENS))
    reset_peak(prompts.device)
    seconds = sum(timed_generate(model, prompts[i : i + batch], new_tokens) for i in range(0, len(prompts), batch))
    generated = prompts.shape[0] * new_tokens
    print(f"  stock (batch {batch}): {seconds:.2f} s", flush=True)
    return {
        "batch": batch,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
        "peak_gib": peak_gib(prompts.device),
    }


def largest_stock_batch(model, prompts: torch.Tensor) -> tuple[int | None, list[dict[str, Any]]]:
    """The largest batch (of STOCK_BATCHES) whose warm-up call runs under the cap, and what was tried.

    On CUDA each batch is tried with the caching allocator's default segments, then with expandable
    segments (less fragmentation under a cap); the setting that ran stays on for the timed calls."""
    tried = []
    settings = (False, True) if expandable_segments(False, prompts.device) else (False,)
    for batch in [b for b in STOCK_BATCHES if b <= len(prompts)]:
        for expandable in settings:
            expandable_segments(expandable, prompts.device)
            try:
                timed_generate(model, prompts[:batch], WARM_NEW_TOKENS)
            except torch.OutOfMemoryError:
                tried.append({"batch": batch, "expandable_segments": expandable, "runs": False})
                free_memory(prompts.device)
                continue
            tried.append({"batch": batch, "expandable_segments": expandable, "runs": True})
            return batch, tried
    expandable_segments(False, prompts.device)
    return None, tried


def expandable_segments(on: bool, device: torch.device) -> bool:
    """Switch the CUDA caching allocator's expandable segments; False where that cannot be done
    (off CUDA, or a torch without the setting), changing nothing."""
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if device.type != "cuda" or setter is None:
        return False
    free_memory(device)  # cached blocks of the other kind are released first
    setter(f"expandable_segments:{on}")
    return True


# ---- ours ---------------------------------------------------------------------------------------------


def measure_generator(
    model,
    config: SparseServeConfig,
    prompts: torch.Tensor,
    new_tokens: int,
    trace: str | None,
    profile: str | None = None,
) -> dict:
    """A warm-up call of the same shapes, then the requests submitted at once; the timed call's numbers.

    `trace`: the selection trace whose loads the blocks follow (real locality); None = random KV.
    `profile`: a markdown path for the profile of one more call after the timed one (which stays unprofiled)."""
    gen = Generator(model, None, config)
    if trace is not None:
        text = model.config
        replay = TraceReplay(SelectionTrace.load(trace), text.num_hidden_layers, text.num_key_value_heads, model.device)
        gen.store.selection_override = replay
    rows = [row.tolist() for row in prompts]
    warm_outs = gen.generate(rows, SamplingParams(max_new_tokens=min(new_tokens, WARM_NEW_TOKENS), ignore_eos=True))
    warm = gen.metrics()["totals"]
    warm_ids = set(gen.metrics()["requests"])
    reset_peak(prompts.device)
    sync(prompts.device)
    start = time.perf_counter()
    outs = gen.generate(rows, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    sync(prompts.device)
    seconds = time.perf_counter() - start
    metrics = gen.metrics()
    engine = engine_totals_since(metrics["totals"], warm)
    ttft = [r["ttft_s"] for rid, r in metrics["requests"].items() if rid not in warm_ids and r["ttft_s"] is not None]
    generated = sum(len(out.token_ids) for out in outs)
    failed = [out for out in outs if out.finish_reason == "error"]
    errors = sorted({out.error for out in failed})
    keep = ("hit_rate", "mean_decode_batch", "iterations_by_kind", "graph_captures", "hbm_peak_bytes")
    row = {"seconds": seconds, "tokens_per_s": generated / seconds, "generated_tokens": generated,
           "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None, "peak_gib": peak_gib(prompts.device),
           "failed_requests": len(failed), "errors": errors[:3],
           "warm_up_failed_requests": sum(out.finish_reason == "error" for out in warm_outs),
           "config": asdict(config)} | {key: engine.get(key) for key in keep}  # fmt: skip
    print(f"  ours ({'real locality' if trace else 'random KV'}): {seconds:.2f} s, {row['failed_requests']} failed"
          + (f": {errors[0]}" if errors else ""), flush=True)  # fmt: skip
    if profile is not None:
        with profiled_region(True) as profiler:
            gen.generate(rows, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            sync(prompts.device)
        write_profile(profiler, profile, f"{len(rows)} request(s) through an idle Generator, profiled")
    del gen
    free_memory(prompts.device)
    return row


def ours_config(model, requests: int, context: int, args, hbm_cache_bytes: int | None = None) -> SparseServeConfig:
    """`SparseServeConfig(cuda_graphs=True)`; the HBM cache `--hbm-cache-fraction` of the requests'
    dense KV unless given; the DRAM pool sized for every request's tokens (pinned once, before the clock)."""
    text = model.config
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * model.dtype.itemsize
    dense_kv = per_token * requests * context
    return SparseServeConfig(
        cuda_graphs=True,
        hbm_cache_bytes=hbm_cache_bytes or max(int(dense_kv * args.hbm_cache_fraction), 1 << 20),
        dram_bytes=per_token * requests * (context + 2048) + (1 << 26),
        max_batch=requests,
        **({"block_size": 16, "token_budget": 64} if args.dry_run else {}),
    )


def metadata_pool_bytes(config: SparseServeConfig, model) -> int:
    """Device bytes of the block metadata: one entry per DRAM pool block, allocated with the pool."""
    sizes = EngineSizes(model.config, config, model.dtype)
    meta_dtype = reference.metadata_dtype(config.metadata_dtype, model.dtype, model.device)
    return config.dram_bytes // sizes.block_bytes * config.metadata_vectors * sizes.head_dim * meta_dtype.itemsize


# ---- the points -----------------------------------------------------------------------------------------


def closed_loop(args, device, dtype, shape, requests: int, context: int, new_tokens: int) -> dict[str, Any]:
    prompts = random_prompts(shape, requests, context, device)
    point: dict[str, Any] = {"stock": None}
    if not args.skip_stock:
        stock_model = build_model(shape, "sdpa", device, dtype, context + new_tokens + 64)
        point["stock"] = measure_stock(stock_model, prompts, new_tokens, requests)
        del stock_model
        free_memory(device)
    model = build_model(shape, "sparseserve", device, dtype, context + new_tokens + 64)
    config = ours_config(model, requests, context, args)
    _measure_ours(point, args, model, config, prompts, new_tokens)
    return point


def _measure_ours(point: dict[str, Any], args, model, config: SparseServeConfig, prompts, new_tokens: int) -> None:
    """Ours at each locality (block LOCALITY), then each `--variant` (block LOCALITY@NAME), against the point's stock."""
    runs = [("", config)] + [(f"@{name}", dataclasses.replace(config, **fields)) for name, fields in args.variants]
    for suffix, run_config in runs:
        for locality in _localities(args):
            block = locality + suffix
            point[block] = measure_generator(model, run_config, prompts, new_tokens, _trace(args, locality))
            point[block]["over_stock"] = _over_stock(point[block], point["stock"])


def capacity(args, device, dtype, shape, requests: int, context: int, new_tokens: int) -> dict[str, Any]:
    """Both systems under `--cap-gib` (each its own model; the cap holds for the whole process)."""
    cap = int(args.cap_gib * GIB)
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, cap / torch.cuda.get_device_properties(device).total_memory)
        )
    prompts = random_prompts(shape, requests, context, device)
    stock_model = build_model(shape, "sdpa", device, dtype, context + new_tokens + 64)
    batch, tried = largest_stock_batch(stock_model, prompts)
    point: dict[str, Any] = {"cap_bytes": cap, "stock_batches_tried": tried}
    point["stock"] = None if batch is None else measure_stock(stock_model, prompts, new_tokens, batch)
    if point["stock"] is not None:
        point["stock"]["expandable_segments"] = tried[-1]["expandable_segments"]
    expandable_segments(False, device)  # ours runs under the default allocator
    del stock_model
    free_memory(device)
    model = build_model(shape, "sparseserve", device, dtype, context + new_tokens + 64)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    metadata = metadata_pool_bytes(ours_config(model, requests, context, args), model)
    room = cap - weights - metadata - int(args.headroom_gib * GIB)
    config = ours_config(model, requests, context, args, hbm_cache_bytes=max(room, 1 << 20))
    point |= {"weight_bytes": weights, "metadata_bytes": metadata, "hbm_cache_bytes": config.hbm_cache_bytes}
    _measure_ours(point, args, model, config, prompts, new_tokens)
    return point


def prefill(args, device, dtype, shape, requests: int, context: int, new_tokens: int) -> dict[str, Any]:
    """TTFT of one prompt: stock's `generate(max_new_tokens=1)` against an idle, warmed Generator's."""
    prompts = random_prompts(shape, 1, context, device)
    stock_model = build_model(shape, "sdpa", device, dtype, context + 64)
    timed_generate(stock_model, prompts, 1)  # the warm-up call
    reset_peak(prompts.device)
    point: dict[str, Any] = {"stock": {"seconds": timed_generate(stock_model, prompts, 1)}}
    point["stock"]["peak_gib"] = peak_gib(prompts.device)
    del stock_model
    free_memory(device)
    model = build_model(shape, "sparseserve", device, dtype, context + 64)
    config = ours_config(model, 1, context, args)
    for number, block in enumerate(_localities(args)):
        profile = args.profile if number == 0 else None
        row = measure_generator(model, config, prompts, 1, _trace(args, block), profile)
        served = row["failed_requests"] == 0 and row["mean_ttft_s"] is not None
        point[block] = row | {"over_stock": row["mean_ttft_s"] / point["stock"]["seconds"] if served else None}
    return point


MEASURES = {"closed_loop": closed_loop, "capacity": capacity, "prefill": prefill, "prefill256k": prefill}


def headline(points: dict[str, Any]) -> dict[str, Any]:
    """The target keys, at real locality (random KV beside it in the blocks)."""
    out: dict[str, Any] = {}
    loop, cap = points.get("closed_loop"), points.get("capacity")
    if loop is not None:
        out["stock_s"] = None if loop["stock"] is None else loop["stock"]["seconds"]
        out["generator_over_stock"] = loop.get("real_locality", {}).get("over_stock")
    if cap is not None:
        out["capacity_stock_batch"] = None if cap["stock"] is None else cap["stock"]["batch"]
        out["capacity_generator_over_stock"] = cap.get("real_locality", {}).get("over_stock")
    for name in ("prefill", "prefill256k"):
        point = points.get(name)
        if point is not None:
            out[f"{name}_stock_s"] = point["stock"]["seconds"]
            out[f"{name}_ours_s"] = point.get("real_locality", {}).get("mean_ttft_s")
            out[f"{name}_over_stock"] = point.get("real_locality", {}).get("over_stock")
            ours_peak, stock_peak = point.get("real_locality", {}).get("peak_gib"), point["stock"].get("peak_gib")
            out[f"{name}_peak_vs_stock"] = ours_peak / stock_peak if ours_peak and stock_peak else None
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, shape, dtype = bench_setup(args.dry_run)
    sizes = DRY_POINTS if args.dry_run else POINTS
    if args.dry_run:  # a cap of the tiny model's scale (on CPU it only sizes our HBM cache)
        args.cap_gib, args.headroom_gib = 1 / 16, 1 / 64
    result = _existing(args.out)
    result |= run_record(device) | {"shape": shape, "dtype": str(dtype)}
    result.setdefault("points", {})
    for name in args.points.split(","):
        if name not in MEASURES:
            raise SystemExit(f"unknown point {name!r}; of {sorted(MEASURES)}")
        point = MEASURES[name](args, device, dtype, shape, *sizes[name])
        result["points"][name] = point | {
            "workload": dict(zip(("requests", "prompt_tokens", "new_tokens"), sizes[name]))
        }
        result["points"][name]["command_args"] = vars(args)
        result["points"][name]["git_commit"] = result["git_commit"]  # points kept from other runs keep theirs
        rows = [{"system": f"{name}: {key}"} | value for key, value in point.items() if isinstance(value, dict)]
        print_table(rows, ["system", "seconds", "tokens_per_s", "mean_ttft_s", "over_stock", "hit_rate", "peak_gib"])
        result |= headline(result["points"])
        write_json(args.out, result)  # after every point: a call cut short keeps the points it finished
    return result


def _over_stock(ours: dict[str, Any], stock: dict[str, Any] | None) -> float | None:
    """Our tokens/s over stock's; None where stock did not run or a request of ours failed."""
    if stock is None or ours["failed_requests"]:
        return None
    return ours["tokens_per_s"] / stock["tokens_per_s"]


def _trace(args, block: str) -> str | None:
    return args.trace if block == "real_locality" else None


def _existing(path: str | None) -> dict[str, Any]:
    """The JSON of earlier points at `path` (they are kept), else an empty result."""
    if path and Path(path).exists():
        earlier = json.loads(Path(path).read_text())
        if "points" in earlier:  # a result of this script, not of another layout
            return earlier
    return {}


def _localities(args) -> list[str]:
    blocks = args.localities.split(",")
    bad = [b for b in blocks if b not in LOCALITIES]
    if bad:
        raise SystemExit(f"unknown localities {bad}; of {sorted(LOCALITIES)}")
    return blocks


def random_prompts(shape: str, requests: int, context: int, device: torch.device) -> torch.Tensor:
    """(requests, context) seeded random token ids of the shape's vocabulary (the same in every run)."""
    vocab = 256 if shape == "tiny" else 128256
    return torch.randint(1, vocab, (requests, context), generator=torch.Generator().manual_seed(1)).to(device)


if __name__ == "__main__":
    main()
