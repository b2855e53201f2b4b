"""Cache state is made of plain tensors: created and changed outside inference mode, never tracked by autograd."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def plain_tensors(fn: F) -> F:
    """Run `fn` with inference mode and autograd off (a no-op wrapper when both are off already).

    Every method that creates or changes cache state goes through this. A tensor created under
    `torch.inference_mode()` (as the examples run `generate`) is an inference tensor, and an
    inference tensor can never be updated in place outside inference mode again; the cache
    updates its tables in place (reference counts, tails, block tables, the LRU), so a cache first
    used inside inference mode failed outside it, and in its `reset()`. `DynamicCache` escapes this
    only because it concatenates instead. Tensors created here are normal tensors, which may be
    updated in place in any mode, inference mode included. Autograd is off because stored keys
    and values are data: a tail written from keys that require grad would carry a graph that grows
    with every step and could never be backpropagated through the DRAM pool anyway.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.is_inference_mode_enabled() and not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        # inference_mode(False) turns grad mode back on: no_grad must come after it.
        with torch.inference_mode(False), torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
