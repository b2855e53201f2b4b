"""Where the HBM block-cache lookup's time goes: its five phases, timed inside the kernel.

    python -m eval.bench.resolve_phases --out eval/results/resolve_phases.json   # one GPU
    python -m eval.bench.resolve_phases --dry-run                                  # tiny shapes, CPU (no clocks)

The lookup (`triton_resolve.resolve_`) runs one program per partition (a layer's KV head) whose
phases are separated by CTA barriers. This script builds an instrumented copy of the kernel at run
time: the kernel module's source with a read of the SM's cycle counter (`%clock64`) stored before
each phase's leading comment and before the one-tile routine returns. The shipped kernel stays
free of probes; if the comments it keys on move, the script stops with an error naming the one
it missed.

Workload: the decode step's shape at B=16 x 32K (8 KV heads, 252 entries per row and head of
which 95 are picked blocks, 4,072 slots per partition), each (row, head) picking from a working
set of 160 of its 1,018 blocks that drifts by 1% a step, so the hit rate settles near the
real-locality runs' ~0.98. For each warp count it reports the whole launch of the instrumented copy
as `triton.testing` times it (alone on the GPU, L2 flushed before each launch) and each phase's
mean over programs in microseconds at the SM clock `torch.cuda` reports.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

from eval.bench.common import pick_device, prepare_triton, run_record

PHASES = ("hits_and_claims", "appends", "victims", "install_and_read", "order")
_MARKERS = (
    "    # 1. hits",
    "    # 2. the claiming",
    "    # 3. victims",
    "    # 4. install",
    "    # 5. the eviction",
    "    return distinct_hits",
)
_CLOCK = """
@triton.jit
def _clock(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)

"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (no clocks on CPU)")
    return parser.parse_args(argv)


def instrumented_source(source: str) -> str:
    """`triton_resolve`'s source with clock stores at the one-tile phases and a `clocks_ptr`
    argument threaded from the kernel, plus `num_warps=MAX_WARPS` exactly. ValueError names a
    marker the source no longer has."""

    def replace_once(text: str, old: str, new: str) -> str:
        if old not in text:
            raise ValueError(f"triton_resolve changed: {old.strip()[:60]!r} not found")
        return text.replace(old, new, 1)

    start, end = source.index("def _resolve_one_tile"), source.index("def _resolve_tiled")
    body = source[start:end]
    for index, marker in enumerate(_MARKERS):
        body = replace_once(body, marker, f"    tl.store(clocks_ptr + head * 8 + {index}, _clock(head))\n{marker}")
    body = replace_once(body, "    BLOCK: tl.constexpr,\n):", "    BLOCK: tl.constexpr,\n    clocks_ptr,\n):")
    text = source[:start] + body + source[end:]
    text = replace_once(
        text, "    num_entries,\n    per_partition,", "    clocks_ptr,\n    num_entries,\n    per_partition,"
    )
    text = replace_once(
        text,
        "stride_head, BLOCK,\n        )  # fmt: skip\n    else:",
        "stride_head, BLOCK, clocks_ptr,\n        )  # fmt: skip\n    else:",
    )
    text = replace_once(text, "num_entries, per, width,", "CLOCKS, num_entries, per, width,")
    text = replace_once(text, "num_warps=max(4, min(MAX_WARPS, block // 256))", "num_warps=MAX_WARPS")
    return replace_once(text, "@triton.jit\ndef _resolve_kernel(", _CLOCK + "\n@triton.jit\ndef _resolve_kernel(")


