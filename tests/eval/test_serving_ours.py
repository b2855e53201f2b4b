"""eval.serving.ours: a run cut at its deadline hands the next run an empty Generator."""

from __future__ import annotations

from eval.serving import ours
from eval.serving.common import Clock
from eval.serving.trace import build_trace

from sparseserve_hf import Generator, SparseServeConfig
from tiny_models import tiny_model


class TickingClock(Clock):
    """10 ms per reading, and waits that return at once: the deadline falls after a fixed number of
    the run loop's readings, whatever the machine's speed."""

    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0

    def now(self) -> float:
        self.ticks += 1
        return self.ticks * 0.01

    def wait_until(self, t: float) -> None:
        self.ticks = max(self.ticks, int(t / 0.01))


def test_a_run_cut_at_its_deadline_leaves_no_event_for_the_next_run(monkeypatch):
    """The drain after the deadline cancels what is left and takes the cancelled requests' final
    events; they used to stay queued and come out of the next run's first step."""
    monkeypatch.setattr(ours, "Clock", TickingClock)
    trace = build_trace(list(range(10, 250)), num_requests=4, prompt_range=(20, 40), output_range=(20, 30), seed=0)
    gen = Generator(tiny_model("llama"), None, SparseServeConfig(block_size=16, token_budget=48))
    cut = ours.run_generator(gen, trace, rate=100.0, deadline_s=0.3)
    assert any(record.error == "cancelled at the run's deadline" for record in cut.records)
    assert not gen.has_unfinished and gen.step() == []
    assert gen.dram_bytes_in_use() == 0 and gen.hbm_bytes_in_use() == 0
    full = ours.run_generator(gen, trace, rate=100.0)
    assert all(record.error is None for record in full.records)
    assert [len(record.token_times) for record in full.records] == [r.output_tokens for r in trace.requests]
