"""How much host memory is left, so that large host allocations are refused with an error, not OOM-killed."""

from __future__ import annotations

import os

HOST_MEMORY_HEADROOM = 0.10  # of MemAvailable, left to everything else the process still allocates


def available_host_bytes() -> int | None:
    """Host memory the kernel can still hand out without swapping (MemAvailable), None when unknown.

    /proc/meminfo's MemAvailable counts reclaimable page cache; `os.sysconf` (free pages only)
    is the fallback off Linux.
    """
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_host_bytes(nbytes: int, what: str, remedy: str) -> None:
    """Raise ValueError naming `what` when `nbytes` of host memory would not fit in what is available.

    Why up front: an unpinned pool is only overcommitted address space until it is written, and
    a pinned one is faulted in at once, so past the host's memory the first sign would otherwise
    be the kernel's OOM killer ending the process, not an error. HOST_MEMORY_HEADROOM of the
    available memory stays for the model, activations and whatever else the process allocates.
    """
    available = available_host_bytes()
    if available is None:
        return
    usable = int(available * (1 - HOST_MEMORY_HEADROOM))
    if nbytes > usable:
        raise ValueError(
            f"{what} needs {nbytes} bytes of host memory, but only {available} are available "
            f"({usable} after a {HOST_MEMORY_HEADROOM:.0%} headroom); {remedy}"
        )
