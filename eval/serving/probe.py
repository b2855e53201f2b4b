"""What a stock decode step costs under the HBM cap, and why: the step's median, with one of
generate's caches, at a batch of the trace's first prompts, on its first call, on a second (warm)
call, and warm without the cap, each with the CUDA allocator's counters over the call (device
allocations and frees, and retries: an allocation that failed under the cap, freed the cached blocks
and tried again)."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import replace
from typing import Any

import torch

from eval.serving import stock
from eval.serving.common import Clock
from eval.serving.setup import HbmCap, _model
from eval.serving.trace import Trace

ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def stock_step_probe(
    shape: str, trace: Trace, cap: HbmCap, rows: int, steps: int = 32, cache: str = "dynamic"
) -> dict[str, Any]:
    """{phase: {"step_ms": median, counter: delta}} for phases capped_first, capped_warm, uncapped_warm,
    with `cache` (one of `stock.CACHES`)."""
    cap.apply()
    model = _model(shape, trace, "sdpa")
    batch = [replace(request, output_tokens=steps + 1) for request in trace.requests[:rows]]
    out: dict[str, Any] = {
        "rows": rows,
        "cache": cache,
        "prompt_tokens": [len(r.prompt) for r in batch],
        "steps": steps,
    }
    for phase in ("capped_first", "capped_warm", "uncapped_warm"):
        if phase == "uncapped_warm" and torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(1.0)
        before = _counters()
        times = stock.generate_step_times(model, batch, Clock(), cache)
        after = _counters()
        step = statistics.median(b - a for a, b in itertools.pairwise(times))
        out[phase] = {"step_ms": step * 1e3} | {key: after[key] - before[key] for key in after}
        print(phase, out[phase], flush=True)
    return out


def _counters() -> dict[str, int]:
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {key: int(stats.get(key, 0)) for key in ALLOCATOR_COUNTERS}
