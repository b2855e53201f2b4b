"""Which systems run, on which model, under which memory cap (one place, so every system gets the same)."""

from __future__ import annotations

import functools
import itertools
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from eval.bench.decode_step_setup import SHAPES, build_model
from eval.serving import ours, stock
from eval.serving.common import WARMUP_NEW_TOKENS, Budget, Clock, Runner
from eval.serving.trace import Trace
from sparseserve_hf import SparseServeConfig
from sparseserve_hf.generation.sizing import EngineSizes

GIB = 1 << 30
TOKEN_BUDGET = 2048
# Ours' prefill per iteration, in token-layers, every rung alike: a 32K-token segment of one layer
# (layer-segmented) or a 1024-token chunk through 32 layers (chunked). The paper's 2048 x layers
# would run 64K-token segments, whose activations at the 8B shape do not fit the 8 GiB headroom
# beside the decode step's (a layer's activations grow with its tokens).
INJECT_TOKEN_LAYERS = 32768

# The paper's ablation ladder (Fig. 13), each rung adding one technique to the one before, then ours.
LADDER: dict[str, dict[str, Any]] = {
    "ours_sparse": dict(offload=False, admission=False, prefill_mode="chunked"),  # sparse attention, KV in HBM
    "ours_offload": dict(offload=True, transfer="copy", admission=False, prefill_mode="chunked"),  # + DRAM tier
    "ours_fast_transfer": dict(offload=True, transfer="kernel", admission=False, prefill_mode="chunked"),  # + FlashH2D
    "ours_admission": dict(offload=True, transfer="kernel", admission=True, prefill_mode="chunked"),  # + working set
    "ours_layered": dict(offload=True, transfer="kernel", admission=True, prefill_mode="layer_segmented"),  # + layered
    "ours": dict(  # + decode steps replayed as CUDA graphs (not in the paper's ladder)
        offload=True, transfer="kernel", admission=True, prefill_mode="layer_segmented", cuda_graphs=True
    ),
}
# generate's cache for each stock system. `stock_generate_no_cudnn`: DynamicCache with PyTorch's cuDNN
# attention switched off (SDPA picks another kernel): cuDNN pays a setup for every KV length it has not
# seen, which is every decode step of a serving run.
STOCK_CACHES = {
    "stock_generate": "dynamic",
    "stock_generate_no_cudnn": "dynamic",
    "stock_offload": "offloaded",
    "stock_static": "static",
}
WITHOUT_CUDNN = ("stock_generate_no_cudnn",)
STOCK = (*STOCK_CACHES, "stock_generate_batch")
SYSTEMS = STOCK + tuple(LADDER)
# CUDA allocator settings by system, each its best. Ours: expandable segments, or a layer's prefill
# beside the block cache leaves GiBs reserved but unusable under the cap. Stock generate: the
# default; under expandable segments the torch.cat-grown DynamicCache maps fresh pages every step,
# which slows its dense decode step (docs/serving.md).
ALLOCATOR = {rung: "expandable_segments:True" for rung in LADDER}


@dataclass(frozen=True)
class HbmCap:
    """Device memory every system may use (weights + KV + activations), enforced the same way for all."""

    cap_bytes: int
    headroom_bytes: int

    @classmethod
    def from_args(cls, args) -> HbmCap:
        return cls(int(args.hbm_cap_gib * GIB), int(args.headroom_gib * GIB))

    def apply(self) -> None:
        """Cap this process's CUDA allocations (PyTorch raises OutOfMemoryError past it)."""
        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.cap_bytes / total))

    def kv_bytes(self, model: torch.nn.Module) -> int:
        """What is left for KV once the weights and the activation headroom are counted."""
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        return max(0, self.cap_bytes - weights - self.headroom_bytes)

    def as_dict(self) -> dict[str, int]:
        return {"cap_bytes": self.cap_bytes, "headroom_bytes": self.headroom_bytes}


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    sizes = EngineSizes(model.config, SparseServeConfig(), model.dtype)  # KV sizes do not depend on the config
    return sizes.num_layers * sizes.kv_bytes_per_token_layer


