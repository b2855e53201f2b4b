"""What launch plans size their grids by: the GPU's multiprocessor count, queried once per device."""

from __future__ import annotations

import functools

import torch


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (the current one where `device` names no index)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
