"""`TraceReplay`'s per-call gather as one Triton launch (the benchmark seam's own cost kept small).

A replayed decode step pays the replay on top of the selection it replaces: in PyTorch that is
about ten small kernels per layer, a visible part of a step measured in microseconds per layer.
Here one program per (row, KV head) reads the plan's entry for the layer's current step, moves
its window blocks to the row's current end and clamps it to the row's blocks, exactly as
`TraceReplay._gather` does in plain PyTorch (tested against it under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _replay_kernel(
    plan_ptr,
    calls_ptr,
    num_blocks_ptr,
    anchor_ptr,
    window_from_ptr,
    picked_ptr,
    valid_ptr,
    layer,
    recorded_layer,
    num_rows,
    num_steps,
    num_heads,
    width,
    BLOCK_U: tl.constexpr,
):
    """Grid (B * Hkv,): picked[b, h, :] and valid[b, h, :] from plan[recorded_layer, b, call, h, :]."""
    row_head = tl.program_id(0)
    b = row_head // num_heads
    h = row_head % num_heads
    call = tl.load(calls_ptr + layer) % num_steps
    u = tl.arange(0, BLOCK_U)
    inside = u < width
    offset = (((recorded_layer * num_rows + b) * num_steps + call) * num_heads + h).to(tl.int64) * width
    entry = tl.load(plan_ptr + offset + u, mask=inside, other=-1).to(tl.int64)
    count = tl.load(num_blocks_ptr + b).to(tl.int64)
    anchor = tl.load(anchor_ptr + b).to(tl.int64)
    window_from = tl.load(window_from_ptr + b).to(tl.int64)
    moved = tl.where(entry >= window_from, entry + (count - anchor), entry)
    picked = tl.maximum(tl.minimum(moved, count - 1), 0)
    out = row_head.to(tl.int64) * width + u
    tl.store(picked_ptr + out, picked, mask=inside)
    tl.store(valid_ptr + out, (entry >= 0).to(tl.int8), mask=inside)


def replay_step(
    plan: torch.Tensor,
    calls: torch.Tensor,
    layer: int,
    num_blocks: torch.Tensor,
    anchor: torch.Tensor,
    window_from: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's replayed selection; advances `calls[layer]` (two launches, no host sync).

    Args:
        plan: (L_rec, B, T, Hkv, width) int32 mapped selections, -1 unused (contiguous).
        calls: (L,) long, the calls each layer has made so far.
        layer: the model layer calling (plan layer `layer % L_rec`).
        num_blocks: (B,) the rows' full blocks now; anchor, window_from: (B, 1, 1) the plan's.
    Returns:
        picked (B, Hkv, width) long and valid (B, Hkv, width) bool.
    """
    layers, rows, steps, heads, width = plan.shape
    picked = torch.empty((rows, heads, width), dtype=torch.long, device=plan.device)
    valid = torch.empty((rows, heads, width), dtype=torch.bool, device=plan.device)
    _replay_kernel[(rows * heads,)](
        plan, calls, num_blocks, anchor, window_from, picked, valid.view(torch.int8),
        layer, layer % layers, rows, steps, heads, width, BLOCK_U=triton.next_power_of_2(max(width, 16)),
    )  # fmt: skip
    calls[layer : layer + 1].add_(1)
    return picked, valid