def build(
    system: str,
    shape: str,
    trace: Trace,
    cap: HbmCap,
    max_batch: int,
    dram_bytes: int,
    selection_trace: Path | None = None,
    overrides: dict[str, Any] | None = None,
    saturated_only: bool = False,
    stop_queueing_s: float | None = None,
) -> Runner:
    """`system` warmed up on its model under `cap`: a function (rate, deadline_s) -> RunResult.

    One build serves several rates in turn (the model, and the Generator's pinned pool, are made once).
    `selection_trace`: for ours' rungs, the recorded selections whose blocks the engine loads (a real
    model's locality on random weights, `TraceReplay`); None: the random model's own selections.
    `overrides`: SparseServeConfig fields set over an ours rung's (a variant of it); stock takes none.
    `saturated_only`: every rate it will run is infinite (stock's static batches then warm only the
    sizes a saturated run forms).
    `stop_queueing_s`: stock's static batches stop once their queue grows past it (`QueueingStop`:
    a goodput point that only has to show stock missing the SLO); no other system takes it.
    """
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; one of {', '.join(SYSTEMS)}")
    if overrides and system not in LADDER:
        raise ValueError(f"config overrides {sorted(overrides)} apply to ours' rungs, not to {system}")
    if stop_queueing_s is not None and system not in STOCK_CACHES:
        raise ValueError(
            f"a queueing stop applies to stock's static batches ({', '.join(STOCK_CACHES)}), not to {system}"
        )
    cap.apply()
    model = _model(shape, trace, "sdpa" if system in STOCK else "sparseserve")
    budget = Budget(cap.kv_bytes(model), kv_bytes_per_token(model), max_batch)
    if system in WITHOUT_CUDNN:  # for this process: one system per process (eval/h200_serving.sh)
        torch.backends.cuda.enable_cudnn_sdp(False)
    if system in STOCK_CACHES:
        cache = STOCK_CACHES[system]
        rows = stock.warm_static_generate(model, trace, budget, cache, saturated_only)
        return functools.partial(
            stock.run_static_generate, model, trace, budget=budget, cache=cache, rows_cap=rows,
            stop_queueing_s=stop_queueing_s,
        )  # fmt: skip
    if system == "stock_generate_batch":  # warms up inside: each run starts its own manager
        return functools.partial(stock.run_continuous_batching, model, trace, budget=budget)
    config = ours_config(system, model, budget, dram_bytes, overrides)
    gen = ours.warmed_generator(model, trace, config, selection_trace)
    return functools.partial(ours.run_generator, gen, trace)


def ours_config(
    system: str, model: torch.nn.Module, budget: Budget, dram_bytes: int, overrides: dict[str, Any] | None = None
) -> SparseServeConfig:
    """A ladder rung's config (with `overrides` set over it), its device bytes (block cache or pool,
    plus metadata) within the KV budget.

    The metadata of every block the pool can hold lives on the device beside the blocks (hybrid:
    6 vectors per 16 KiB head-block, 9%), so it is counted in the budget: with offload the HBM block
    cache gets what the DRAM pool's metadata leaves; without, the device pool and its metadata share it.
    """
    base = dict(token_budget=TOKEN_BUDGET, max_batch=budget.max_batch, max_inject_tokens=INJECT_TOKEN_LAYERS)
    rung = base | LADDER[system] | (overrides or {})
    graphs = rung.pop("cuda_graphs", False)  # valid only once the pools are sized, below
    config = SparseServeConfig(**rung)
    sizes = EngineSizes(model.config, config, model.dtype)
    block_bytes = sizes.block_bytes
    metadata_bytes = config.metadata_vectors * sizes.head_dim * model.dtype.itemsize  # per block
    if not config.offload:
        pool_blocks = budget.kv_bytes // (block_bytes + metadata_bytes)
        return replace(config, hbm_cache_bytes=None, dram_bytes=pool_blocks * block_bytes, cuda_graphs=graphs)
    cache_bytes = budget.kv_bytes - dram_bytes // block_bytes * metadata_bytes
    if cache_bytes < block_bytes:
        raise ValueError(
            f"the DRAM pool's metadata ({dram_bytes // block_bytes * metadata_bytes} bytes) leaves no HBM block "
            f"cache in the KV budget of {budget.kv_bytes} bytes: lower --dram-gib or raise --hbm-cap-gib"
        )
    return replace(config, hbm_cache_bytes=cache_bytes, dram_bytes=dram_bytes, cuda_graphs=graphs)


def dense_iteration_s(shape: str, trace: Trace, cap: HbmCap, steps: int = 32) -> float:
    """Median time of one stock dense decode step at batch 1 over the trace's median prompt (the SLO
    unit), timed on the second of two identical calls: cuDNN's attention pays a setup at every KV
    length it has not seen, so a warm-up shorter than the timed call leaves most timed steps cold."""
    cap.apply()
    model = _model(shape, trace, "sdpa")
    median = sorted(trace.requests, key=lambda r: len(r.prompt))[len(trace.requests) // 2]
    request = replace(median, output_tokens=steps + 1)
    stock.generate_step_times(model, [request], Clock())
    times = stock.generate_step_times(model, [request], Clock())
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def _model(shape: str, trace: Trace, attn: str) -> torch.nn.Module:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    longest = max(len(r.prompt) + max(r.output_tokens, WARMUP_NEW_TOKENS) for r in trace.requests)
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    top_id, vocab = max(max(r.prompt) for r in trace.requests), SHAPES[shape]["vocab_size"]
    if top_id >= vocab:
        raise ValueError(f"the trace holds token id {top_id}, past the {shape} model's vocabulary of {vocab}")
    return build_model(shape, attn, device, dtype, longest + 1)
