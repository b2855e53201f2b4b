"""`grown`: every growable table of the cache goes through it."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from sparseserve_hf.cache.grow import grown


def test_grown_keeps_the_old_entries_and_fills_the_new_ones_along_any_dim():
    table = torch.arange(6).view(2, 3)
    assert torch.equal(grown(table, 4, fill=-1), torch.tensor([[0, 1, 2], [3, 4, 5], [-1, -1, -1], [-1, -1, -1]]))
    assert torch.equal(grown(table, 5, fill=7, dim=1), torch.tensor([[0, 1, 2, 7, 7], [3, 4, 5, 7, 7]]))
    assert grown(table, 2) is table and grown(table, 1) is table


def test_growing_from_empty_allocates_the_table_once():
    """The metadata starts empty and grows to the whole DRAM pool: no second table-sized buffer."""
    empty = torch.zeros((0, 6, 64))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = grown(empty, 4096)
    table_bytes = out.numel() * out.element_size()
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    assert out.shape == (4096, 6, 64) and table_bytes <= allocated < 1.5 * table_bytes
