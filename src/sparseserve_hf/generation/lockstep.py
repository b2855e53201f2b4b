"""Lockstep: what keeps the engines of a tensor-parallel Generator (one per rank) taking the same steps.

Under transformers' `tp_plan` every rank holds a share of each layer's KV heads and runs its own
Generator over the same requests (every rank submits them in the same order). The forwards agree
by construction: each rank ends a layer with the same all-reduced hidden states, so the logits,
sampled tokens and finish decisions are the same everywhere. What differs per rank is what its
share of the KV heads selects, so the working sets admission compares: before scheduling, the
ranks agree on the largest working set of each request (an all-reduce of a few integers), and the
plan, a pure function of those numbers, comes out the same on every rank. A rank whose cache is
the tightest thereby sets the pace for all.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .scheduler import Candidate


def tensor_parallel_size(model: torch.nn.Module) -> int:
    """Ranks the model's heads are split over (transformers sets `tp_size` under `tp_plan`), else 1."""
    size = getattr(model, "tp_size", None)
    return size if isinstance(size, int) and size > 1 else 1


def agree_on_candidates(candidates: list[Candidate], tp_size: int, device: torch.device) -> list[Candidate]:
    """The candidates with every working set the largest any rank measured (the same list on every
    rank, in the same order); unchanged without tensor parallelism."""
    if tp_size <= 1 or not candidates:
        return candidates
    sizes = torch.tensor([c.working_set_bytes for c in candidates], dtype=torch.long, device=device)
    torch.distributed.all_reduce(sizes, op=torch.distributed.ReduceOp.MAX)
    return [replace(c, working_set_bytes=int(size)) for c, size in zip(candidates, sizes.tolist())]
