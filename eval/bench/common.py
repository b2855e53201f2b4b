"""What the kernel benchmarks share: timing, the run record, the table and the JSON file.

Every script measures its baseline in the same process and records the device, the command
line and the git commit beside its numbers. `--dry-run` runs tiny shapes on any machine (the
kernels under TRITON_INTERPRET=1 without a GPU) so the scripts are tested on CPU.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eval.common import parse_variant

# A child process's allocator setting (it must precede CUDA's first use): stock's DynamicCache,
# which allocates a larger KV tensor per layer every step, maps and unmaps less under it.
EXPANDABLE_SEGMENTS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def add_config_overrides(parser: argparse.ArgumentParser, example: str) -> None:
    """The repeatable `--set FIELD=VALUE` option (into `args.overrides`; `config_overrides` reads it)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"a SparseServeConfig field other than the defaults (repeatable), e.g. {example}",
    )


def add_knob_option(parser: argparse.ArgumentParser, example: str) -> None:
    """The repeatable `--knob MODULE.NAME=VALUE` option (into `args.knob`; `apply_knobs` sets them)."""
    parser.add_argument(
        "--knob",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help=f"a kernel launch constant of sparseserve_hf.ops (repeatable, recorded), e.g. {example}",
    )


def config_overrides(settings: list[str]) -> dict[str, Any]:
    """`--set` FIELD=VALUE options -> SparseServeConfig overrides (validated; ValueError names a bad one)."""
    if not settings:
        return {}
    return parse_variant(":".join(("set", *settings)))[1]


def apply_knobs(knobs: list[str]) -> dict[str, Any]:
    """Set each `MODULE.NAME=VALUE` on `sparseserve_hf.ops.MODULE` (or `sparseserve_hf.MODULE` where
    ops has none; MODULE may be dotted: `cache.block_cache.FREE_AHEAD=0`); returns {"MODULE.NAME": value}. ValueError names a knob that is malformed or
    names no existing constant."""
    applied = {}
    for knob in knobs:
        target, sep, text = knob.partition("=")
        module_name, dot, name = target.rpartition(".")
        if not (sep and dot and name and module_name):
            raise ValueError(f"knob {knob!r}: expected MODULE.NAME=VALUE, e.g. triton_decode.PROGRAMS_PER_SM=2")
        package = "sparseserve_hf.ops" if _has_module(f"sparseserve_hf.ops.{module_name}") else "sparseserve_hf"
        module = importlib.import_module(f"{package}.{module_name}")
        if not hasattr(module, name) or not name.isupper():
            raise ValueError(f"knob {knob!r}: {package}.{module_name} has no constant {name}")
        value = ast.literal_eval(text)
        setattr(module, name, value)
        applied[target] = value
    return applied


def _has_module(name: str) -> bool:
    """Whether the dotted module `name` exists (False where a parent package does not)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def json_child(module: str, args: list[str], env: dict[str, str], check: bool = False) -> Any:
    """`python -m module *args` in a fresh process with `env` added: the JSON its last stdout line
    holds. A failed child raises with `check`, else prints why and gives None."""
    command = [sys.executable, "-m", module, *args]
    done = subprocess.run(command, env=os.environ | env, capture_output=True, text=True, check=check, timeout=900)
    if done.returncode != 0:
        print(f"{module} {' '.join(args)} failed (exit {done.returncode}): {done.stderr[-500:]}")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def prepare_triton(device: torch.device) -> None:
    """Without a GPU, run kernels in Triton's interpreter (set before any kernel module is imported)."""
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pick_device(dry_run: bool) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not dry_run:
        raise SystemExit("this benchmark needs a CUDA device (use --dry-run for a tiny CPU run)")
    return torch.device("cpu")


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 10, rep: int = 50) -> float:
    """Median milliseconds of `fn()`: CUDA events with a flushed L2 (triton.testing.do_bench) on a GPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def graph_ms(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Median milliseconds of one replay of `fn()` captured in a CUDA graph: the GPU's time alone.

    A captured decode step pays exactly this; `time_ms` adds the host's kernel launches, which
    dominate small multi-kernel functions. None where `fn` cannot be captured (or on CPU).
    """
    if device.type != "cuda":
        return None
    from triton.testing import do_bench_cudagraph

    try:
        return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))
    except RuntimeError as exc:  # e.g. an op that syncs with the host
        print(f"not capturable ({type(exc).__name__}: {str(exc).splitlines()[0]}): no graph time")
        torch.cuda.synchronize(device)
        return None


