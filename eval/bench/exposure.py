"""Which kernels a step waits for: each kernel's exposed time on a timeline of overlapping launches.

A profile's summed kernel times overstate a step whose streams overlap (the lookup beside attention,
the up projection beside the gate), and they hide the gaps where the GPU runs nothing. Cutting the
timeline at every kernel's start and end gives pieces in which a fixed set of kernels runs:
- a piece with one kernel is that kernel's **exposed** time: shortening the kernel shortens the step;
- a piece with several is **shared** time, split evenly among them;
- a piece with none is **idle** time (launch gaps, waits between streams).
Exposed + shared + idle is the window's wall time.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Exposure:
    """One kernel name's time over a window: exposed (it ran alone) and its even share of overlaps (us)."""

    name: str
    exposed_us: float
    shared_us: float
    calls: int

    @property
    def total_us(self) -> float:
        return self.exposed_us + self.shared_us


def exposures(intervals: list[tuple[float, float, str]]) -> tuple[list[Exposure], float, float]:
    """Kernels' (start_us, end_us, name) -> (each name's Exposure, largest total first; idle us;
    wall us from the first start to the last end). Zero-length or reversed intervals count as calls
    only. Each launch is one party to an overlap: two launches of one kernel side by side (e.g. two
    GEMMs on two streams) share their time."""
    if not intervals:
        return [], 0.0, 0.0
    calls: dict[str, int] = defaultdict(int)
    edges: list[tuple[float, int, int]] = []  # (time, +1 start / -1 end, interval index)
    for index, (start, end, name) in enumerate(intervals):
        calls[name] += 1
        if end > start:
            edges += [(start, 1, index), (end, -1, index)]
    if not edges:
        return [Exposure(name, 0.0, 0.0, count) for name, count in calls.items()], 0.0, 0.0
    edges.sort(key=lambda edge: (edge[0], edge[1]))  # at a tie, ends before starts: no false overlap
    exposed: dict[str, float] = defaultdict(float)
    shared: dict[str, float] = defaultdict(float)
    running: set[int] = set()
    idle, last = 0.0, edges[0][0]
    for time, kind, index in edges:
        piece = time - last
        if piece > 0:
            if not running:
                idle += piece
            elif len(running) == 1:
                exposed[intervals[next(iter(running))][2]] += piece
            else:
                for other in running:
                    shared[intervals[other][2]] += piece / len(running)
        last = time
        if kind > 0:
            running.add(index)
        else:
            running.discard(index)
    wall = edges[-1][0] - edges[0][0]
    rows = [Exposure(name, exposed[name], shared[name], count) for name, count in calls.items()]
    rows.sort(key=lambda row: (-row.total_us, -row.exposed_us, row.name))
    return rows, idle, wall


def exposure_table(intervals: list[tuple[float, float, str]], per: int, top: int = 25) -> str:
    """Markdown: the window's wall time, idle time and each kernel's exposed / shared time, per `per`
    (e.g. per layer: the profiled steps times the layers), the `top` largest by total time."""
    rows, idle, wall = exposures(intervals)
    alone, overlapping = sum(r.exposed_us for r in rows) / per, sum(r.shared_us for r in rows) / per
    head = f"wall time per layer {wall / per:.1f} us: kernels alone {alone:.1f}, overlapping {overlapping:.1f}"
    lines = [
        f"{head}, GPU idle {idle / per:.1f}\n",
        "| exposed us/layer | shared us/layer | calls/layer | kernel |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r.exposed_us / per:.1f} | {r.shared_us / per:.1f} | {r.calls / per:.1f} | `{r.name[:70]}` |"
        for r in rows[:top]
    ]
    return "\n".join(lines) + "\n"
