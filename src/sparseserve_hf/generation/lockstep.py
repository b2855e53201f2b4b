"""Lockstep: what keeps the engines of a tensor-parallel Generator (one per rank) taking the same steps.

Under transformers' `tp_plan` every rank holds a share of each layer's KV heads and runs its own
Generator over the same requests (every rank submits them in the same order). The forwards agree
by construction: each rank ends a layer with the same all-reduced hidden states, so the logits,
sampled tokens and finish decisions are the same everywhere (a sampled request without a seed
gets one from rank 0). What differs per rank is what its
share of the KV heads selects, so the working sets admission compares: before scheduling, the
ranks agree on the largest working set of each request (an all-reduce of a few integers), and the
plan, a pure function of those numbers, comes out the same on every rank. A rank whose cache is
the tightest thereby sets the pace for all. A paced prefill budget (`target_tbt_ms`), measured per
rank, is agreed the same way: the smallest wins.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .scheduler import Candidate

NO_BUDGET = 2**62  # stands for "no cap" in the all-reduce of prefill budgets


def tensor_parallel_size(model: torch.nn.Module) -> int:
    """Ranks the model's heads are split over (transformers sets `tp_size` under `tp_plan`), else 1."""
    size = getattr(model, "tp_size", None)
    return size if isinstance(size, int) and size > 1 else 1


def agree_on_candidates(candidates: list[Candidate], tp_size: int, device: torch.device) -> list[Candidate]:
    """The candidates with every working set and decode working set the largest any rank measured
    (the same list on every rank, in the same order); unchanged without tensor parallelism.

    Raises RuntimeError when the ranks hold different numbers of requests: they are out of
    lockstep (a request submitted on one rank only, a failure on one rank only), and a collective
    over lists of different lengths would hang instead."""
    if tp_size <= 1:
        return candidates
    count = torch.tensor([len(candidates), -len(candidates)], dtype=torch.long, device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    if count.tolist() != [len(candidates), -len(candidates)]:
        raise RuntimeError(
            f"tensor-parallel ranks are out of lockstep: this rank holds {len(candidates)} requests, "
            f"others between {-count[1].item()} and {count[0].item()}; every rank must submit the same requests"
        )
    if not candidates:
        return candidates
    sizes = torch.tensor([[c.working_set_bytes, c.decode_bytes] for c in candidates], dtype=torch.long, device=device)
    torch.distributed.all_reduce(sizes, op=torch.distributed.ReduceOp.MAX)
    return [
        replace(c, working_set_bytes=int(size), decode_bytes=int(decode))
        for c, (size, decode) in zip(candidates, sizes.tolist())
    ]


def agree_on_budget(budget: int | None, tp_size: int, device: torch.device) -> int | None:
    """The smallest prefill budget (token-layers) any rank allows, None where none caps it; unchanged
    without tensor parallelism. A paced budget comes from each rank's own timings, but every rank
    must run the same prefill work: its layers end in collectives."""
    if tp_size <= 1:
        return budget
    value = torch.tensor([NO_BUDGET if budget is None else budget], dtype=torch.long, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    agreed = int(value.item())
    return None if agreed == NO_BUDGET else agreed


def shared_seed(tp_size: int, device: torch.device) -> int | None:
    """A sampling seed drawn on rank 0 and sent to every rank (None without tensor parallelism): a
    sampled request without a seed of its own must draw the same tokens on every rank."""
    if tp_size <= 1:
        return None
    seed = torch.randint(0, 2**62, (1,), dtype=torch.long).to(device)
    torch.distributed.broadcast(seed, src=0)
    return int(seed.item())
