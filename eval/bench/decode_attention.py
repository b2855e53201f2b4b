"""Decode attention benchmark: the sparse kernel and select + attend against dense SDPA.

    python -m eval.bench.decode_attention --out eval/results/decode_attention.json   # ~2-3 min on the H200
    python -m eval.bench.decode_attention --contexts 131072 --batches 32 --default-only \
        --knob triton_rank.COMBINE_WARPS=16    # the default config's rows alone, a launch constant changed

One layer of one decode step, Llama-3-8B shape (Hq=32, Hkv=8, D=128, bf16, 32-token blocks),
budget 2048 tokens: each KV head attends U = 2048/32 - 1 = 63 selected blocks plus its tail.
Baselines in the same run: SDPA over the whole context (`enable_gqa=True`, PyTorch's fastest
backend) and a device-to-device copy (the HBM bandwidth the kernel is held to).

Timing: every `*_ms` column is the median replay of the call captured in a CUDA graph, the GPU's
time alone, which is what a graph-captured decode step pays; `*_eager_ms` columns time the same
call launched eagerly from Python (select + attend is ~15 small kernels: there the host's
launches, not the GPU, set the time).

Columns: `dense_ms` SDPA; `sparse_ms` the Triton kernel alone over resident blocks;
`select_ms` Quest scoring of every block straight from the metadata pool + top-k (sink and
window forced; one `hybrid` row at the headline point scores with the default metadata instead:
Quest + a cuboid mean per 8 tokens, 3x the bytes, two rankings interleaved); `select_attend_ms`
both (the block-table lookup and misses are the decode step's business (`decode_step`)); `kernel_gb_per_s` bytes the kernel
reads (K/V of the attended blocks and tails) per second; `union` rows time the "group_union" worst
case (each KV head loads G x 63 distinct blocks) and select through the decode step's own path
(`attention.pick_blocks`: per-head top-k and the GQA union). The two `default` rows are
`SparseServeConfig()` end to end (channel scores: each block's channel metadata built from random keys,
one pick per KV head by the group's summed estimated mass); two rows before them time the hybrid group
union the same way (the default before; `*_hybrid_union` keys), in the config's own metadata dtype (8-bit
on Hopper): `locality="real"` loads what the real default model loaded (`selection_trace`:
scoring and top-k run and are timed, then the recorded selections replace the picks, and every
query head attends its KV head's whole load), `select_and_attend_speedup_default`;
`locality="random"` the union's worst case (G x 63 distinct blocks per KV head, what random
queries over random keys load), `select_and_attend_speedup_default_random`. A budget's cost is
what each KV head loads: `blocks_per_kv_head` is its mean over the timed calls.
Where flash-attn-4 runs (`backend="flash"`), `flash_ms` times its sparse decode on the same
inputs, `flash_speedup` = dense_ms / flash_ms, and `flash_max_abs_diff` is its largest
difference from the Triton kernel's output; the top level then adds `flash_speedup_vs_dense_sdpa`.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from eval.bench.common import (
    add_knob_option,
    apply_knobs,
    graph_ms,
    pick_device,
    prepare_triton,
    print_table,
    run_record,
    time_ms,
    write_json,
)
from eval.common import HYBRID_UNION

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32
DTYPE = torch.bfloat16
HEADLINE = (131072, 32)  # (context, batch) of the top-level ratios


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--max-dense-gib", type=float, default=40.0, help="skip SDPA where its K/V exceed this")
    parser.add_argument("--profile", action="store_true", help="print select + attend's kernels at the headline point")
    parser.add_argument("--out", default=None, help="JSON output path")
    add_knob_option(parser, "triton_rank.COMBINE_WARPS=16")
    parser.add_argument(
        "--default-only",
        action="store_true",
        help="only the rows of SparseServeConfig() and the hybrid group union (real and random locality)",
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (tests the script)")
    return parser.parse_args(argv)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of a device-to-device copy, counting bytes read + written (the HBM traffic)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


def decode_inputs(
    batch: int,
    context: int,
    budget: int,
    group_union: bool,
    device: torch.device,
    vectors: int = 2,
    metadata_dtype: torch.dtype = DTYPE,
    slots_per_kv_head: int | None = None,
) -> dict[str, Any]:
    """Query, a pool holding only the selected blocks, their slots, tails, and the metadata pool + table.
    `slots_per_kv_head`: pool slots of each (row, KV head), None = the blocks it loads."""
    from sparseserve_hf.ops import reference

    num_blocks = context // BLOCK - 1  # full blocks; the rest of the context is the tail
    loaded = min(budget // BLOCK - 1, num_blocks)
    if group_union:
        loaded = min(loaded * (Q_HEADS // KV_HEADS), num_blocks)
    slots_per_kv_head = loaded if slots_per_kv_head is None else slots_per_kv_head
    query = torch.randn(batch, Q_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    pool = torch.randn(
        batch * KV_HEADS * slots_per_kv_head, 2, BLOCK, HEAD_DIM, device=device, dtype=DTYPE
    )  # (P, 2, S, D)
    slots = torch.randperm(pool.shape[0], device=device).view(batch, KV_HEADS, slots_per_kv_head)  # scattered slots
    tail = torch.randn(batch, KV_HEADS, 2, BLOCK, HEAD_DIM, device=device, dtype=DTYPE)
    tail_len = torch.randint(1, BLOCK + 1, (batch,), device=device)
    metadata = torch.randn(batch * KV_HEADS * num_blocks, vectors, HEAD_DIM, device=device, dtype=DTYPE)  # (C, M, D)
    metadata = reference.to_metadata_dtype(metadata, metadata_dtype)
    table = torch.randperm(metadata.shape[0], device=device).view(batch, KV_HEADS, num_blocks)  # DRAM ids
    return dict(
        query=query, pool=pool, slots=slots, tail=tail, tail_len=tail_len, metadata=metadata, table=table,
        num_blocks=torch.full((batch,), num_blocks, device=device), loaded=loaded,
    )  # fmt: skip


def channel_pool(count: int, config, device: torch.device) -> torch.Tensor:
    """(count, M, D) channel metadata (`ops.channels`) of random keys: 4,096 blocks' worth, tiled."""
    from sparseserve_hf.ops import channels

    keys = torch.randn(min(count, 4096), BLOCK, HEAD_DIM, device=device)
    made = channels.channel_metadata(keys, config.channel_share, torch.float8_e4m3fn)
    return made.repeat((count + made.shape[0] - 1) // made.shape[0], 1, 1)[:count].contiguous()


def flash_decode_module(device: torch.device):
    """`ops.flash_decode` where flash-attn-4 runs on `device`, else None (the reason printed)."""
    from sparseserve_hf.ops import resolve_backend

    try:
        resolve_backend("flash", device)
        from sparseserve_hf.ops import flash_decode
    except (NotImplementedError, ImportError) as exc:
        print(f"no flash column: {exc}")
        return None
    return flash_decode


def measure(
    batch: int,
    context: int,
    args,
    device: torch.device,
    group_union: bool,
    flash=None,
    metadata: str = "quest",
    locality: str | None = None,
    selector: dict | None = None,
) -> dict[str, Any]:
    """One row. `locality` None: `metadata` in the KV dtype; "random" / "real": the hybrid group union
    (`HYBRID_UNION`, see the module docstring) or, with `selector` {} , `SparseServeConfig()` (channel scores,
    one pick per KV head); `metadata` and `group_union` then come from the config."""
    from sparseserve_hf import SparseServeConfig
    from sparseserve_hf.attention import pick_blocks
    from sparseserve_hf.ops import get_ops, reference, triton_decode, triton_score
    from sparseserve_hf.scoring import SCORERS

    if locality is None:
        config = SparseServeConfig(block_size=BLOCK, token_budget=args.budget, metadata=metadata, metadata_dtype="kv")
    else:
        fields = HYBRID_UNION if selector is None else selector
        config = SparseServeConfig(block_size=BLOCK, token_budget=args.budget, **fields)
        metadata, group_union = config.metadata, config.selection == "group_union"
    metadata_dtype = reference.metadata_dtype(config.metadata_dtype, DTYPE, device)
    union_width = (Q_HEADS // KV_HEADS if group_union else 1) * config.selected_full_blocks  # entries per KV head
    slots_per_kv_head = union_width if locality == "real" else None  # the trace's loads: up to that many
    x = decode_inputs(
        batch, context, args.budget, group_union, device, config.metadata_vectors, metadata_dtype, slots_per_kv_head
    )
    if metadata == "channels":  # the kernel gathers the query by each block's stored pair indices: real metadata
        x["metadata"] = channel_pool(x["metadata"].shape[0], config, device)
    scale = HEAD_DIM**-0.5
    topk = min(args.budget // BLOCK - 1, x["table"].shape[2])
    ops = get_ops("triton", device)
    replay = real_locality(device) if locality == "real" else None

    def attend(slots: torch.Tensor | None = None) -> torch.Tensor:
        tail = x["tail"]
        slots = x["slots"] if slots is None else slots
        return triton_decode.sparse_decode(
            x["query"], x["pool"], slots, None, tail[:, :, 0], tail[:, :, 1], x["tail_len"], scale
        )

    def attend_flash() -> torch.Tensor:
        tail = x["tail"]
        return flash.sparse_decode(
            x["query"], x["pool"], x["slots"], None, tail[:, :, 0], tail[:, :, 1], x["tail_len"], scale
        )

    def select() -> tuple[torch.Tensor, torch.Tensor]:
        """(picked, valid) (B, H, U): H = Hkv for the union (the decode step's own path), else Hq."""
        table = x["table"]
        if group_union or locality is not None:  # the config's scorer and selection (the decode step's own path)
            scores = SCORERS[metadata].score(ops, x["query"], x["metadata"], table, config, scale)
            picked, valid, _ = pick_blocks(ops, config, scores, x["num_blocks"], KV_HEADS, table.shape[2])
            if replay is not None:  # the picks ran; the loads follow the trace, as in the decode step
                picked, valid = replay(0, x["num_blocks"], picked.shape[-1])
            return picked, valid
        scores = triton_score.score_table(x["query"], x["metadata"], table, metadata, topk)  # (B, Hq, N)
        return reference.select_blocks(scores, x["num_blocks"], topk, 1, 1)

    union_slots = x["slots"]  # (B, Hkv, union width): a slot of its own for each entry a KV head may load

    def select_attend() -> torch.Tensor:
        _, valid = select()
        if replay is None:
            return attend()
        return attend(torch.where(valid, union_slots, -1))

    row = {"context": context, "batch": batch, "union": group_union, "metadata": metadata}
    row["metadata_dtype"] = str(metadata_dtype).removeprefix("torch.")
    row["locality"] = locality
    row["blocks_per_kv_head"] = x["loaded"]
    kernel_blocks = x["loaded"]  # what the kernel-alone columns attend (blocks per KV head)
    if replay is not None:
        row["blocks_per_kv_head"] = replayed_blocks(select, replay.indices.shape[1])
        _, valid = select()  # the kernel alone attends one replayed step's loads
        x["slots"] = torch.where(valid, x["slots"], -1)
        kernel_blocks = float(valid.sum(-1).float().mean())
    row["sparse_ms"] = gpu_ms(attend, device, row, "sparse_ms")
    row["select_ms"] = gpu_ms(select, device, row, "select_ms")
    row["select_attend_ms"] = gpu_ms(select_attend, device, row, "select_attend_ms")
    row["sparse_eager_ms"] = time_ms(attend, device)
    row["select_attend_eager_ms"] = time_ms(select_attend, device)
    if args.profile and (context, batch) == HEADLINE:
        print(f"profile of select + attend: metadata={metadata}, union={group_union}, locality={locality}")
        print_kernel_profile(select_attend)
    read = batch * KV_HEADS * (kernel_blocks + 1) * 2 * BLOCK * HEAD_DIM * DTYPE.itemsize
    row["kernel_gb_per_s"] = read / row["sparse_ms"] / 1e6
    if flash is not None and locality is None:  # the first call JIT-compiles fa4's kernel (seconds): before the timing
        row["flash_max_abs_diff"] = (attend_flash().float() - attend().float()).abs().max().item()
        row["flash_ms"] = gpu_ms(attend_flash, device, row, "flash_ms")
        row["flash_eager_ms"] = time_ms(attend_flash, device)
    x.clear()  # free the sparse inputs before SDPA allocates the dense K/V
    row["dense_ms"] = dense_ms(batch, context, args, device)
    if row["dense_ms"] is not None:
        row["select_attend_eager_speedup"] = row["dense_ms"] / row["select_attend_eager_ms"]
        row["speedup"] = row["dense_ms"] / row["sparse_ms"]
        row["select_attend_speedup"] = row["dense_ms"] / row["select_attend_ms"]
        if "flash_ms" in row:
            row["flash_speedup"] = row["dense_ms"] / row["flash_ms"]
    return row


def real_locality(device: torch.device):
    """A one-layer `TraceReplay` of the committed trace: each call replays the next recorded step."""
    from eval.bench.selection_trace import RECORDED_TRACE, SelectionTrace, TraceReplay

    return TraceReplay(SelectionTrace.load(RECORDED_TRACE), 1, KV_HEADS, device)


def replayed_blocks(select, calls: int) -> float:
    """Mean blocks a KV head loads over `calls` calls of `select` (the trace's steps: one cycle)."""
    counts = [select()[1].sum(-1).float().mean() for _ in range(calls)]
    return float(torch.stack(counts).mean())


def dense_ms(batch: int, context: int, args, device: torch.device) -> float | None:
    """SDPA of one decode token over the whole context (None when its K/V would not fit the cap)."""
    if 2 * batch * KV_HEADS * context * HEAD_DIM * DTYPE.itemsize > args.max_dense_gib * (1 << 30):
        return None
    try:
        query = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device=device, dtype=DTYPE)
        keys = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=device, dtype=DTYPE)
        values = torch.randn_like(keys)
        return gpu_ms(lambda: F.scaled_dot_product_attention(query, keys, values, enable_gqa=True), device)
    except torch.OutOfMemoryError:  # a backend that expands GQA needs G x the K/V: report, do not die
        print(f"SDPA out of memory at context={context} batch={batch}")
        return None


def gpu_ms(fn, device: torch.device, row: dict[str, Any] | None = None, name: str = "") -> float:
    """The GPU's time for `fn` (a CUDA-graph replay, as a captured decode step runs it); where it
    cannot be captured (CPU dry runs), the eager time, with `name` listed under the row's `eager_fallback`."""
    ms = graph_ms(fn, device)
    if ms is not None:
        return ms
    if row is not None:
        row.setdefault("eager_fallback", []).append(name)
    return time_ms(fn, device)


def print_kernel_profile(fn) -> None:
    """Per-kernel GPU time of 10 eager calls of `fn` (where select + attend spends its time)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = pick_device(args.dry_run)
    prepare_triton(device)
    knobs = apply_knobs(args.knob)  # after prepare_triton: the interpreter switch comes before the kernel module
    global Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK  # dry run: tiny shapes (set in main() only)
    if args.dry_run:
        Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 1, 16, 16
        args.contexts, args.batches, args.budget = [256], [1, 2], 64
    copy_gb_per_s = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 20))
    flash = flash_decode_module(device)
    rows = []
    headline = (args.contexts[-1], args.batches[-1]) if args.dry_run else HEADLINE
    if not args.default_only:
        for context in args.contexts:
            for batch in args.batches:
                rows.append(measure(batch, context, args, device, group_union=False, flash=flash))
        rows.append(measure(headline[1], headline[0], args, device, group_union=True, flash=flash))
        rows.append(measure(headline[1], headline[0], args, device, group_union=False, metadata="hybrid"))
    for locality in ("real", "random"):  # the hybrid group union end to end
        rows.append(measure(headline[1], headline[0], args, device, group_union=True, locality=locality))
    for locality in ("real", "random"):  # SparseServeConfig() end to end: channel scores, one pick per KV head
        rows.append(measure(headline[1], headline[0], args, device, group_union=False, locality=locality, selector={}))
    for row in rows:
        row["hbm_fraction"] = row["kernel_gb_per_s"] / copy_gb_per_s
    columns = ["context", "batch", "union", "metadata", "metadata_dtype", "locality", "blocks_per_kv_head"]
    columns += ["dense_ms", "sparse_ms", "select_ms"]
    columns += ["flash_ms", "flash_eager_ms", "flash_speedup", "flash_max_abs_diff"] if flash is not None else []
    columns += ["select_attend_ms", "speedup", "select_attend_speedup", "kernel_gb_per_s", "hbm_fraction"]
    print_table(rows, columns + ["sparse_eager_ms", "select_attend_eager_ms", "select_attend_eager_speedup"])
    at_headline = [r for r in rows if (r["context"], r["batch"]) == headline and not r["union"]]
    top = next((r for r in at_headline if r["metadata"] == "quest"), {})
    hybrid = next((r for r in at_headline if r["metadata"] == "hybrid"), {})
    default = {r["locality"]: r for r in rows if r["locality"] is not None and r["metadata"] == "channels"}
    hybrid_union = {r["locality"]: r for r in rows if r["locality"] is not None and r["metadata"] == "hybrid"}
    result = {
        **run_record(device),
        "knobs": knobs,
        "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK, "dtype": str(DTYPE)},
        "budget": args.budget,
        "headline": {"context": headline[0], "batch": headline[1]},
        "speedup_vs_dense_sdpa": top.get("speedup"),
        "select_and_attend_speedup": top.get("select_attend_speedup"),
        "select_and_attend_eager_speedup": top.get("select_attend_eager_speedup"),
        "select_and_attend_speedup_hybrid": hybrid.get("select_attend_speedup"),
        "select_and_attend_speedup_default": default["real"].get("select_attend_speedup"),
        "select_and_attend_speedup_default_random": default["random"].get("select_attend_speedup"),
        "default_blocks_per_kv_head": {k: r["blocks_per_kv_head"] for k, r in default.items()},
        "select_and_attend_speedup_hybrid_union": hybrid_union["real"].get("select_attend_speedup"),
        "select_and_attend_speedup_hybrid_union_random": hybrid_union["random"].get("select_attend_speedup"),
        "timing": "ms columns: median CUDA-graph replay (GPU time, as a captured decode step runs); "
        "*_eager_ms: median eager call with its host launches (triton do_bench)",
        "hbm_bandwidth_fraction": top.get("hbm_fraction"),
        "copy_gb_per_s": copy_gb_per_s,
        "rows": rows,
    }
    flash_line = ""
    if flash is not None:
        result["flash_speedup_vs_dense_sdpa"] = top.get("flash_speedup")
        flash_line = f" flash_speedup_vs_dense_sdpa={result['flash_speedup_vs_dense_sdpa']}"
    print(
        f"speedup_vs_dense_sdpa={result['speedup_vs_dense_sdpa']} select_and_attend_speedup="
        f"{result['select_and_attend_speedup']} hbm_bandwidth_fraction={result['hbm_bandwidth_fraction']} "
        f"select_and_attend_speedup_default={result['select_and_attend_speedup_default']} (random KV: "
        f"{result['select_and_attend_speedup_default_random']})" + flash_line
    )
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
