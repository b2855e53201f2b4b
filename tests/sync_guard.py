"""Catch host syncs and data-dependent shapes on CPU: ops a decode step must not run.

On CUDA, `torch.cuda.set_sync_debug_mode("error")` catches host syncs directly. On CPU nothing
syncs, so `forbid_host_syncs` looks for the ops that would: every scalar read-back
(`.item()`, `bool(t)`, `int(t)`, `.tolist()`) and every op whose output shape depends on the
data (`nonzero`, `unique`, `masked_select`, boolean-mask indexing, `repeat_interleave` by a
tensor). Such an op needs the device's result on the host before the next launch. Also a Python
number assigned through indexing (`t[idx] = -1`): CUDA copies it to the device from pageable host
memory first, which syncs (`index_fill_` / `masked_fill_` take the scalar as a kernel argument).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
DATA_DEPENDENT = {
    aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    aten.nonzero.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
}
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
READ_BACK_METHODS = {"tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class _DispatchGuard(TorchDispatchMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in DATA_DEPENDENT:
            self.seen.append(str(func))
        elif func in INDEXING:
            indices = args[1] if len(args) > 1 else []
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.seen.append(f"{func} with a boolean mask")
        return func(*args, **(kwargs or {}))


class _FunctionGuard(TorchFunctionMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READ_BACK_METHODS:
            self.seen.append(f"Tensor.{name}")
        elif name == "__setitem__" and len(args) > 2 and not isinstance(args[2], torch.Tensor):
            self.seen.append("Tensor.__setitem__ with a Python scalar")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def forbid_host_syncs() -> Iterator[list[str]]:
    """Record every forbidden op run inside the block; the caller asserts the list is empty."""
    seen: list[str] = []
    with _FunctionGuard(seen), _DispatchGuard(seen):
        yield seen
