"""One rank of a tensor-parallel run (`torch.distributed.run --nproc-per-node 2`), or the single
process it is compared with, on a tiny Llama saved in FOLDER: greedy `generate` through a
SparseServeCache, or (`--generator`) a Generator over prompts of several lengths, greedy and then
sampled without a seed. Written as JSON to OUT (rank 0 only, under TP; every rank checks that it
produced the same tokens as every other).

    python -m torch.distributed.run --nproc-per-node 2 tests/generation/tp_worker.py FOLDER OUT --tp
    python tests/generation/tp_worker.py FOLDER OUT [--generator [--paced]]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import sparseserve_hf  # noqa: F401  (registers attn_implementation="sparseserve")
from sparseserve_hf import Generator, SamplingParams, SparseServeCache, SparseServeConfig

LENGTHS = (150, 37, 90, 201, 64)


def main(folder: str, out: str, tensor_parallel: bool, generator: bool) -> None:
    extra = {"tp_plan": "auto"} if tensor_parallel else {}
    model = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="sparseserve", dtype=torch.float32, **extra
    )
    paced = {"target_tbt_ms": 1000.0} if "--paced" in sys.argv else {}
    config = SparseServeConfig(block_size=16, token_budget=48, hbm_cache_bytes=1 << 20, **paced)
    result = run_generator(model, config) if generator else run_generate(model, config)
    result["world"] = dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [result["tokens"], result.get("sampled")])
        assert all(tokens == everyone[0] for tokens in everyone), "ranks decoded different tokens"
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(result, handle)
    if dist.is_initialized():  # every rank done before any tears gloo down (else a rank may abort)
        dist.barrier()
        dist.destroy_process_group()
        # The results are written and every rank is past the barrier; skip the interpreter's teardown,
        # where a gloo thread still joinable at exit aborts the process now and then (SIGABRT).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_generate(model, config: SparseServeConfig) -> dict:
    ids = torch.randint(1, 200, (2, 150), generator=torch.Generator().manual_seed(1))
    cache = SparseServeCache(model.config, config)
    with torch.no_grad():
        tokens = model.generate(ids, past_key_values=cache, max_new_tokens=24, do_sample=False, pad_token_id=0)
    stats = cache.stats()
    return {
        "tokens": tokens[:, ids.shape[1] :].tolist(),
        "cache_kv_heads": cache.kv_heads,
        "tail_kv_heads": cache.layers[0].tail.shape[1],
        "hbm_partitions": cache.store.hbm_partitions,
        "misses": stats["misses"],
    }


def run_generator(model, config: SparseServeConfig) -> dict:
    prompts = [torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in LENGTHS]
    engine = Generator(model, None, config)
    if engine.pacer is not None:  # each rank's pacer says another budget, as timings per rank would
        rank = dist.get_rank() if dist.is_initialized() else 0
        budget = (1, 10_000)[rank]  # one unit of prefill per iteration beside decoding rows, or all of it
        engine.pacer.budget = lambda decode_rows: None if decode_rows == 0 else budget
    params = SamplingParams(max_new_tokens=16)
    outputs = staggered(engine, prompts, params) if engine.pacer is not None else engine.generate(prompts, params)
    sampled = engine.generate(prompts[:2], SamplingParams(max_new_tokens=8, temperature=1.0))  # no seed given
    totals = engine.metrics()["totals"]
    return {
        "tokens": [list(out.token_ids) for out in outputs],
        "sampled": [list(out.token_ids) for out in sampled],
        "cache_kv_heads": engine.batch.kv_heads,
        "hbm_partitions": engine.store.hbm_partitions,
        "misses": totals["misses"],
        "mean_decode_batch": totals["mean_decode_batch"],
        "pacing_token_layer_us": totals.get("pacing_token_layer_us"),
    }


def staggered(engine: Generator, prompts: list[list[int]], params: SamplingParams) -> list:
    """The first prompt alone until it decodes, then the others: their prefills run beside its decode
    steps (where a paced budget binds). Outputs in prompt order."""
    first, outputs = engine.submit(prompts[0], params), {}
    while not any(event.request_id == first and event.token_id is not None for event in engine.step()):
        pass
    ids = [first, *(engine.submit(prompt, params) for prompt in prompts[1:])]
    while engine.has_unfinished:
        outputs |= {event.request_id: event.output for event in engine.step() if event.output is not None}
    return [outputs[i] for i in ids]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--tp" in sys.argv, "--generator" in sys.argv)
