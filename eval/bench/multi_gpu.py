"""Data parallel scaling: one Generator against a GeneratorGroup of one engine per device, closed loop.

    python -m eval.bench.multi_gpu --out eval/results/multi_gpu.json     # nvidia-h200-x2: ~5 min
    python -m eval.bench.multi_gpu --dry-run                             # tiny shapes, two CPU engines

Llama-3-8B shape, random bf16 weights. Each engine gets the same load: `--requests` prompts of
`--prompt-tokens` random tokens and `--new-tokens` new tokens each (EOS ignored), all submitted at
t=0; one engine serves that load, the group N times it (N = devices). Every engine serves a short
warm-up first. Tokens/s = generated tokens over the wall time from the first submit to the last
token, prefill included; `dp{N}_over_dp1` is the group's over the single engine's (ideal: N).
Config: `SparseServeConfig` with CUDA graphs, `--hbm-cache-gib` of block cache and `--dram-gib` of
pinned DRAM per engine, max batch = requests. Tensor parallel has its own script
(`eval.bench.tp_step`, under `torchrun`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from eval.bench.common import model_shape, pick_device, prepare_triton, print_table, run_record, write_json
from eval.bench.decode_step_setup import build_model
from sparseserve_hf import Generator, GeneratorGroup, SamplingParams, SparseServeConfig

GIB = 1 << 30
WARMUP_TOKENS = 4096


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default=None, help="comma-separated (default: every CUDA device)")
    parser.add_argument("--requests", type=int, default=16, help="requests per engine")
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--hbm-cache-gib", type=float, default=12.5)
    parser.add_argument("--dram-gib", type=float, default=72.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true")
    return parser.parse_args(argv)


def closed_loop(engine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Every engine serves a warm-up, then every prompt goes in at once; tokens/s over the wall time."""
    warm = prompts[0][: min(WARMUP_TOKENS, len(prompts[0]))]
    for one in getattr(engine, "engines", [engine]):
        one.generate([warm], SamplingParams(max_new_tokens=8, ignore_eos=True))
    _sync()
    start = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    _sync()
    seconds = time.perf_counter() - start
    generated = sum(len(out.token_ids) for out in outputs)
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = pick_device(args.dry_run)
    prepare_triton(device)
    if args.dry_run:
        args.devices = args.devices or "cpu,cpu"
        args.requests, args.prompt_tokens, args.new_tokens = 2, 200, 6
    devices = args.devices.split(",") if args.devices else [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    shape, dtype = model_shape(args.dry_run)
    config = SparseServeConfig(
        hbm_cache_bytes=int(args.hbm_cache_gib * GIB) if not args.dry_run else 1 << 22,
        dram_bytes=int(args.dram_gib * GIB) if not args.dry_run else 1 << 26,
        max_batch=args.requests,
        cuda_graphs=not args.dry_run,
        **({"block_size": 16, "token_budget": 64} if args.dry_run else {}),
    )
    model = build_model(
        shape, "sparseserve", torch.device(devices[0]), dtype, args.prompt_tokens + args.new_tokens + 64
    )
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(1, vocab, (args.prompt_tokens,), generator=generator).tolist()
        for _ in range(args.requests * len(devices))
    ]
    one = closed_loop(Generator(model, None, config), prompts[: args.requests], args.new_tokens)
    group = GeneratorGroup.replicate(model, None, config, devices=devices)
    many = closed_loop(group, prompts, args.new_tokens)
    engines = group.metrics()["engines"]
    group.close()
    n = len(devices)
    rows = [{"engines": 1} | one, {"engines": n} | many]
    result = run_record(device) | {
        "workload": vars(args),
        "devices": devices,
        "config": {k: getattr(config, k) for k in ("hbm_cache_bytes", "dram_bytes", "max_batch", "cuda_graphs")},
        "rows": rows,
        "requests_per_engine": [e["requests"] - 1 for e in engines],  # less its warm-up
        f"dp{n}_over_dp1": many["tokens_per_s"] / one["tokens_per_s"],
    }
    print_table(rows, ["engines", "seconds", "generated_tokens", "tokens_per_s"])
    print(f"dp{n}_over_dp1 = {result[f'dp{n}_over_dp1']:.2f}")
    write_json(args.out, result)
    return result


def _sync() -> None:
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


if __name__ == "__main__":
    main()
