"""One rank of a tensor-parallel run (`torch.distributed.run --nproc-per-node 2`), or the single
process it is compared with: greedy `generate` through a SparseServeCache on a tiny Llama saved in
FOLDER, written as JSON to OUT (rank 0 only, under TP).

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/tp_worker.py FOLDER OUT --tp
    python tests/distributed/tp_worker.py FOLDER OUT
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import sparseserve_hf  # noqa: F401  (registers attn_implementation="sparseserve")
from sparseserve_hf import SparseServeCache, SparseServeConfig


def main(folder: str, out: str, tensor_parallel: bool) -> None:
    extra = {"tp_plan": "auto"} if tensor_parallel else {}
    model = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="sparseserve", dtype=torch.float32, **extra
    )
    ids = torch.randint(1, 200, (2, 150), generator=torch.Generator().manual_seed(1))
    config = SparseServeConfig(block_size=16, token_budget=48, hbm_cache_bytes=1 << 20)
    cache = SparseServeCache(model.config, config)
    with torch.no_grad():
        tokens = model.generate(ids, past_key_values=cache, max_new_tokens=24, do_sample=False, pad_token_id=0)
    stats = cache.stats()
    result = {
        "tokens": tokens[:, ids.shape[1] :].tolist(),
        "cache_kv_heads": cache.kv_heads,
        "tail_kv_heads": cache.layers[0].tail.shape[1],
        "hbm_partitions": cache.store.hbm_partitions,
        "misses": stats["misses"],
        "world": dist.get_world_size() if dist.is_initialized() else 1,
    }
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--tp" in sys.argv)
