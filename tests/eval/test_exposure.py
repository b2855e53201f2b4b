"""eval.bench.exposure: exposed, shared and idle time on a timeline of overlapping kernels."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from eval.bench import profile_step
from eval.bench.exposure import exposure_table, exposures
from torch.autograd.profiler_util import Interval


def test_a_kernel_beside_another_shares_the_overlap_and_the_rest_is_exposed():
    # attention 0-100 with a lookup 20-60 beside it, a gap, then a GEMM 110-150
    rows, idle, wall = exposures([(0, 100, "attention"), (20, 60, "lookup"), (110, 150, "gemm")])
    by_name = {row.name: row for row in rows}
    assert by_name["attention"].exposed_us == 60 and by_name["attention"].shared_us == 20
    assert by_name["lookup"].exposed_us == 0 and by_name["lookup"].shared_us == 20
    assert by_name["gemm"].exposed_us == 40 and by_name["gemm"].shared_us == 0
    assert idle == 10 and wall == 150
    assert [row.name for row in rows] == ["attention", "gemm", "lookup"]  # largest total first


def test_back_to_back_kernels_do_not_overlap_and_empty_ones_count_as_calls():
    rows, idle, wall = exposures([(0, 10, "a"), (10, 30, "b"), (30, 30, "c"), (30, 35, "a")])
    by_name = {row.name: row for row in rows}
    assert (by_name["a"].exposed_us, by_name["a"].calls) == (15, 2)
    assert by_name["b"].exposed_us == 20 and by_name["c"].total_us == 0 and by_name["c"].calls == 1
    assert idle == 0 and wall == 35 and exposures([]) == ([], 0.0, 0.0)
    rows, idle, wall = exposures([(0, 10, "a"), (20, 20, "z"), (30, 25, "y")])  # empty ones past the last end
    assert (idle, wall) == (0, 10) and {row.name: row.calls for row in rows} == {"a": 1, "z": 1, "y": 1}
    (only,), idle, wall = exposures([(5, 5, "z")])
    assert (only.calls, only.total_us, idle, wall) == (1, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("seed", range(5))
def test_exposed_shared_and_idle_add_up_to_the_wall_time(seed):
    """On random timelines, against a brute-force count over 1-us ticks (integer edges)."""
    rng = random.Random(seed)
    intervals = []
    for _ in range(12):
        start = rng.randrange(0, 200)
        intervals.append((start, start + rng.randrange(1, 40), rng.choice("abcde")))
    rows, idle, wall = exposures(intervals)
    exposed = {row.name: row.exposed_us for row in rows}
    shared = {row.name: row.shared_us for row in rows}
    want_exposed, want_shared, want_idle = dict.fromkeys(exposed, 0.0), dict.fromkeys(shared, 0.0), 0.0
    first, last = min(s for s, _, _ in intervals), max(e for _, e, _ in intervals)
    for tick in range(first, last):
        running = [name for start, end, name in intervals if start <= tick < end]
        if not running:
            want_idle += 1
        elif len(running) == 1:
            want_exposed[running[0]] += 1
        else:
            for name in running:
                want_shared[name] += 1 / len(running)
    assert idle == want_idle and wall == last - first
    assert exposed == pytest.approx(want_exposed) and shared == pytest.approx(want_shared)
    assert sum(exposed.values()) + sum(shared.values()) + idle == pytest.approx(wall)


def test_the_table_is_per_layer():
    text = exposure_table([(0, 100, "attention"), (20, 60, "lookup"), (110, 150, "gemm")], per=2)
    assert "wall time per layer 75.0 us: kernels alone 50.0, overlapping 20.0, GPU idle 5.0" in text
    assert "| 30.0 | 10.0 | 0.5 | `attention` |" in text


def _event(name: str, start: float, end: float, stream: int = 7):
    """A device event as torch.profiler's FunctionEvent carries it (name, time range, stream)."""
    return SimpleNamespace(name=name, time_range=Interval(start, end), device_resource_id=stream)


def test_the_layer_timeline_runs_from_one_marker_to_the_next_inside_the_last_step():
    """Layers of 100 us, each starting with the rotary kernel, with attention beside a lookup on
    another stream; the table is the second-to-last layer, and the intervals feed the exposure."""
    events = []
    for layer in range(4):
        origin = 100.0 * layer
        events += [_event("_rope_kernel", origin, origin + 2), _event("_block_lse_mma_kernel", origin + 3, origin + 50)]
        events += [
            _event("_decode_split_kernel", origin + 50, origin + 90, 164),
            _event("_install", origin + 55, origin + 70),
        ]
    text = profile_step.layer_timeline(events)
    assert "from `_rope_kernel` to the next): 100.0 us of wall time" in text
    assert "| 0.0 | 2.0 | 7 | `_rope_kernel` |" in text and "| 50.0 | 40.0 | 164 | `_decode_split_kernel` |" in text
    assert text.count("_block_lse_mma_kernel") == 1  # one layer only
    assert profile_step.layer_timeline(events[:8]) == ""  # fewer than three markers: no whole layer inside
    table = exposure_table(profile_step.kernel_intervals(events), per=4)
    assert (
        "| 47.0 | 0.0 | 1.0 | `_block_lse_mma_kernel` |" in table and "GPU idle 8.5" in table
    )  # 1 us per layer + 10 between layers
