"""Property-based tests of the Generator's block bookkeeping (hypothesis).

Random sequences of submit / step / cancel / an injected failure (tests/generation/fault_support.py)
/ a `stream` read for a few events and dropped, each run inside or outside `torch.inference_mode`,
over small pools. After every operation: no request ended twice or sent an event after its end,
every DRAM block has exactly as many references as tables and prefix-index entries list it (one at
most without prefix caching: rows never share blocks then), the reference counts and the pool's
used-block count agree, and the HBM block cache holds at most `hbm_cache_bytes`. After draining
(and clearing the prefix index): every request ended exactly once and the pools are empty,
reference counts all zero. With prefix caching the prompts start alike, so blocks are shared.
"""

from __future__ import annotations

import pytest
import torch
from fault_support import SITES, Fault, arm, assert_drained, drain, ended_once
from gen_support import prompt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig

BLOCK_BYTES = 2 * 16 * 16 * 4  # block_size 16 x head_dim 16, fp32 keys and values
SHARED_START = prompt(70, seed=999)  # the prompts' common start under prefix caching
POOLS = {
    "segmented": dict(
        hbm_cache_bytes=2 * 24 * BLOCK_BYTES, dram_bytes=48 * BLOCK_BYTES, max_batch=3, max_inject_tokens=40
    ),
    "chunked": dict(
        hbm_cache_bytes=2 * 16 * BLOCK_BYTES,
        dram_bytes=80 * BLOCK_BYTES,
        max_batch=2,
        prefill_mode="chunked",
        max_inject_tokens=32,
    ),
    "no-admission": dict(hbm_cache_bytes=2 * 20 * BLOCK_BYTES, dram_bytes=64 * BLOCK_BYTES, admission=False),
    "device-pool": dict(offload=False, dram_bytes=48 * BLOCK_BYTES, max_batch=3),
    "prefix-cache": dict(
        hbm_cache_bytes=2 * 24 * BLOCK_BYTES,
        dram_bytes=48 * BLOCK_BYTES,
        max_batch=3,
        max_inject_tokens=40,
        prefix_caching=True,
    ),
    "graph-step": dict(
        hbm_cache_bytes=2 * 24 * BLOCK_BYTES,
        dram_bytes=64 * BLOCK_BYTES,
        max_batch=3,
        cuda_graphs=True,
        token_budget=64,
    ),
}

