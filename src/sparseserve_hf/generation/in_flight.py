"""A decode step launched on the device and not read back yet (the `Generator`'s decode ahead).

The `Generator` reads each decode step's sampled tokens back to the host (one sync per step), and
on a GPU whatever the host does between that read-back and the next launch leaves the device
idle: building the next step's inputs, admission, and the launch of a captured step itself (a
whole-model CUDA graph of ~1,000 kernels holds the host until its kernels are queued).
With `SparseServeConfig.decode_ahead` the next step is launched first, from inputs that never
leave the device (the sampled tokens, one position on), and this step's results are copied to
pinned host memory behind an event recorded before that launch: the read-back then waits for
this step only, while the next one runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request


@dataclass
class InFlightStep:
    """One launched decode step: its rows and what its read-back will hold.

    Attributes:
        held: (slot, request) of every held row, in slot order.
        result: (2, B) long, the sampled token (-1 where the logits were not finite) and the
            working set in head-blocks of each held row; pinned host memory on CUDA, filled once
            `done` has passed.
        done: recorded after the copy into `result` (None on CPU, where the step already ran).
        chosen, inputs: its sampled tokens (B,) and its inputs, from which `next_inputs` builds the
            following step's (only when one is launched ahead).
        admitted_bytes, sat_out: for a step launched ahead, the working-set bytes admission took for
            it and the decoding requests it left out (the iteration's record).
    """

    held: list[tuple[int, Request]]
    result: torch.Tensor
    done: torch.cuda.Event | None
    chosen: torch.Tensor
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    admitted_bytes: int = 0
    sat_out: int = 0

    @classmethod
    def launched(
        cls,
        held: list[tuple[int, Request]],
        chosen: torch.Tensor,
        working_sets: torch.Tensor,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> InFlightStep:
        """The step whose sampling gave `chosen` (B,) and `working_sets` (B,) of the held rows, fed by
        `inputs` (tokens, positions, steps (rows,), held slots (B,)): queue the copy of its results
        (no host sync)."""
        result = torch.stack((chosen, working_sets.to(chosen.device)))  # (2, B)
        done = None
        if result.device.type == "cuda":
            host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
            host.copy_(result, non_blocking=True)
            result, done = host, torch.cuda.Event()
            done.record()
        return cls(held, result, done, chosen, inputs)

    def next_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The following step's (tokens, positions, steps) (rows,) and held slots (B,), on the device:
        the sampled tokens (a non-finite row's -1 read as 0: never fed to the embedding), every
        held row one position and one decode step on. Launches only (no host sync)."""
        tokens, positions, steps, at = self.inputs
        next_tokens, next_positions, next_steps = tokens.clone(), positions.clone(), steps.clone()
        next_tokens[at] = self.chosen.clamp(min=0)
        next_positions[at] += 1
        next_steps[at] += 1
        return next_tokens, next_positions, next_steps, at

    def wait(self) -> None:
        """Block until the step and the copy of its results are done."""
        if self.done is not None:
            self.done.synchronize()

    def read(self) -> tuple[list[int], list[int]]:
        """Each held row's token and working set (the step's one wait on the device)."""
        if self.done is not None:
            self.done.synchronize()
        tokens, blocks = self.result.tolist()
        return tokens, blocks
