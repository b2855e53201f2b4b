"""Tensor parallel: one decode step of the `Generator` at TP=2 against TP=1 (GPU benchmark; not a test).

    python -m eval.bench.tp_step --out eval/results/tp_step.json                      # TP=1, one GPU
    torchrun --nproc-per-node 2 -m eval.bench.tp_step --out eval/results/tp_step.json  # TP=2 (nvidia-h200-x2)
    python -m eval.bench.tp_step --dry-run --out /tmp/tp.json                         # tiny model, CPU
    python -m torch.distributed.run --nproc-per-node 2 -m eval.bench.tp_step --dry-run --out /tmp/tp.json

Llama-3-8B shape with random bf16 weights, saved once to `--model-dir` (seeded, so every run loads
the same weights) and loaded with `tp_plan="auto"` under torchrun, so each rank holds half of every
layer's heads and its cache half of the KV heads. `--requests` prompts of `--prompt-tokens` seeded
random tokens go into a `Generator` (`cuda_graphs=True`, an HBM cache of `--hbm-cache-fraction` of
the rank's dense KV) at once; after every row is decoding and `--warm-steps` more steps, the mean
of `--steps` decode iterations is the step time. Real locality: the loads follow the recorded
selection trace (`TraceReplay`). The greedy tokens are kept: a TP=2 run over a JSON that holds a
TP=1 run adds `tp2_step_over_tp1` and whether its tokens equal TP=1's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import sparseserve_hf  # noqa: F401  (registers attn_implementation="sparseserve")
from eval.bench.common import model_shape, run_record, sync, write_json
from eval.bench.decode_step_setup import build_model
from eval.bench.selection_trace import RECORDED_TRACE, SelectionTrace, TraceReplay
from sparseserve_hf import Generator, SamplingParams, SparseServeConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=32, help="decode iterations timed")
    parser.add_argument("--warm-steps", type=int, default=8, help="decode iterations run first (captures)")
    parser.add_argument("--hbm-cache-fraction", type=float, default=0.25)
    parser.add_argument("--model-dir", default="/tmp/sparseserve_tp_model", help="the random-weight checkpoint")
    parser.add_argument("--trace", default=str(RECORDED_TRACE), help="'' = random KV (the model's own selections)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="a tiny model on CPU (gloo under torchrun)")
    return parser.parse_args(argv)


def saved_model(args, shape: str, dtype: torch.dtype, rank: int) -> str:
    """The random-weight checkpoint in `--model-dir` (written once, by rank 0)."""
    folder = Path(args.model_dir) / shape
    if rank == 0 and not (folder / "config.json").exists():
        model = build_model(shape, "sparseserve", torch.device("cpu"), dtype, args.prompt_tokens + 4096)
        model.save_pretrained(folder)
        del model
    if dist.is_initialized():
        dist.barrier()
    return str(folder)


def engine_config(model, args) -> SparseServeConfig:
    """`cuda_graphs=True`; the HBM cache a fraction of this rank's dense KV; a DRAM pool for the rows."""
    text, tp = model.config, max(getattr(model, "tp_size", 1) or 1, 1)
    per_token = 2 * text.num_hidden_layers * (text.num_key_value_heads // tp) * text.head_dim * model.dtype.itemsize
    dense = per_token * args.requests * args.prompt_tokens
    return SparseServeConfig(
        cuda_graphs=True,
        hbm_cache_bytes=max(int(dense * args.hbm_cache_fraction), 1 << 20),
        dram_bytes=per_token * args.requests * (args.prompt_tokens + 1024) + (1 << 26),
        max_batch=args.requests,
        **({"block_size": 16, "token_budget": 64} if args.dry_run else {}),
    )


def measure(model, args) -> dict[str, Any]:
    """Prefill every request, warm up, then the mean time of `--steps` decode iterations."""
    config = engine_config(model, args)
    gen = Generator(model, None, config)
    if args.trace:
        text = model.config
        heads = gen.batch.kv_heads  # this rank's share: the trace's heads from the rank's first one on
        first = (dist.get_rank() if dist.is_initialized() else 0) * heads
        trace = SelectionTrace.load(args.trace)
        replay = TraceReplay(trace, text.num_hidden_layers, heads, gen.store.device, first_head=first)
        gen.store.selection_override = replay
    vocab = model.config.vocab_size
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (args.prompt_tokens,), generator=rng).tolist() for _ in range(args.requests)]
    total = args.warm_steps + args.steps + 2
    ids = [gen.submit(p, SamplingParams(max_new_tokens=total, ignore_eos=True)) for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    decoding = 0
    while decoding < args.warm_steps:  # prefill, then the first decode steps (the graphs' captures)
        for event in gen.step():
            if event.token_id is not None:
                tokens[event.request_id].append(event.token_id)
        if gen.metrics()["totals"]["iterations_by_kind"]["decode"]["count"] > 0:
            decoding += 1
    before = gen.metrics()["totals"]["iterations_by_kind"]["decode"]
    sync(gen.store.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        for event in gen.step():
            if event.token_id is not None:
                tokens[event.request_id].append(event.token_id)
    sync(gen.store.device)
    wall = time.perf_counter() - start
    after = gen.metrics()["totals"]
    decode = after["iterations_by_kind"]["decode"]
    steps = decode["count"] - before["count"]
    return {
        "step_ms": wall * 1e3 / args.steps,
        "decode_iteration_ms": (decode["total_s"] - before["total_s"]) * 1e3 / max(steps, 1),
        "decode_iterations": steps,
        "hit_rate": after["hit_rate"],
        "graph_captures": after["graph_captures"],
        "kv_heads_per_rank": gen.batch.kv_heads,
        "tokens": [tokens[i][: total - 2] for i in ids],
        "config": {k: getattr(config, k) for k in ("hbm_cache_bytes", "dram_bytes", "max_batch", "cuda_graphs")},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    if args.dry_run:
        args.requests, args.prompt_tokens, args.steps, args.warm_steps = 2, 200, 4, 2
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if distributed:
        dist.init_process_group("gloo" if args.dry_run else "nccl")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    shape, dtype = model_shape(args.dry_run)
    folder = saved_model(args, shape, dtype, rank)
    extra = {"tp_plan": "auto"} if distributed else {}
    device_map = {} if distributed or not torch.cuda.is_available() else {"device_map": "cuda"}
    model = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="sparseserve", dtype=dtype, **extra, **device_map
    )
    row = measure(model.eval(), args)
    result: dict[str, Any] = {}
    if rank == 0:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        earlier = json.loads(Path(args.out).read_text()) if args.out and Path(args.out).exists() else {}
        result = earlier | run_record(device) | {"workload": vars(args), f"tp{world}": row}
        result[f"tp{world}_step_ms"] = row["step_ms"]
        if world > 1 and "tp1" in result:
            result[f"tp{world}_step_over_tp1"] = row["step_ms"] / result["tp1"]["step_ms"]
            result[f"tp{world}_tokens_equal_tp1"] = row["tokens"] == result["tp1"]["tokens"]
        print({key: value for key, value in result.items() if key.endswith(("_ms", "_over_tp1", "_equal_tp1"))})
        write_json(args.out, result)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    if dist.is_available() and "LOCAL_RANK" in os.environ:  # a torchrun rank, its group destroyed
        # Every rank has written and passed the barrier: skip the interpreter's teardown, where a
        # gloo thread still joinable at exit aborts a rank now and then (SIGABRT).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
