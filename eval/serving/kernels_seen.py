"""Triton kernels a process meets for the first time while a run is timed.

A warm-up is meant to leave no kernel compilation inside the timed run, but it only reaches the
shapes it serves: a specialization first needed later (another batch size, another table width)
is compiled (or loaded from Triton's disk cache) mid-run, and shows as a gap between tokens. Triton
calls `knobs.runtime.jit_cache_hook` exactly when a JIT function meets a specialization its
in-process cache lacks; recording those calls says what the warm-up missed, and when.
"""

from __future__ import annotations

import re
import time
from typing import Any

from typing_extensions import Self


class KernelsFirstSeen:
    """Context manager: `events`, one `{"t_s", "kernel", "specialization"}` per specialization first met
    inside the block (seconds from entering it; `kernel` is Triton's repr: qualified name, launch
    options, argument types; `specialization` its cache key's argument part, where Triton gives one).
    Any hook installed before is still called (its answer is Triton's: truthy skips the launch), and
    put back on exit. `events` is None where no hook could be installed (no Triton, or
    one without `knobs`): nothing was watched, which is not "nothing was compiled"."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] | None = None
        self._start = 0.0
        self._knobs: Any = None
        self._before: Any = None

    def __enter__(self) -> Self:
        self._start = time.perf_counter()
        try:
            from triton import knobs
        except ImportError:  # no Triton, or one older than its knobs: nothing is watched
            return self
        self.events = []
        self._knobs, self._before = knobs, knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._seen
        return self

    def __exit__(self, *exc: object) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_cache_hook = self._before

    def _seen(self, *args: Any, **kwargs: Any) -> bool | None:
        """Triton's hook: a truthy answer would skip the compilation, so only the earlier hook answers."""
        name = kwargs.get("repr") or getattr(kwargs.get("fn"), "name", "?")
        event = {"t_s": round(time.perf_counter() - self._start, 4), "kernel": str(name)}
        if kwargs.get("key") is not None:
            event["specialization"] = _specialization(kwargs["key"])
        self.events.append(event)
        return self._before(*args, **kwargs) if self._before is not None else None


def _specialization(key: Any) -> str:
    """What tells two specializations of one kernel apart: Triton's cache key without its launch options
    (the `kernel` repr names those). The repr's own argument list cannot: some Triton versions (3.6)
    build it by pairing the arguments with the characters of a string key."""
    return re.sub(r"\w*Options\(.*", "", str(key), flags=re.DOTALL)
