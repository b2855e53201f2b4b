"""How close a decode step's weight GEMMs come to the copy bandwidth, alone, merged and side by side.

    python -m eval.bench.projections --out projections.json     # one GPU: ~1 min
    python -m eval.bench.projections --dry-run                  # tiny shapes on CPU

At a decode batch's few rows every projection of a Llama layer reads its whole weight for a few
KiB of output: its floor is the weight's bytes at the copy bandwidth, which is most of a sparse
step's floor. Each projection of the Llama-3-8B shape runs as CUDA-graph replays over enough
copies of its weight that no replay finds it in L2, at each row count; then the layer's
independent projections three ways: one after another, merged into one GEMM over the rows of
both weights (q/k/v, gate/up: what a fused weight would run), and k and v (up) on a second stream
beside q (gate), as the captured step runs them. `merged_bits_equal` says whether the merged GEMM
gives each projection's own output bit for bit (what a fused weight must keep to leave the step's
tokens unchanged). `of_copy` is a GEMM's weight bytes per second over the copy bandwidth that
`eval.bench.decode_step`'s floor uses.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from eval.bench.common import graph_ms, pick_device, print_table, run_record, time_ms, write_json
from eval.bench.decode_step import bandwidths

# (out_features, in_features) of each projection of the Llama-3-8B shape
LLAMA3_8B = {
    "q": (4096, 4096),
    "k": (1024, 4096),
    "v": (1024, 4096),
    "o": (4096, 4096),
    "gate": (14336, 4096),
    "up": (14336, 4096),
    "down": (4096, 14336),
}
TINY = {"q": (64, 32), "k": (16, 32), "v": (16, 32), "o": (32, 64), "gate": (96, 32), "up": (96, 32), "down": (32, 96)}
GROUPS = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
L2_SPILL_BYTES = 256 << 20  # the weights one replay walks: several times any L2


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,32", help="comma-separated decode rows (M)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    device = pick_device(args.dry_run)
    shapes, dtype = (TINY, torch.float32) if args.dry_run else (LLAMA3_8B, torch.bfloat16)
    spill = 1 << 16 if args.dry_run else L2_SPILL_BYTES
    replay = graph_ms if device.type == "cuda" else time_ms
    bandwidth = bandwidths(device)["hbm_copy_gb_per_s"]  # the rate the step's floor divides by
    generator = torch.Generator(device=device).manual_seed(0)
    weights = {name: _copies(shape, dtype, device, spill, generator) for name, shape in shapes.items()}
    rows = []
    widths = {k for _, k in shapes.values()}  # the projections' input widths
    for m in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(m, k, dtype=dtype, device=device, generator=generator) for k in widths}
        for name, copies in weights.items():
            x = inputs[shapes[name][1]]
            rows.append(_row(name, m, copies, lambda w, x=x: F.linear(x, w), replay, device, bandwidth))
        for group, names in GROUPS.items():
            x = inputs[shapes[names[0]][1]]
            rows += _group_rows(group, [weights[n] for n in names], x, m, replay, device, bandwidth)
    result = run_record(device) | {"copy_gb_per_s": bandwidth, "dtype": str(dtype), "rows": rows}
    print_table(rows, ["name", "rows", "us", "gb_per_s", "of_copy", "merged_bits_equal"])
    write_json(args.out, result)
    return result


def _copies(
    shape: tuple[int, int], dtype: torch.dtype, device: torch.device, spill: int, generator: torch.Generator
) -> list[torch.Tensor]:
    """Enough distinct weights of `shape` that walking them all reads `spill` bytes from HBM."""
    count = max(2, -(-spill // (shape[0] * shape[1] * torch.finfo(dtype).bits // 8)))
    return [torch.randn(shape, dtype=dtype, device=device, generator=generator) * 0.02 for _ in range(count)]


def _row(
    name: str, m: int, copies: list[torch.Tensor], gemm: Callable, replay: Callable, device: torch.device,
    bandwidth: float,
) -> dict:  # fmt: skip
    """One GEMM kind over every copy of its weights, per GEMM: microseconds and GB/s of weight read."""
    ms = replay(lambda: [gemm(w) for w in copies], device)
    return _timing(name, m, ms, len(copies), copies[0].numel() * copies[0].element_size(), bandwidth)


def _timing(
    name: str, m: int, ms: float | None, count: int, weight_bytes: int, bandwidth: float, **extra: bool
) -> dict:
    """A row: microseconds per GEMM (of `count` in `ms`), weight GB/s and its share of `bandwidth`."""
    us = None if ms is None else ms * 1e3 / count
    rate = None if not us else weight_bytes / us / 1e3
    of_copy = None if rate is None or not bandwidth else rate / bandwidth
    return {"name": name, "rows": m, "us": us, "gb_per_s": rate, "of_copy": of_copy, **extra}


def _group_rows(
    group: str, members: list[list[torch.Tensor]], x: torch.Tensor, m: int, replay: Callable, device: torch.device,
    bandwidth: float,
) -> list[dict]:  # fmt: skip
    """A layer's independent projections one after another, merged into one weight, and beside each
    other on two streams (the first on the caller's stream, the rest on a second)."""
    count = min(len(copies) for copies in members)
    weight_bytes = sum(copies[0].numel() * copies[0].element_size() for copies in members)
    merged = [torch.cat([copies[i] for copies in members]) for i in range(count)]
    widths = [copies[0].shape[0] for copies in members]
    parts = F.linear(x, merged[0]).split(widths, dim=-1)
    bits_equal = all(torch.equal(part, F.linear(x, copies[0])) for part, copies in zip(parts, members))

    def serial():
        return [F.linear(x, copies[i]) for i in range(count) for copies in members]

    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def beside():
        if side is None:  # one stream: the serial order
            return serial()
        outputs = []
        for i in range(count):
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                outputs += [F.linear(x, copies[i]) for copies in members[1:]]
            outputs.append(F.linear(x, members[0][i]))
            torch.cuda.current_stream(device).wait_stream(side)
        return outputs

    def time(how: str, fn: Callable, **extra: bool) -> dict:
        return _timing(f"{group}_{how}", m, replay(fn, device), count, weight_bytes, bandwidth, **extra)

    merged_row = time("merged", lambda: [F.linear(x, w) for w in merged], merged_bits_equal=bits_equal)
    return [time("serial", serial), merged_row, time("beside", beside)]


if __name__ == "__main__":
    main()
