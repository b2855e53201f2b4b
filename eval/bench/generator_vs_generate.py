"""Generator tokens/s vs stock `model.generate` on the same requests (GPU benchmark; not a test).

Default workload (issue 4): Llama-3-8B shape with random bf16 weights built on the GPU, 16 requests
of 16K random tokens, 128 new tokens each (EOS ignored, so both produce every token).
  - stock: `model.generate` with SDPA attention and a DynamicCache, all 16 prompts as one static
    batch (no padding: equal lengths), greedy;
  - generator: `Generator` over the "sparseserve" attention (token_budget 2048, HBM block cache of
    `--hbm-cache-gib`, admission on), same prompts, greedy;
  - generator_graphs (with `--cuda-graphs`): the same with `cuda_graphs=True` (decode steps replayed).
Each first serves a short warm-up (WARMUP_TOKENS of the first prompt, 8 new tokens) outside the clock.
Tokens/s counts generated tokens over wall time from the first submit (or generate call) to the
last token, prefill included. Prints a table; writes JSON with the device, the command and both
numbers.

    python -m eval.bench.generator_vs_generate --out eval/results/generator_vs_generate.json
    python -m eval.bench.generator_vs_generate --shape tiny --requests 4 --prompt-tokens 256 --new-tokens 8  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

import sparseserve_hf  # noqa: F401  (registers attn_implementation="sparseserve")
from eval.bench.decode_step_setup import SHAPES, build_model
from eval.serving.ours import engine_totals_since
from sparseserve_hf import Generator, SamplingParams, SparseServeConfig

WARMUP_TOKENS = 4096  # past the token budget: the warm-up runs selection and block transfers too


def run_stock(model, prompts: torch.Tensor, new_tokens: int) -> dict:
    """One static batch through stock generate."""
    with torch.no_grad():
        model.generate(prompts[:1, :WARMUP_TOKENS], max_new_tokens=8, min_new_tokens=8, do_sample=False)
    _sync()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    _sync()
    seconds = time.perf_counter() - start
    generated = (out.shape[1] - prompts.shape[1]) * out.shape[0]
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds}


def run_generator(model, prompts: torch.Tensor, new_tokens: int, config: SparseServeConfig) -> dict:
    """The same prompts through the Generator."""
    gen = Generator(model, None, config)
    gen.generate([prompts[0, :WARMUP_TOKENS].tolist()], SamplingParams(max_new_tokens=8, ignore_eos=True))
    warmup = gen.metrics()["totals"]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    _sync()
    start = time.perf_counter()
    outs = gen.generate([row.tolist() for row in prompts], params)
    _sync()
    seconds = time.perf_counter() - start
    metrics = gen.metrics()
    engine = engine_totals_since(metrics["totals"], warmup)  # the timed run alone
    generated = sum(len(o.token_ids) for o in outs)
    ttft = [r["ttft_s"] for rid, r in metrics["requests"].items() if rid > 0]  # id 0: the warm-up
    keep = ("hit_rate", "mean_decode_batch", "iterations_by_kind", "hbm_peak_bytes", "cuda_peak_bytes")
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "mean_ttft_s": sum(ttft) / len(ttft),
            "graph_captures": engine["graph_captures"] if config.cuda_graphs else None,
            } | {k: engine.get(k) for k in keep}  # fmt: skip


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> dict:
    """Parse arguments, run both systems, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--hbm-cache-gib", type=float, default=40.0)
    parser.add_argument("--dram-gib", type=float, default=40.0, help="host pool, allocated (pinned) once")
    parser.add_argument("--max-inject-tokens", type=int, default=2048 * 32, help="token-layers of prefill per step")
    parser.add_argument("--skip-stock", action="store_true")
    parser.add_argument("--cuda-graphs", action="store_true", help="also run the Generator with cuda_graphs=True")
    parser.add_argument("--out", type=Path, default=Path("eval/results/generator_vs_generate.json"))
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    max_positions = args.prompt_tokens + args.new_tokens + 1
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = torch.randint(1, vocab, (args.requests, args.prompt_tokens), generator=torch.Generator().manual_seed(1))
    results: dict = {}
    if not args.skip_stock:
        stock = build_model(args.shape, "sdpa", device, dtype, max_positions)
        results["stock_generate"] = run_stock(stock, prompts.to(device), args.new_tokens) | {"peak_bytes": _peak()}
        del stock
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    model = build_model(args.shape, "sparseserve", device, dtype, max_positions)
    config = SparseServeConfig(
        token_budget=args.token_budget,
        hbm_cache_bytes=int(args.hbm_cache_gib * 2**30),
        dram_bytes=int(args.dram_gib * 2**30),
        max_batch=args.requests,
        max_inject_tokens=args.max_inject_tokens,
    )
    results["generator"] = run_generator(model, prompts, args.new_tokens, config) | {"peak_bytes": _peak()}
    if args.cuda_graphs:
        graphs = replace(config, cuda_graphs=True)
        results["generator_graphs"] = run_generator(model, prompts, args.new_tokens, graphs) | {"peak_bytes": _peak()}
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "command": " ".join([sys.executable, "-m", "eval.bench.generator_vs_generate", *(argv or sys.argv[1:])]),
        "workload": vars(args) | {"out": str(args.out), "dtype": str(dtype)},
        "torch": torch.__version__,
        "results": results,
    }
    print(f"{'system':<16} {'seconds':>9} {'tokens':>8} {'tokens/s':>10} {'peak GB':>8}")
    for name, r in results.items():
        peak = f"{r['peak_bytes'] / 1e9:.1f}" if r.get("peak_bytes") else "-"
        print(f"{name:<16} {r['seconds']:>9.2f} {r['generated_tokens']:>8} {r['tokens_per_s']:>10.1f} {peak:>8}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