def load_instrumented() -> Any:
    """The instrumented module, loaded as a sibling of `triton_resolve` (its relative imports resolve)."""
    from sparseserve_hf.ops import triton_resolve

    path = Path(triton_resolve.__file__)
    source = instrumented_source(path.read_text())
    probe_path = path.with_name("_resolve_phases_probe.py")
    probe_path.write_text(source)  # Triton reads a jit function's source from its file
    try:
        spec = importlib.util.spec_from_file_location("sparseserve_hf.ops._resolve_phases_probe", probe_path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        probe_path.unlink()
    return module


def lookups(
    batch: int, heads: int, steps: int, device: torch.device, blocks: int, width: int, picks: int, working: int
):
    """`steps` (B, H, width) DRAM-id selections: each (row, head) picks `picks` of a drifting working set."""
    base = (torch.arange(batch, device=device)[:, None] * heads + torch.arange(heads, device=device)) * blocks
    members = torch.stack([torch.randperm(blocks, device=device)[:working] for _ in range(batch * heads)])
    members = members.view(batch, heads, working)
    for _ in range(steps):
        drift = torch.rand(members.shape, device=device) < 0.01
        members = torch.where(drift, torch.randint(0, blocks, members.shape, device=device), members)
        pick = torch.rand(members.shape, device=device).argsort(-1)[..., :picks]
        ids = torch.full((batch, heads, width), -1, dtype=torch.long, device=device)
        ids[..., :picks] = torch.gather(members, -1, pick) + base[..., None]
        yield ids


def time_phases(probe: Any, warps: int, selections: list[torch.Tensor], tables: Any, counts: torch.Tensor) -> dict:
    """The instrumented lookup at `warps` warps over `selections` (cycled): its launch time and
    the mean time of each phase over its programs, in microseconds."""
    import triton

    probe.MAX_WARPS = warps
    heads = selections[0].shape[1]
    cycle = itertools.cycle(selections)
    probe.CLOCKS = torch.zeros(heads * 8, dtype=torch.long, device=counts.device)
    launch_us = 1000 * triton.testing.do_bench(lambda: probe.resolve_(next(cycle), 0, tables, counts))
    for _ in range(3):  # the last launch's clocks count
        probe.resolve_(next(cycle), 0, tables, counts)
    torch.cuda.synchronize()
    stamps = probe.CLOCKS.view(heads, 8)[:, : len(_MARKERS)].double()
    cycles_per_us = torch.cuda.get_device_properties(counts.device).clock_rate / 1000  # kHz -> per us
    phase_us = ((stamps[:, 1:] - stamps[:, :-1]) / cycles_per_us).mean(0).tolist()
    return {"launch_us": launch_us, "phase_us": dict(zip(PHASES, phase_us)), "phases_total_us": sum(phase_us)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = pick_device(args.dry_run)
    prepare_triton(device)
    from sparseserve_hf.ops import lru, triton_resolve

    blocks, width, picks, working, per = 1018, 252, 95, 160, 4072
    if args.dry_run:
        args.batch, args.heads, args.warps = 2, 2, [4]
        blocks, width, picks, working, per = 40, 12, 6, 9, 24
    torch.manual_seed(0)
    tables = lru.empty_tables(args.heads, per, args.batch * args.heads * blocks, device)
    counts = torch.zeros(2, dtype=torch.long, device=device)
    selections = list(lookups(args.batch, args.heads, 140, device, blocks, width, picks, working))
    for ids in selections[:40]:  # the cache fills and its hit rate settles
        triton_resolve.resolve_(ids, 0, tables, counts)
    counts.zero_()
    for ids in selections[40:80]:
        triton_resolve.resolve_(ids, 0, tables, counts)
    hit_rate = 1 - counts[1].item() / max(counts[0].item(), 1)
    probe = None if device.type != "cuda" else load_instrumented()
    rows = []
    for warps in args.warps:
        row = {"warps": warps} | ({} if probe is None else time_phases(probe, warps, selections[80:], tables, counts))
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = run_record(device) | {
        "workload": {"batch": args.batch, "kv_heads": args.heads, "entries_per_row": width, "picked_per_row": picks,
                     "slots_per_partition": per, "hit_rate": hit_rate},
        "rows": rows,
    }  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
