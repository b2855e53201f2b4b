"""GeneratorGroup: data parallel serving, one `Generator` per device behind one API.

Each engine owns a model replica, its DRAM pool, HBM block cache and (with `cuda_graphs`) its
graphs; engines share nothing. A new request goes to the engine with the most HBM block-cache
room left by the requests it already holds, counted with the numbers its own admission uses
(`Generator.committed_hbm_bytes`), so a request one engine would have to hold back runs on
another. Once placed, a request stays on its engine (its blocks live there). `step()` steps the
engines that have work concurrently, one thread each (PyTorch releases the GIL inside its ops
and kernel launches, and each thread runs with its engine's CUDA device current).

Request ids are the group's own; events, outputs, `cancel` and `metrics()` speak in them.
Per-request JSON lines (`Generator`'s `metrics_file`) are not written by a group: read
`metrics()["requests"]`, which names each request's engine.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import nullcontext
from typing import Any

import torch

from ..config import SparseServeConfig
from .frontend import Prompt, RequestFrontend
from .generator import Generator
from .outputs import StreamEvent
from .params import SamplingParams

SUMMED_TOTALS = (
    "requests", "finished", "generated_tokens", "iterations", "decode_rows", "sat_out", "prefill_token_layers",
    "hits", "misses", "h2d_bytes", "hbm_bytes_in_use", "dram_bytes_in_use", "graph_captures", "graph_capture_s",
    "decode_steps",
)  # fmt: skip
WEIGHTED_TOTALS = {  # engine means -> the weight each engine's mean carries
    "mean_ttft_s": "finished", "mean_tbt_s": "generated_tokens", "mean_queueing_delay_s": "requests",
    "loaded_tokens_per_kv_head": "decode_steps", "loaded_fraction": "decode_steps",
    "metadata_fraction": "decode_steps", "metadata_bytes_read_per_step": "decode_steps",
}  # fmt: skip


class GeneratorGroup(RequestFrontend):
    """Several `Generator`s, one per model replica (one per device), as one engine.

    Args:
        models: one model per engine, each loaded with attn_implementation="sparseserve" on its
            own device (`replicate` makes them from one model).
        tokenizer: shared by the engines (or None, for token-id prompts).
        config: one SparseServeConfig for every engine (each sizes its own pools by it).

    Raises:
        ValueError: no models, or two of them are the same object (engines must not share one).
        TypeError / ValueError / NotImplementedError: what `Generator` raises for a model or config.

    Example:
        >>> group = GeneratorGroup.replicate(model, tokenizer, config, devices=["cuda:0", "cuda:1"])
        >>> outs = group.generate(prompts, SamplingParams(max_new_tokens=64))
    """

    def __init__(
        self, models: Sequence[torch.nn.Module], tokenizer: Any = None, config: SparseServeConfig | None = None
    ):
        models = list(models)
        if not models:
            raise ValueError("GeneratorGroup needs at least one model")
        if len({id(m) for m in models}) != len(models):
            raise ValueError("each engine needs its own model replica (the same model was given twice)")
        self.engines = [Generator(model, tokenizer, config) for model in models]
        self.config = self.engines[0].config
        self.tokenizer = tokenizer
        self._where: dict[int, tuple[int, int]] = {}  # group id -> (engine, engine's id)
        self._ids: list[dict[int, int]] = [{} for _ in self.engines]  # per engine: its id -> group id
        self._next_id = 0
        self._pending: list[StreamEvent] = []
        self._threads = ThreadPoolExecutor(len(self.engines)) if len(self.engines) > 1 else None

    @classmethod
    def replicate(
        cls,
        model: torch.nn.Module,
        tokenizer: Any = None,
        config: SparseServeConfig | None = None,
        *,
        devices: Sequence[str | torch.device],
    ) -> GeneratorGroup:
        """One engine per device in `devices`: `model` serves the first, copies of it the rest
        (each copy is made on `model`'s device, then moved)."""
        devices = [torch.device(d) for d in devices]
        if not devices:
            raise ValueError("devices must name at least one device")
        models = [model.to(devices[0])] + [copy.deepcopy(model).to(device) for device in devices[1:]]
        return cls(models, tokenizer, config)

    # ---- the engine-level API, in group ids ----------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, prompt_index: int | None = None) -> int:
        """Queue one request on the engine with the most room; returns its group id.

        Raises what `Generator.submit` raises, and then nothing changes."""
        engine = self.route()
        local = self.engines[engine].submit(prompt, params, prompt_index=prompt_index)
        request_id, self._next_id = self._next_id, self._next_id + 1
        self._where[request_id] = (engine, local)
        self._ids[engine][local] = request_id
        return request_id

    def route(self) -> int:
        """The engine a new request goes to: the one whose requests need the fewest HBM block-cache
        bytes in its next iteration (the most room left, every engine having the same cache), the
        lower index on ties."""
        return min(range(len(self.engines)), key=lambda index: (self.engines[index].committed_hbm_bytes(), index))

    def step(self) -> list[StreamEvent]:
        """One iteration of every engine that has work, concurrently; their events in group ids."""
        events, self._pending = self._pending, []
        busy = [i for i, engine in enumerate(self.engines) if engine.has_unfinished]
        if self._threads is None or len(busy) <= 1:
            results = [(i, self._step_engine(i)) for i in busy]
        else:
            futures = [(i, self._threads.submit(self._step_engine, i)) for i in busy]
            wait([future for _, future in futures])  # every engine's step is over before anything else
            failed = [future.exception() for _, future in futures if future.exception() is not None]
            results = [(i, future.result()) for i, future in futures if future.exception() is None]
            if failed:  # the other engines' events wait for the next step
                self._pending = events + [self._to_group(i, e) for i, engine_events in results for e in engine_events]
                raise failed[0]
        for engine, engine_events in results:
            events += [self._to_group(engine, event) for event in engine_events]
        return events

    def cancel(self, request_id: int) -> bool:
        """Stop a request now; False when it is unknown or already finished (see `Generator.cancel`)."""
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            raise TypeError(f"request_id must be an int returned by submit, got {type(request_id).__name__}")
        where = self._where.get(request_id)
        return where is not None and self.engines[where[0]].cancel(where[1])

    @property
    def has_unfinished(self) -> bool:
        """True while any engine has a request waiting or in flight, or an event still to deliver."""
        return bool(self._pending) or any(engine.has_unfinished for engine in self.engines)

    def request_times(self, request_id: int) -> dict[str, Any] | None:
        """One request's timings (`Generator.request_times`), or None for an unknown id."""
        where = self._where.get(request_id)
        return None if where is None else self.engines[where[0]].request_times(where[1])

    def metrics(self) -> dict[str, Any]:
        """{"requests": {group id: dict}, "engines": [each engine's totals], "totals": the group's}.

        Group totals: counts summed over engines, means weighted by what each engine averaged
        over (`WEIGHTED_TOTALS`), tokens/s = all generated tokens over the longest engine's
        elapsed time, hit rate over all lookups, per-engine peaks summed."""
        per_engine = [engine.metrics() for engine in self.engines]
        requests = {
            self._ids[index][local]: times | {"request_id": self._ids[index][local], "engine": index}
            for index, metrics in enumerate(per_engine)
            for local, times in metrics["requests"].items()
            if local in self._ids[index]
        }
        engine_totals = [metrics["totals"] for metrics in per_engine]
        totals = {key: sum(t.get(key) or 0 for t in engine_totals) for key in SUMMED_TOTALS}
        elapsed = max(t.get("elapsed_s") or 0.0 for t in engine_totals)
        looked_up = totals["hits"] + totals["misses"]
        for key, weight in WEIGHTED_TOTALS.items():  # means over engines, weighted by what they averaged
            weights = [t.get(weight) or 0 for t in engine_totals]
            values = [t.get(key) for t in engine_totals]
            live = [(v, w) for v, w in zip(values, weights) if v is not None and w > 0]
            totals[key] = sum(v * w for v, w in live) / sum(w for _, w in live) if live else None
        totals |= {
            "engines": len(self.engines),
            "mean_decode_batch": totals["decode_rows"] / totals["iterations"] if totals["iterations"] else 0.0,
            "elapsed_s": elapsed,
            "tokens_per_s": totals["generated_tokens"] / elapsed if elapsed > 0 else 0.0,
            "hit_rate": totals["hits"] / looked_up if looked_up else 0.0,
            "hbm_peak_bytes": sum(t.get("hbm_peak_bytes") or 0 for t in engine_totals),
        }
        return {"requests": requests, "engines": engine_totals, "totals": totals}

    def hbm_bytes_in_use(self) -> int:
        """Device bytes held for KV on every engine (`Generator.hbm_bytes_in_use`), summed."""
        return sum(engine.hbm_bytes_in_use() for engine in self.engines)

    def dram_bytes_in_use(self) -> int:
        """Host bytes of live KV blocks on every engine, summed."""
        return sum(engine.dram_bytes_in_use() for engine in self.engines)

    def close(self) -> None:
        """Stop the stepping threads (the engines keep their state)."""
        if self._threads is not None:
            self._threads.shutdown(wait=True)

    # ---- what RequestFrontend needs ------------------------------------------------------------------

    def _abandon(self, request_ids: set[int]) -> None:
        by_engine: dict[int, set[int]] = {}
        for request_id in request_ids:
            where = self._where.get(request_id)
            if where is not None:
                by_engine.setdefault(where[0], set()).add(where[1])
        for engine, local in by_engine.items():
            self.engines[engine]._abandon(local)

    def _rejected(self, prompt: Prompt, index: int, message: str) -> StreamEvent:
        request_id, self._next_id = self._next_id, self._next_id + 1
        event = self.engines[0]._rejected(prompt, index, message)
        return dataclasses.replace(
            event, request_id=request_id, output=dataclasses.replace(event.output, request_id=request_id)
        )

    # ---- helpers ---------------------------------------------------------------------------------------

    def _step_engine(self, index: int) -> list[StreamEvent]:
        engine = self.engines[index]
        device = engine.stack.device
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            return engine.step()

    def _to_group(self, engine: int, event: StreamEvent) -> StreamEvent:
        """The event with the group's request id."""
        request_id = self._ids[engine][event.request_id]
        output = None if event.output is None else dataclasses.replace(event.output, request_id=request_id)
        return dataclasses.replace(event, request_id=request_id, output=output)
