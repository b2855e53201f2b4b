"""GPU time of one layer's HBM block-cache lookup, as CUDA-graph replays (H200, ~1 min).

    PYTHONPATH=src:. python eval/bench/lookup_cost.py > eval/results/lookup_cost.txt

Llama-3-8B's shape: 8 KV heads, each loading the union of its 4 query heads' 62 top-k blocks
(U = 248 entries per row), one LRU partition per (layer, KV head). Per (rows B, slots per
partition Pp): the tensor spec (`ops.lru.resolve_`, a chain of small kernels) and the Triton
lookup (`ops.triton_resolve.resolve_`: its claim and install kernels, one program per KV head,
in tiles of 4096, 2048 and 8192 entries). Each case is warmed with its
own ids first, so the timed lookups hit: the victim scan and the order's upkeep still run in
full. Microseconds per replay (the median of `graph_ms`); on CPU (the script's test) one
plain call of the tensor spec.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from eval.bench.common import graph_ms, run_record, time_ms
from sparseserve_hf.ops import lru

KV_HEADS, LAYERS, ENTRIES_PER_ROW = 8, 32, 248
CASES = ((16, 4072), (16, 8144), (4, 1024), (1, 4096))  # B, Pp (8144: 8-bit blocks in the same bytes)


def replay_us(fn: Callable[[], object], device: torch.device) -> float:
    ms = graph_ms(fn, device) if device.type == "cuda" else time_ms(fn, device)
    return float("nan") if ms is None else ms * 1e3


def one_case(batch: int, per: int, device: torch.device, resolvers: dict[str, Callable]) -> str:
    partitions = LAYERS * KV_HEADS
    blocks_per_head = 2 * per  # a row's DRAM blocks per (layer, head): twice what its partition holds
    tables = lru.empty_tables(partitions, per, partitions * blocks_per_head, device)
    counts = torch.zeros(2, dtype=torch.long, device=device)
    local = torch.stack(
        [torch.randperm(blocks_per_head, device=device)[: batch * ENTRIES_PER_ROW] for _ in range(KV_HEADS)]
    )
    layer = 5  # any layer: its heads' partitions are 40..47
    ids = local + (layer * KV_HEADS + torch.arange(KV_HEADS, device=device))[:, None] * blocks_per_head
    ids = ids.view(KV_HEADS, batch, ENTRIES_PER_ROW).transpose(0, 1).contiguous()  # (B, Hkv, U)
    times = []
    for name, resolve in resolvers.items():
        resolve(ids, layer * KV_HEADS, tables, counts)  # warm: every later lookup hits
        times.append(f"{name} {replay_us(lambda f=resolve: f(ids, layer * KV_HEADS, tables, counts), device):.1f} us")
    return f"B={batch} Pp={per} entries/partition={batch * ENTRIES_PER_ROW}: " + ", ".join(times)


def resolvers_for(device: torch.device) -> dict[str, Callable]:
    out = {"tensor spec": lru.resolve_}
    if device.type == "cuda":
        from sparseserve_hf.ops import triton_resolve  # triton: GPU only here

        out["claim + install kernels"] = triton_resolve.resolve_
        out["the same, 2048-wide tiles"] = functools.partial(triton_resolve.resolve_, max_tile=2048)
        out["the same, 8192-wide tile"] = functools.partial(triton_resolve.resolve_, max_tile=8192)
    return out


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = run_record(device)
    print(f"{record['device']}, commit {record['git_commit']}, torch {record['torch']}")
    for case in CASES:
        print(one_case(*case, device, resolvers_for(device)))