SUBMIT = st.tuples(st.just("submit"), st.integers(1, 70), st.integers(1, 8), st.booleans())  # length, new, sample
STEP = st.tuples(st.just("step"), st.integers(1, 6))  # how many
CANCEL = st.tuples(st.just("cancel"), st.integers(0, 7))  # which submitted request (modulo)
FAULT = st.tuples(st.just("fault"), st.sampled_from(SITES), st.sampled_from(["raise", "oom", "nan"]))
STREAM = st.tuples(st.just("stream"), st.integers(1, 70), st.integers(1, 4))  # length, events read before a break
OPERATIONS = st.lists(st.tuples(st.one_of(SUBMIT, STEP, CANCEL, FAULT, STREAM), st.booleans()), min_size=1, max_size=24)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on tensors this small two threads only add sync overhead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Run:
    """One engine under a sequence of operations, with the events it gave so far."""

    def __init__(self, model, pool: str) -> None:
        config = SparseServeConfig(**(dict(block_size=16, token_budget=48) | POOLS[pool]))
        self.gen = Generator(model, None, config)
        self.submitted: list[int] = []
        self.events: list = []
        self.ended: set[int] = set()
        self.faults: list[Fault] = []
        self.seed = 0

    def apply(self, operation: tuple, mp: pytest.MonkeyPatch) -> None:
        kind = operation[0]
        if kind == "submit":
            self.submit(*operation[1:])
        elif kind == "step":
            for _ in range(operation[1]):
                self.record(self.gen.step())
        elif kind == "cancel" and self.submitted:
            self.gen.cancel(self.submitted[operation[1] % len(self.submitted)])
        elif kind == "fault":
            _, site, how = operation
            mp.undo()  # one armed fault at a time
            fault = Fault(at=1, kind=how if site == "head" or how != "nan" else "raise")
            arm(mp, self.gen, site, fault, layer=len(self.faults) % 2)
            self.faults.append(fault)
        elif kind == "stream":
            self.read_stream(*operation[1:])

    def read_stream(self, length: int, to_read: int) -> None:
        """`stream` one prompt and stop reading after `to_read` events: its request, unless it
        ended by then, ends with the stream and must never be heard of again."""
        self.seed += 1
        stream = self.gen.stream([self.prompt(length)], SamplingParams(max_new_tokens=8))
        for count, event in enumerate(stream, 1):
            self.record([event])
            if count == to_read:
                break
        self.ended.add(event.request_id)

    def submit(self, length: int, new_tokens: int, sample: bool) -> None:
        self.seed += 1
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.8 if sample else 0.0, seed=self.seed)
        try:
            self.submitted.append(self.gen.submit(self.prompt(length), params))
        except ValueError as exc:  # can never fit the small pools: refused, nothing changes
            assert "fit" in str(exc) or "DRAM" in str(exc), exc

    def prompt(self, length: int) -> list[int]:
        """A random prompt; with prefix caching, a shared start and one token of its own."""
        if not self.gen.config.prefix_caching:
            return prompt(length, seed=self.seed)
        return SHARED_START[: length - 1] + [1 + self.seed % 200]

    def record(self, events: list) -> None:
        for event in events:
            assert event.request_id not in self.ended, f"an event after request {event.request_id} ended"
            if event.finished:
                self.ended.add(event.request_id)
        self.events += events

    def check_blocks(self) -> None:
        """Reference counts agree with the pool, no block is shared, the HBM cache stays in its bytes."""
        store, config = self.gen.store, self.gen.config
        refcount = store.dram.refcount
        assert torch.equal(refcount, listed_references(self.gen))
        assert int((refcount > 0).sum()) == store.dram.num_used
        if config.offload and config.hbm_cache_bytes is not None:
            assert store.block_cache_bytes() <= config.hbm_cache_bytes


def listed_references(gen: Generator) -> torch.Tensor:
    """Per DRAM block: the tables (every cache's rows) and prefix-index entries that list it."""
    counts = torch.zeros_like(gen.store.dram.refcount)
    caches = [gen.batch] + [r.cache for r in gen._requests.values() if r.cache is not None]
    for layer in (layer for cache in caches for layer in cache.layers if layer.is_initialized):
        for row in range(layer.block_ids.shape[0]):
            ids = layer.block_ids[row, :, : int(layer.num_blocks[row])].flatten().cpu()
            counts.index_add_(0, ids, torch.ones_like(ids, dtype=counts.dtype))
    if gen.prefixes is not None:
        for bucket in gen.prefixes.index._buckets.values():
            for entry in bucket:
                counts.index_add_(0, entry.ids.flatten(), torch.ones(entry.ids.numel(), dtype=counts.dtype))
    return counts


@settings(
    deadline=None, max_examples=250, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(pool=st.sampled_from(list(POOLS)), operations=OPERATIONS)
def test_block_bookkeeping_holds_under_any_operations(llama, pool, operations):
    run = Run(llama, pool)
    with pytest.MonkeyPatch.context() as mp:
        for operation, inference in operations:
            with torch.inference_mode(inference):
                run.apply(operation, mp)
            run.check_blocks()
        mp.undo()
        run.record(drain(run.gen))
    outputs = ended_once(run.events, run.submitted)
    if not any(fault.fired for fault in run.faults):
        assert all(output.finish_reason != "error" for output in outputs.values())
    run.check_blocks()
    if run.gen.prefixes is not None:
        assert run.gen.prefixes.index.pinned_blocks() == 0  # every ended request let its prefix go
        run.gen.prefixes.index.clear()
    assert_drained(run.gen)
