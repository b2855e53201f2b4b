"""The HBM block cache's hit rate in steady decode when it holds twice a request's working set.

    python -m eval.working_set_hits --length 8192 --budgets 2048,512 --steps 96 \
        --out eval/results/working_set_hits.json

For each budget, one RULER needle prompt on a real model through the `Generator` (batch 1, greedy,
EOS ignored so every run decodes `--steps` tokens):
1. with an unlimited HBM cache, the request's working set (the union of the blocks it selected over
   the last `working_set_window` decode steps, in head-block bytes, as admission counts it) at every
   decode step, and its peak once the window has filled;
2. with `hbm_cache_bytes` = twice that peak (or the least the cache accepts for one request, where
   that is more: recorded as `cache_floor_bound`), the hit rate of the lookups made after the
   window's first fill: steady decode.
The tokens of both runs are recorded too: an HBM cache changes where blocks are read from, never
what is attended, so they must be equal.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch


def run(model, tokenizer, ids: list[int], config, steps: int) -> dict:
    """Decode `steps` tokens of one request; its working set per step and the steady hit rate."""
    from sparseserve_hf import Generator, SamplingParams

    gen = Generator(model, tokenizer, config)
    request = gen.submit(ids, SamplingParams(max_new_tokens=steps, ignore_eos=True))
    working_sets, tokens, steady_from = [], [], None
    while gen.has_unfinished:
        for event in gen.step():
            if event.token_id is None:
                continue
            tokens.append(event.token_id)
            working_sets.append(gen.metrics()["requests"][request]["working_set_bytes"])
            if len(tokens) == config.working_set_window + 1:  # the window has filled: steady decode from here
                stats = gen.store.read_stats()
                steady_from = (stats.hits, stats.misses)
    stats = gen.store.read_stats()
    hits, misses = stats.hits - steady_from[0], stats.misses - steady_from[1]
    return {
        "tokens": tokens,
        "working_set_bytes": working_sets,
        "steady_hits": hits,
        "steady_misses": misses,
        "steady_hit_rate": hits / (hits + misses) if hits + misses else None,
        "block_bytes": gen.store.block_bytes,
    }


def least_cache_bytes(model, config) -> int:
    """The smallest `hbm_cache_bytes` a cache accepts for one request: every (sparse layer, KV head)
    partition holds one layer's selection of its KV head."""
    from sparseserve_hf.cache.cache import hbm_partitions, selected_blocks_per_kv_head

    text = model.config.get_text_config()
    block_bytes = 2 * config.block_size * text.head_dim * model.dtype.itemsize
    return selected_blocks_per_kv_head(text, config) * hbm_partitions(text, config) * block_bytes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "gemma3-270m"))
    parser.add_argument("--task", default="niah_single_2", help="the RULER task of the prompt")
    parser.add_argument("--length", type=int, default=8192, help="prompt tokens")
    parser.add_argument("--budgets", default="2048,512", help="token budgets (the first is the default's)")
    parser.add_argument("--steps", type=int, default=96, help="decode steps per run")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    from eval.accuracy.ruler import generate_sample
    from sparseserve_hf import SparseServeConfig
    from sparseserve_hf.data.models import load_model

    window = SparseServeConfig().working_set_window
    if args.steps <= window:
        raise ValueError(f"--steps must exceed the working-set window ({window}), got {args.steps}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.model, attn_implementation="sparseserve", device=device)
    sample = generate_sample(args.task, tokenizer, args.length, 0, args.seed)
    ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    start, rows = time.time(), []
    for budget in [int(b) for b in args.budgets.split(",")]:
        config = SparseServeConfig(token_budget=budget)
        unlimited = run(model, tokenizer, ids, config, args.steps)
        peak = max(unlimited["working_set_bytes"][config.working_set_window :])
        floor = least_cache_bytes(model, config)
        capped_config = replace(config, hbm_cache_bytes=max(2 * peak, floor))
        capped = run(model, tokenizer, ids, capped_config, args.steps)
        row = {
            "budget": budget,
            "working_set_peak_bytes": peak,
            "working_set_peak_blocks": peak // unlimited["block_bytes"],
            "hbm_cache_bytes": capped_config.hbm_cache_bytes,
            "cache_floor_bound": floor > 2 * peak,
            "steady_hit_rate": capped["steady_hit_rate"],
            "steady_lookups": capped["steady_hits"] + capped["steady_misses"],
            "unlimited_steady_hit_rate": unlimited["steady_hit_rate"],
            "tokens_equal": capped["tokens"] == unlimited["tokens"],
            "config": asdict(capped_config),
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "config"}))
    result = {
        "command": "python -m eval.working_set_hits " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model,
        "task": args.task,
        "prompt_tokens": len(ids),
        "steps": args.steps,
        "device": f"{device} ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "seconds": round(time.time() - start, 1),
        "target": "steady_hit_rate >= 0.95 with hbm_cache_bytes = 2 x the 12-step working set",
        "runs": rows,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