def wall_ms(fn: Callable[[], Any], device: torch.device, repeats: int = 5) -> float:
    """Median wall-clock milliseconds of `fn()` with the device synchronized around each call
    (for work that ends on CPU threads, which CUDA events do not see)."""
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[1:])[len(times[1:]) // 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _git_head() -> str:
    """This checkout's HEAD commit, or "" outside git."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True)
    except OSError:
        return ""
    return done.stdout.strip()


def current_commit() -> str:
    """The commit the numbers are taken at: $SPARSESERVE_COMMIT where set (the GPU machine receives a
    copy of the working tree whose .git is not this checkout's: the scripts pass the local HEAD on),
    else this checkout's HEAD."""
    return os.environ.get("SPARSESERVE_COMMIT") or _git_head()


def run_record(device: torch.device) -> dict[str, Any]:
    """Where and how the numbers were taken (the commit: `current_commit`)."""
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "command": " ".join([Path(sys.executable).name, "-m", _module_name(), *sys.argv[1:]]),
        "git_commit": current_commit(),
        "torch": torch.__version__,
        "triton": _triton_version(),
    }


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(_fmt(row.get(c)).rjust(w) for c, w in zip(columns, widths)))


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return "" if value is None else str(value)


def _module_name() -> str:
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else sys.argv[0]


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def reset_peak(device: torch.device) -> None:
    """Start a new peak of device allocations (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """The peak of device allocations since `reset_peak`, in GiB (None off CUDA)."""
    return torch.cuda.max_memory_allocated(device) / (1 << 30) if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    """Hand back what the last system left: reference cycles, cached device blocks, cached pinned
    host blocks (PyTorch keeps freed pinned blocks, rounded up to a power of two)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()


def timed_generate(model, prompts: torch.Tensor, new_tokens: int, cache: Any = None) -> float:
    """Wall seconds of one greedy `generate` of exactly `new_tokens` over `prompts` (B, T), into
    `cache` when given (else the model's default cache)."""
    kwargs = {} if cache is None else {"past_key_values": cache}
    sync(prompts.device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs
        )
    sync(prompts.device)
    return time.perf_counter() - start


def model_shape(dry_run: bool) -> tuple[str, torch.dtype]:
    """The benchmarked model: the Llama-3-8B shape in bf16, or the tiny one in fp32 for a dry run."""
    return ("tiny", torch.float32) if dry_run else ("llama3-8b", torch.bfloat16)


def bench_setup(dry_run: bool) -> tuple[torch.device, str, torch.dtype]:
    """A model benchmark's device (kernels interpreted without a GPU) and model shape and dtype."""
    device = pick_device(dry_run)
    prepare_triton(device)
    return (device, *model_shape(dry_run))


@contextlib.contextmanager
def profiled_region(enabled: bool):
    """A torch profiler over the region (CPU and, where present, CUDA activity), or nothing."""
    if not enabled:
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        yield profiler


def write_profile(profiler, path: str, title: str) -> None:
    """The profile's top operations by device time and by host time, as markdown tables under `title`."""
    averages = profiler.key_averages()
    device_key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    parts = [f"# {title}", ""]
    for kind, key in (("device time", device_key), ("host time", "self_cpu_time_total")):
        parts += [f"## top operations by {kind}", "", "```", averages.table(sort_by=key, row_limit=30), "```", ""]
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text("\n".join(parts))
