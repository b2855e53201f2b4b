"""Fault injection for the Generator tests, and the fault-containment contract they check.

`Fault` makes one call of a function fail; `arm` puts it on one of the engine's fault sites: a
decoder layer, the LM head, the DRAM save or the block fetch of the engine's store, or the
sampler. The contract (README, "Failures and bad input"): a failure while serving a request ends
that request, or the decode batch it was in, with finish_reason "error" and a message; every
request ends exactly once; the pools drain to zero; the engine keeps serving; a request that did
not fail gets the tokens of a fault-free run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch

from sparseserve_hf import Generator
from sparseserve_hf.generation import generator as generator_module
from sparseserve_hf.generation.outputs import RequestOutput, StreamEvent

SITES = ("layer", "head", "save", "fetch", "sampler")
KINDS = ("raise", "oom", "raise_after", "nan", "interrupt")


class Fault:
    """Fails the `at`-th call (1-based) of whatever it wraps, once; counts every call.

    Args:
        at: the call that fails (0 = none: only count).
        kind: "raise" (RuntimeError before the call runs), "oom" (torch.OutOfMemoryError, as the
            CUDA allocator raises it), "raise_after" (the call runs, then RuntimeError: what it
            changed, e.g. a layer's stored K/V, stays changed), "nan" (the output gets NaN in
            `rows` along dim 0, every row when None; for functions returning logits),
            "interrupt" (KeyboardInterrupt before the call runs, as Ctrl-C or a notebook's stop).
        rows: rows to poison for "nan" (taken modulo the output's rows).
    """

    def __init__(self, at: int, kind: str = "raise", rows: list[int] | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(kind)
        self.at, self.kind, self.rows = at, kind, rows
        self.calls = 0
        self.fired = False

    def wrap(self, fn: Callable) -> Callable:
        """`fn` with this fault on its `at`-th call."""

        def patched(*args, **kwargs):
            self.calls += 1
            failing = self.calls == self.at
            if failing and self.kind in ("raise", "oom", "interrupt"):
                self.fired = True
                raise self._error()
            out = fn(*args, **kwargs)
            if failing and self.kind == "raise_after":
                self.fired = True
                raise self._error()
            if failing and self.kind == "nan":
                self.fired = True
                out = out.clone()
                rows = slice(None) if self.rows is None else [r % out.shape[0] for r in self.rows]
                out[rows] = float("nan")
            return out

        return patched

    def _error(self) -> BaseException:
        if self.kind == "interrupt":
            return KeyboardInterrupt()
        if self.kind == "oom":
            return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return RuntimeError(f"injected fault at call {self.at}")


def arm(mp: pytest.MonkeyPatch, gen: Generator, site: str, fault: Fault, layer: int = 0) -> None:
    """Put `fault` on `site` of `gen` through `mp` (undone when `mp` is).

    Sites: "layer" (decoder layer `layer`'s forward), "head" (the LM head: "nan" poisons logits),
    "save" / "fetch" (the store's DRAM save and HBM block fetch, patched on the instance),
    "sampler" (the sampler the Generator calls).
    """
    if site == "layer":
        target = gen.model.model.layers[layer]
        mp.setattr(target, "forward", fault.wrap(target.forward))
    elif site == "head":
        mp.setattr(gen.model.lm_head, "forward", fault.wrap(gen.model.lm_head.forward))
    elif site in ("save", "fetch"):
        mp.setattr(gen.store, site, fault.wrap(getattr(gen.store, site)))
    elif site == "sampler":
        mp.setattr(generator_module, "sample_next", fault.wrap(generator_module.sample_next))
    else:
        raise ValueError(site)


def drain(gen: Generator) -> list[StreamEvent]:
    """Step until nothing is left; every event on the way."""
    events: list[StreamEvent] = []
    while gen.has_unfinished:
        events += gen.step()
    return events


def ended_once(events: Iterable[StreamEvent], request_ids: Iterable[int]) -> dict[int, RequestOutput]:
    """Check that each request got exactly one final event, as its last, whose tokens are the ones
    streamed; returns each request's output."""
    by_id: dict[int, list[StreamEvent]] = {}
    for event in events:
        by_id.setdefault(event.request_id, []).append(event)
    outputs = {}
    for request_id in request_ids:
        mine = by_id.get(request_id, [])
        assert sum(e.finished for e in mine) == 1 and mine[-1].finished, f"request {request_id}: {mine}"
        output = mine[-1].output
        assert [e.token_id for e in mine if e.token_id is not None] == list(output.token_ids)
        if output.finish_reason == "error":
            assert output.error, f"request {request_id} failed without a message"
        outputs[request_id] = output
    return outputs


def check_against_fault_free(outputs: dict[int, RequestOutput], reference: dict[int, RequestOutput]) -> int:
    """A request that did not fail has the fault-free tokens and reason; one that failed has a prefix
    of them (nothing it emitted before the failure was wrong). Returns how many failed."""
    failed = 0
    for request_id, output in outputs.items():
        expected = reference[request_id]
        if output.finish_reason == "error":
            failed += 1
            assert output.token_ids == expected.token_ids[: len(output.token_ids)], f"request {request_id}"
        else:
            assert (output.token_ids, output.finish_reason) == (expected.token_ids, expected.finish_reason)
    return failed


def assert_drained(gen: Generator) -> None:
    """Nothing in flight and no block, slot or byte held (the pools' own counts included)."""
    assert not gen.has_unfinished
    assert gen.dram_bytes_in_use() == 0 and gen.hbm_bytes_in_use() == 0
    assert gen.store.dram.num_used == 0 and int(gen.store.dram.refcount.abs().sum()) == 0
