"""The selection-trace replay's Triton gather against its PyTorch form (`TraceReplay._gather`)."""

from __future__ import annotations

import numpy as np
import torch
from eval.bench.selection_trace import SelectionTrace, TraceReplay
from eval.bench.trace_replay_kernel import replay_step

from kernel_support import DEVICE


def test_kernel_hands_out_what_the_pytorch_gather_does_call_after_call():
    rng = np.random.default_rng(4)
    loaded = rng.random((2, 5, 2, 2, 30)) < 0.3  # (prompts, steps, layers, heads, blocks)
    loaded[..., 0] = loaded[..., -2:] = True  # sink 1, window 2
    trace = SelectionTrace(loaded, np.full((2, 5), 30), 1, 2, {"synthetic": True})
    torch_side = TraceReplay(trace, num_layers=3, num_kv_heads=3, device=DEVICE)
    kernel_side = TraceReplay(trace, num_layers=3, num_kv_heads=3, device=DEVICE)
    rows = torch.tensor([90, 45, 31], device=DEVICE)
    plan = kernel_side.plan(rows, 24)
    kernel_side._plans[(3, 24)] = torch_side._plans[(3, 24)] = plan
    for call in range(7):
        grown = rows + call // 3  # rows gain blocks: window blocks follow, the middle stays
        grown[1] -= 20  # and a row shorter than its plan's anchor: picks are clamped into it
        for layer in range(3):
            want_picked, want_valid = torch_side._gather(plan, layer, grown)
            picked, valid = replay_step(plan.picked, kernel_side.calls, layer, grown, plan.anchor, plan.window_from)
            assert torch.equal(picked, want_picked) and torch.equal(valid, want_valid), (call, layer)
    assert torch.equal(kernel_side.calls, torch_side.calls)
