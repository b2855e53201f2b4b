"""Transfer benchmark: FlashH2D, UVA scatter and FlashD2H against bulk PCIe copies.

    python -m eval.bench.transfer --out eval/results/transfer.json      # ~1 min on the H200

Random head-blocks of 4/16/64 KiB (bf16, D=128: 8/32/128 tokens) move between a pinned host pool
and HBM, >= 256 MiB per launch. Baselines in the same run: one bulk pinned 1 GiB copy each way
and a `copy_` per block. The save paths are also timed while bf16 matmuls run on the main
stream, to see how much compute a save steals (the prefill measure of Fig. 14b of the paper).
Top-level `h2d_over_bulk` / `d2h_over_bulk` are at 16 KiB; d2h is the store's default save path
(`ops.scatter_blocks`, the UVA scatter with its default grid cap); `flash_d2h_over_bulk` is beside it.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from eval.bench.common import pick_device, prepare_triton, print_table, run_record, sync, time_ms, wall_ms, write_json

HEAD_DIM = 128
DTYPE = torch.bfloat16
GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10
SCATTER = "UVA scatter (default grid)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-kib", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--launch-mib", type=int, default=256, help="bytes moved per gather/scatter launch")
    parser.add_argument("--pool-gib", type=float, default=4.0, help="pinned host pool the random ids index")
    parser.add_argument("--bulk-gib", type=float, default=1.0)
    parser.add_argument("--loop-blocks", type=int, default=4096, help="blocks in the per-block copy_ loop")
    parser.add_argument("--threads", type=int, default=8, help="FlashD2H scatter threads")
    parser.add_argument(
        "--save-programs",
        type=int,
        nargs="*",
        default=[8, 16, 32, 64],
        help="grid caps of the UVA scatter beside compute",
    )
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, any device (tests the script)")
    return parser.parse_args(argv)


def bulk_rows(host: torch.Tensor, device_buffer: torch.Tensor, device: torch.device) -> list[dict[str, Any]]:
    """One contiguous copy each way: the PCIe ceiling every other row is compared with."""
    size = host.numel() * host.element_size()
    h2d = time_ms(lambda: device_buffer.copy_(host, non_blocking=True), device)
    d2h = time_ms(lambda: host.copy_(device_buffer, non_blocking=True), device)
    return [_row("bulk", "h2d", None, size, h2d), _row("bulk", "d2h", None, size, d2h)]


def block_rows(block_kib: int, host_bytes: torch.Tensor, args, device: torch.device) -> list[dict[str, Any]]:
    """Every method at one block size: per-block loop, FlashH2D, UVA scatter, FlashD2H."""
    from sparseserve_hf.ops import triton_transfer
    from sparseserve_hf.ops.flash_d2h import FlashD2HSaver

    tokens = block_kib * KIB // (2 * HEAD_DIM * DTYPE.itemsize)
    pool = host_bytes.view(DTYPE).view(-1, 2, tokens, HEAD_DIM)  # (C, 2, S, D) over the same pinned bytes
    num = min(args.launch_bytes // (block_kib * KIB), pool.shape[0])
    hbm = torch.randn((num, 2, tokens, HEAD_DIM), device=device).to(DTYPE)  # (n, 2, S, D)
    ids = torch.randperm(pool.shape[0])[:num]  # distinct random DRAM blocks
    slots = torch.randperm(num)
    ids_dev, slots_dev = ids.to(device), slots.to(device)
    moved = num * block_kib * KIB
    rows = []
    loop = min(args.loop_blocks, num)
    id_list, slot_list = ids[:loop].tolist(), slots[:loop].tolist()
    loop_bytes = loop * block_kib * KIB

    def h2d_loop() -> None:
        for i, s in zip(id_list, slot_list):
            hbm[s].copy_(pool[i], non_blocking=True)

    def d2h_loop() -> None:
        for i, s in zip(id_list, slot_list):
            pool[i].copy_(hbm[s], non_blocking=True)

    rows.append(_row("copy_ per block", "h2d", block_kib, loop_bytes, wall_ms(h2d_loop, device, 3)))
    rows.append(_row("copy_ per block", "d2h", block_kib, loop_bytes, wall_ms(d2h_loop, device, 3)))
    gather = time_ms(lambda: triton_transfer.gather_blocks(pool, ids_dev, hbm, slots_dev), device)
    rows.append(_row("FlashH2D gather", "h2d", block_kib, moved, gather))
    scatter = time_ms(lambda: triton_transfer.scatter_blocks(hbm, pool, ids_dev), device)
    rows.append(_row(SCATTER, "d2h", block_kib, moved, scatter))
    saver = FlashD2HSaver(device, num_threads=args.threads)
    saved = wall_ms(lambda: (saver.save(hbm, pool, ids), saver.wait()), device, 5)
    saver.close()
    rows.append(_row("FlashD2H (staged + CPU scatter)", "d2h", block_kib, moved, saved))
    return rows


def overlap_rows(host_bytes: torch.Tensor, args, device: torch.device) -> list[dict[str, Any]]:
    """Matmul time on the main stream alone and while each save path moves 16 KiB blocks.

    The UVA scatter runs with a full grid (one program per block) and with grids capped at
    `--save-programs`: each capped row also has the scatter's own bandwidth, so the cap that keeps
    compute whole without losing PCIe speed can be read off one table.
    """
    from sparseserve_hf.ops import triton_transfer
    from sparseserve_hf.ops.flash_d2h import FlashD2HSaver

    if device.type != "cuda":
        return []
    size = 8192
    a = torch.randn(size, size, device=device, dtype=DTYPE)
    pool = host_bytes.view(DTYPE).view(-1, 2, 32, HEAD_DIM)
    num = min(args.launch_bytes // (16 * KIB), pool.shape[0])
    blocks = torch.randn((num, 2, 32, HEAD_DIM), device=device).to(DTYPE)
    ids = torch.randperm(pool.shape[0])[:num]
    ids_dev = ids.to(device)
    side = torch.cuda.Stream(device)
    saver = FlashD2HSaver(device, num_threads=args.threads)

    def uva(cap: int | None):
        def save() -> None:
            with torch.cuda.stream(side):
                triton_transfer.scatter_blocks(blocks, pool, ids_dev, max_programs=cap)

        return save

    def flash() -> None:
        saver.save(blocks, pool, ids)

    alone = _matmul_ms(a, 40, None)
    rows = [{"method": "matmul alone", "compute_ms": alone, "slowdown": 1.0, "save_gb_per_s": None}]

    def scatter_gb_per_s(cap: int | None) -> float:  # alone, on the current stream (where time_ms records)
        ms = time_ms(lambda: triton_transfer.scatter_blocks(blocks, pool, ids_dev, max_programs=cap), device)
        return num * 16 * KIB / ms / 1e6

    caps = [None, *args.save_programs]
    saves = [(f"UVA scatter, grid <= {c}" if c else "UVA scatter, one program per block", uva(c), c) for c in caps]
    for name, save, cap in saves + [("FlashD2H", flash, None)]:
        with_save = _matmul_ms(a, 40, save)
        saver.wait()
        gb_per_s = None if save is flash else scatter_gb_per_s(cap)
        rows.append({"method": f"matmul + {name}", "compute_ms": with_save, "slowdown": with_save / alone,
                     "save_gb_per_s": gb_per_s})  # fmt: skip
    saver.close()
    sync(device)
    return rows


def _matmul_ms(a: torch.Tensor, count: int, save) -> float:
    """Main-stream time of `count` matmuls, with saves issued every 4 matmuls when `save` is given."""
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(count):
            a = torch.mm(a, a).div_(a.shape[0])
            if save is not None and i % 4 == 0:
                save()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[1]


def _row(method: str, direction: str, block_kib: int | None, nbytes: int, ms: float) -> dict[str, Any]:
    return {
        "method": method,
        "direction": direction,
        "block_kib": block_kib,
        "mib": nbytes / MIB,
        "ms": ms,
        "gb_per_s": nbytes / ms / 1e6,
    }


def _ratio(rows: list[dict[str, Any]], method: str, direction: str, block_kib: int) -> float | None:
    bulk = next(r["gb_per_s"] for r in rows if r["method"] == "bulk" and r["direction"] == direction)
    found = [r["gb_per_s"] for r in rows if r["method"] == method and r["block_kib"] == block_kib]
    return found[0] / bulk if found else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = pick_device(args.dry_run)
    prepare_triton(device)
    if args.dry_run:
        args.bulk_gib, args.pool_gib, args.launch_mib, args.loop_blocks = 1 / 1024, 2 / 1024, 1, 8
    args.launch_bytes = args.launch_mib * MIB
    pinned = device.type == "cuda"
    host = torch.empty(int(args.pool_gib * GIB), dtype=torch.uint8, pin_memory=pinned)
    bulk_host = torch.empty(int(args.bulk_gib * GIB), dtype=torch.uint8, pin_memory=pinned)
    rows = bulk_rows(bulk_host, torch.empty_like(bulk_host, device=device), device)
    del bulk_host
    for block_kib in args.block_kib:
        rows += block_rows(block_kib, host, args, device)
    overlap = overlap_rows(host, args, device)
    print_table(rows, ["method", "direction", "block_kib", "mib", "ms", "gb_per_s"])
    if overlap:
        print_table(overlap, ["method", "compute_ms", "slowdown", "save_gb_per_s"])
    result = {
        **run_record(device),
        "h2d_over_bulk": _ratio(rows, "FlashH2D gather", "h2d", 16),
        "d2h_over_bulk": _ratio(rows, SCATTER, "d2h", 16),
        "flash_d2h_over_bulk": _ratio(rows, "FlashD2H (staged + CPU scatter)", "d2h", 16),
        "save_compute_slowdown": {r["method"]: r["slowdown"] for r in overlap[1:]},
        "rows": rows,
        "overlap": overlap,
    }
    print(
        f"h2d_over_bulk={_show(result['h2d_over_bulk'])} d2h_over_bulk={_show(result['d2h_over_bulk'])} "
        f"flash_d2h_over_bulk={_show(result['flash_d2h_over_bulk'])}"
    )
    write_json(args.out, result)
    return result


def _show(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3f}"


if __name__ == "__main__":
    main()
