"""Which block selector finds the needles? Dense vs SparseServeCache variants on the default real model.

Runs needle-in-a-haystack prompts built from real essays (sparseserve_hf.data.haystack) at several
lengths and depths, answers each with dense attention and with every (selection, metadata,
budget) variant, and writes a JSON with every answer plus a markdown table of needles found.

    python -m eval.accuracy.needle_selection --out eval/results/needle_selection   # GPU: ~minutes; CPU: slow
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eval.common import Method, answer
from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.data.haystack import build_needle_prompt, encode_prompt, needle_found
from sparseserve_hf.data.models import load_default

VARIANTS = {  # name -> SparseServeConfig overrides (token_budget comes from --budgets)
    "query_head": dict(selection="query_head"),
    "group_union": dict(selection="group_union"),
    "group_union_fp8_kv": dict(selection="group_union", kv_dtype="float8_e4m3fn"),
    "kv_head_max": dict(selection="kv_head", group_aggregation="max"),
    "kv_head_sum": dict(selection="kv_head", group_aggregation="sum"),
    "channels": dict(metadata="channels", selection="kv_head", group_aggregation="sum"),
    "query_head_cuboid": dict(selection="query_head", metadata="cuboid"),
    "query_head_window4": dict(selection="query_head", window_blocks=4),
    "query_head_sink4_window4": dict(selection="query_head", sink_blocks=4, window_blocks=4),
    "query_head_dense2": dict(selection="query_head", dense_layers=(0, 1)),
    "query_head_block16": dict(selection="query_head", block_size=16),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="6144,7800")
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--seeds", type=int, default=2, help="needles per (length, depth)")
    parser.add_argument("--budgets", default="512,1024,2048")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {list(VARIANTS)}")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", default="eval/results/needle_selection")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tokenizer = load_default(dtype=dtype, device=device)
    grid = [
        (int(n), float(d), s)
        for n in args.lengths.split(",")
        for d in args.depths.split(",")
        for s in range(args.seeds)
    ]
    samples = [build_needle_prompt(tokenizer, n, d, seed=1000 * s + i) for i, (n, d, s) in enumerate(grid)]
    variants = [("dense", None, None)] + [
        (f"{name}/{budget}", name, int(budget))
        for budget in args.budgets.split(",")
        for name in args.variants.split(",")
    ]
    rows, start = [], time.time()
    for index, sample in enumerate(tqdm(samples, desc="needles")):
        input_ids = encode_prompt(tokenizer, sample)["input_ids"]  # one tokenization for every variant
        for name, variant, budget in variants:
            config = cache = None
            if variant is not None:
                config = SparseServeConfig(token_budget=budget, **VARIANTS[variant])
                cache = SparseServeCache(model.config, config)
            text = answer(model, tokenizer, input_ids, Method(name, config), args.max_new_tokens, cache)
            rows.append(
                dict(
                    sample=index,
                    context_tokens=sample.context_tokens,
                    depth=sample.depth,
                    variant=name,
                    found=needle_found(text, sample),
                    answer=text,
                    hit_rate=cache.stats()["hit_rate"] if cache else None,
                    loaded_fraction=cache.stats()["loaded_fraction"] if cache else None,
                )
            )
        # Written after every sample, so a run cut short still leaves its results.
        write_results(Path(args.out), rows, variants, samples[: index + 1], time.time() - start, device, dtype)


def write_results(out: Path, rows, variants, samples, seconds, device, dtype) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    found = {name: sum(r["found"] for r in rows if r["variant"] == name) for name, *_ in variants}
    dense_found = {r["sample"] for r in rows if r["variant"] == "dense" and r["found"]}
    kept = {
        name: sum(r["found"] for r in rows if r["variant"] == name and r["sample"] in dense_found)
        for name, *_ in variants
    }
    meta = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        dtype=str(dtype),
        torch=torch.__version__,
        samples=len(samples),
        seconds=round(seconds, 1),
    )
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, found=found, kept=kept, rows=rows), indent=1))
    lines = [
        f"Needles found of {len(samples)} ({meta['device']}, {meta['dtype']}, {meta['seconds']} s)",
        "",
        "| variant | found | of dense's | loaded (of the context, per KV head) |",
        "|---|---|---|---|",
    ] + [
        f"| {name} | {count} | {kept[name]}/{len(dense_found)} | {_mean_loaded(rows, name)} |"
        for name, count in found.items()
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _mean_loaded(rows: list[dict], variant: str) -> str:
    loads = [r["loaded_fraction"] for r in rows if r["variant"] == variant and r.get("loaded_fraction") is not None]
    return f"{sum(loads) / len(loads):.4f}" if loads else "all"


if __name__ == "__main__":
    main()
