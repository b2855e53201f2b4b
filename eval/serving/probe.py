"""What a stock decode step costs under the HBM cap, and why: the step's median, with one of
generate's caches, at a batch of the trace's first prompts, on its first call, on a second (warm)
call, and warm without the cap, each with the CUDA allocator's counters over the call (device
allocations and frees, and retries: an allocation that failed under the cap, freed the cached blocks
and tried again). Where the trace has the prompts, two more batches of as many rows follow, each
new to the warm process (a serving run's steps are all at new KV lengths): one as it runs by
default, one with cuDNN's attention switched off (each twice: new, then warm)."""

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
        out[phase] = _timed(model, batch, cache)
        print(phase, out[phase], flush=True)
    if len(trace.requests) < 3 * rows:
        return out
    cap.apply()
    for name, first, cudnn in (("new_lengths", rows, True), ("new_lengths_no_cudnn", 2 * rows, False)):
        fresh = [replace(request, output_tokens=steps + 1) for request in trace.requests[first : first + rows]]
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for phase in (f"capped_{name}", f"capped_{name}_warm"):
            out[phase] = _timed(model, fresh, cache) | {"prompt_tokens": [len(r.prompt) for r in fresh]}
            print(phase, out[phase], flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    return out


def _timed(model, batch: list, cache: str) -> dict[str, Any]:
    """{"step_ms": the median step of one `generate` call, counter: its delta over the call}."""
    before = _counters()
    times = stock.generate_step_times(model, batch, Clock(), cache)
    after = _counters()
    step = statistics.median(b - a for a, b in itertools.pairwise(times))
    return {"step_ms": step * 1e3} | {key: after[key] - before[key] for key in after}


def _counters() -> dict[str, int]:
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {key: int(stats.get(key, 0)) for key in ALLOCATOR_COUNTERS}
