"""GPU time per layer of the sparse decode step's bookkeeping, as CUDA-graph replays (H200, ~1 min).

    PYTHONPATH=src:. python eval/bench/lookup_cost.py > eval/results/lookup_cost.txt

Llama-3-8B's head counts (32 query, 8 KV heads, 63 top-k blocks per head), random scores and
tables. Per (rows B, table width N, HBM slots P): the selection chain (hybrid rank combination,
top-k, union over the GQA group, table gather), the whole HBM-cache lookup (`lru.lookup_`), its
victim choice alone (`lru.lru_victims`) and a bare `topk` of the selection's size over every slot
(what the victim choice was until the eviction order was kept: the results file's first run,
at f6872a4, timed that top-k as `lru_victims`).
P = 822K is the serving sweep's 13.5 GB cache; 2.6M the decode-step bench's 40 GiB. The LRU is
warmed with the same ids first, so lookups hit. Microseconds per replay, the median of
`graph_ms` (the results file's f6872a4 run timed the mean of 200 replays with its own loop).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eval.bench.common import graph_ms, run_record, time_ms
from sparseserve_hf.cache import lru
from sparseserve_hf.ops import reference

QUERY_HEADS, KV_HEADS, TOP_K = 32, 8, 63
CASES = (
    (1, 1024, 822_000, 3_145_728),
    (1, 2048, 822_000, 3_145_728),
    (16, 1024, 2_621_440, 4_194_304),
)  # B, N, P, DRAM blocks


def replay_us(fn: Callable[[], object]) -> float:
    """Microseconds of one replay of `fn` captured in a CUDA graph (`graph_ms`); on CPU, the
    script's test, of one plain call (`time_ms`)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ms = graph_ms(fn, device) if device.type == "cuda" else time_ms(fn, device)
    return float("nan") if ms is None else ms * 1e3


def one_case(batch: int, width: int, slots: int, dram_blocks: int, device: str = "cuda") -> str:
    first, second = (
        torch.randn(batch, QUERY_HEADS, width, device=device),
        torch.randn(batch, QUERY_HEADS, width, device=device),
    )
    num_blocks = torch.full((batch,), width - 24, device=device)
    table = torch.randperm(dram_blocks, device=device)[: batch * KV_HEADS * width].view(batch, KV_HEADS, width)
    block_slot = torch.full((dram_blocks + 1,), -1, device=device)
    slot_block = torch.full((slots + 1,), -1, device=device)
    slot_tick = torch.full((slots + 1,), -1, device=device)
    clock = torch.zeros(1, dtype=torch.long, device=device)
    slot_index = torch.arange(slots, device=device)
    slot_order = slot_index.clone()
    tables = block_slot, slot_block, slot_tick, slot_order

    def select() -> torch.Tensor:  # (B, Hkv, U) DRAM ids of the union
        scores = reference.combine_by_rank(first, second, depth=TOP_K)
        picked, valid = reference.select_blocks(scores, num_blocks, TOP_K, 1, 1)
        union, union_valid, _ = reference.union_over_group(picked, valid, KV_HEADS, width, False)
        return torch.where(union_valid, torch.gather(table, 2, union), -1)

    ids = select()
    for _ in range(3):  # warm the LRU with these ids so the timed lookups hit
        lru.lookup_(ids, *tables, clock, slot_index)
    count = ids.numel()
    selection = replay_us(select)
    lookup = replay_us(lambda: lru.lookup_(ids, *tables, clock, slot_index))
    victims = replay_us(lambda: lru.lru_victims(slot_order, slot_tick[:slots], clock, count))
    topk = replay_us(lambda: slot_tick[:slots].topk(count, largest=False, sorted=True))
    return (
        f"B={batch} N={width} P={slots} n={count}: select {selection:.0f} us, lookup_ {lookup:.0f} us, "
        f"lru_victims {victims:.0f} us, topk-only {topk:.0f} us"
    )


if __name__ == "__main__":
    record = run_record(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"{record['device']}, commit {record['git_commit']}, torch {record['torch']}")
    for case in CASES:
        print(one_case(*case))
