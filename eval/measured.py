"""The README's Measured table, written from the result files it cites, so that no number in it is
typed by hand.

    python -m eval.measured            # rewrite the table between its markers in README.md
    python -m eval.measured --check    # exit 1 when README.md's table is not what the files give

Each row names one result file under eval/results (read through `results_io`, compressed or not) and
a function that takes the figures it quotes out of that file; the row's text is a format string over
them. A figure a run only printed (its file did not come back from the GPU machine) is read from where
its result file keeps it as printed, and the row says so.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.results_io import read_json, stored

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "eval" / "results"
README = ROOT / "README.md"
BEGIN = "<!-- measured: written by `python -m eval.measured` from eval/results; do not edit by hand -->"
END = "<!-- end of measured -->"
HEADER = "| what | ours | baseline (same run) | target | device, result |\n|---|---|---|---|---|"
HYBRID = "; the hybrid group union, the default before 17d265a"  # rows measured before channel scores were the default


@dataclass(frozen=True)
class Row:
    """One line of the table: `ours` and `baseline` are format strings over `figures(result)`, where
    `result` is the JSON of `file` (a path under eval/results, named as `results_io` reads it)."""

    what: str
    file: str
    figures: Callable[[dict[str, Any]], dict[str, Any]]
    ours: str
    baseline: str
    target: str
    device: str | None = None  # None: the file's own "device"
    link: str | None = None  # what the last column links, from the repository root (None: `file`'s path)
    note: str = ""  # appended to the last column (a format string over the figures too)


def _dropin(context: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda r: {
        "ms": r[f"decode_ms_{context}"], "peak": r[f"peak_hbm_vs_stock_{context}"],
        "stock": r[f"stock_{context}_ms"], "ratio": r[f"decode_vs_stock_{context}"],
    }  # fmt: skip


def _tensor_core_step(r: dict[str, Any]) -> dict[str, Any]:
    """The step with the tensor-core channel scorer beside the FMA kernel's, one call on one machine,
    and the kernels alone as graph replays."""
    ours, fma = r["default"]["real_locality"], r["default_fma"]["real_locality"]
    kernel = {run["MMA"]: run["kernel_us"] for run in r["channel_kernel"]["new"]["rows"]}
    return {"ms": ours["graph_ms"], "floor": ours["graph_step_over_floor"], "book": ours["bookkeeping_us_per_layer"],
            "fma_ms": fma["graph_ms"], "fma_floor": fma["graph_step_over_floor"],
            "fma_book": fma["bookkeeping_us_per_layer"], "mma_us": kernel[True], "fma_us": kernel[False]}  # fmt: skip


def _generator(point: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def figures(r: dict[str, Any]) -> dict[str, Any]:
        ours, stock = r["points"][point]["real_locality"], r["points"][point]["stock"]
        return {"ours": ours["tokens_per_s"], "stock": stock["tokens_per_s"], "rows": stock["batch"],
                "ratio": ours["over_stock"]}  # fmt: skip

    return figures


def _two_level_wide(r: dict[str, Any]) -> dict[str, Any]:
    """The fastest piece width's run (the default's since) beside one level's runs of the same calls."""
    two_level = [run for run in r["runs"] if run["knobs"].get("triton_two_level.FEW_PROGRAMS_ONLY") is False]
    best = max(two_level, key=lambda run: run["select_and_attend_speedup_default"])
    same = [
        run
        for run in two_level
        if run["knobs"].get("triton_two_level.CHUNK") == best["knobs"]["triton_two_level.CHUNK"]
    ]
    one_level = [run["select_and_attend_speedup_default"] for run in r["runs"] if not run["knobs"]]
    return {"real": best["select_and_attend_speedup_default"], "random": best["select_and_attend_speedup_default_random"],
            "chunk": best["knobs"]["triton_two_level.CHUNK"], "runs": len(same),
            "one_low": min(one_level), "one_high": max(one_level)}  # fmt: skip


def _working_set(r: dict[str, Any]) -> dict[str, Any]:
    by_budget = {run["budget"]: run["steady_hit_rate"] for run in r["runs"]}
    return {"at_2048": by_budget[2048], "at_256": by_budget[256]}


def _joined(r: dict[str, Any]) -> dict[str, Any]:
    stock, ours = r["stock"]["joined"], r["ours"]["joined"]
    return {"tps": r["throughput_ratio"], "ttft": r["mean_ttft_ratio"], "ours_tps": ours["throughput_tokens_per_s"],
            "stock_tps": stock["throughput_tokens_per_s"], "ours_ttft": ours["mean_ttft_s"],
            "stock_ttft": stock["mean_ttft_s"], "stock": r["stock"]["system"], "requests": ours["requests"],
            "device": r["ours"]["parts"][0]["device"]}  # fmt: skip


ROWS = [
    Row(
        "drop-in `generate`, decode ms/step, B=4 x 32K",
        "dropin.json",
        _dropin("32k"),
        "**{ms:.1f} ms**, peak HBM {peak:.2f}x",
        "best stock {stock:.1f} ms (**{ratio:.2f}x**)",
        "<= 0.6x",
        note=HYBRID,
    ),
    Row(
        "the same, B=2 x 128K",
        "dropin_128k.json",
        _dropin("128k"),
        "**{ms:.1f} ms**, peak HBM {peak:.2f}x",
        "{stock:.1f} ms (**{ratio:.2f}x**)",
        "<= 0.35x, peak <= 0.6x",
        note=HYBRID,
    ),
    Row(
        "the same, B=1 x 256K",
        "dropin_256k.json",
        _dropin("256k"),
        "**{ms:.2f} ms**, peak HBM {peak:.2f}x",
        "{stock:.2f} ms (**{ratio:.3f}x**)",
        "<= 0.25x, peak <= 0.5x",
        note=HYBRID,
    ),
    Row(
        "one decode step as a CUDA graph, B=16 x 32K",
        "decode_step.json",
        lambda r: r["real_locality"] | {"stock": r["stock_best_ms"]},
        "**{graph_ms:.2f} ms** = **{graph_step_over_floor:.2f}x** its bandwidth floor; selection + lookup "
        "{bookkeeping_us_per_layer:.0f} us/layer",
        "stock {stock:.1f} ms (**{speedup_vs_best_stock:.1f}x** faster)",
        "<= 1.5x floor, >= 5x stock, <= 46 us/layer",
        note=" (H100: 1.34-1.43x the floor" + HYBRID + ")",
    ),
    Row(
        "`Generator`, closed loop, 16 x 16K x 1024 new",
        "generator_vs_generate.json",
        _generator("closed_loop"),
        "**{ours:.1f} tok/s**",
        "stock {stock:.1f} (**{ratio:.2f}x**)",
        ">= 2x",
        note=HYBRID,
    ),
    Row(
        "`Generator` under a 40 GiB HBM cap, 16 x 32K x 1024 new",
        "generator_vs_generate.json",
        _generator("capacity"),
        "**{ours:.1f} tok/s**",
        "stock {stock:.1f}, {rows} rows at a time (**{ratio:.2f}x**)",
        ">= 4x",
        note=HYBRID,
    ),
    Row(
        "TTFT of one 32K prompt on an idle `Generator`",
        "generator_vs_generate.json",
        lambda r: {"ratio": r["prefill_over_stock"]},
        "{ratio:.3f}x stock's",
        "stock `generate(max_new_tokens=1)`",
        "<= 1.05x",
    ),
    Row(
        "prefix caching, 8 questions over one 32K document",
        "longdoc.json",
        lambda r: {"ttft": r["prefix_ttft_ratio"], "dram": r["prefix_dram_ratio"]},
        "later TTFTs **{ttft:.3f}x** the first's; DRAM **{dram:.3f}x**",
        "8 unshared copies",
        "<= 0.1, <= 0.2",
    ),
    Row(
        "FlashH2D / save path",
        "transfer.json",
        lambda r: {"h2d": r["h2d_over_bulk"], "d2h": r["d2h_over_bulk"]},
        "**{h2d:.2f}** / **{d2h:.2f}** of bulk PCIe",
        "bulk pinned copies",
        ">= 0.90 / >= 0.85",
    ),
    Row(
        "sparse decode kernel, B=32 x 128K",
        "decode_attention.json",
        lambda r: {"speedup": r["speedup_vs_dense_sdpa"], "fraction": r["hbm_bandwidth_fraction"]},
        "**{speedup:.1f}x** SDPA, {fraction:.2f} of copy bandwidth",
        "SDPA over the context",
        ">= 15x, >= 0.6",
    ),
    Row(
        "score + top-k + attention, B=32 x 128K",
        "decode_step_runs/two_level_wide_h100_fc94f3f.json",
        _two_level_wide,
        "**{real:.2f}x** SDPA (real locality; {random:.2f}x random KV)",
        "SDPA over the context",
        ">= 8x",
        device="H100",
        note=" (two-level selection in {chunk}-block pieces, {runs} run(s); one level {one_low:.2f}-{one_high:.2f}x in the same "
        "calls; see docs/performance.md" + HYBRID + ")",
    ),
    Row(
        "layer-segmented prefill of 128K, peak HBM",
        "prefill_memory.json",
        lambda r: {"ratio": r["layer_segmented_over_bound"]},
        "**{ratio:.2f}** of its bound",
        "weights + one layer's KV and forward",
        "<= 1.0",
    ),
    Row(
        "accuracy, RULER-style at 8K, default selector",
        "accuracy.json",
        lambda r: r["t7"],
        "**{ratio_at_1_16:.3f}** of dense at 1/16 of the context loaded, **{ratio_at_1_32:.3f}** at 1/32",
        "dense; the block oracle {oracle_at_1_16:.3f} (1/16), {oracle_at_1_32:.3f} (1/32)",
        ">= 0.99 at 1/16, >= 0.97 at 1/32",
        device="H100 (the oracle: H200)",
        link="eval/results/accuracy.md",
    ),
    Row(
        "accuracy, RULER-style at 16K on Gemma-3-270M, default selector",
        "accuracy.json",
        lambda r: r["t7_gemma3_16k"],
        "**{ratio_at_1_16:.3f}** of dense at 1/16 loaded, **{ratio_at_1_32:.3f}** at 1/32 ({n_samples_per_task}+ samples per task)",
        "dense; the block oracle {oracle_at_1_16:.3f} (1/16), {oracle_at_1_32:.3f} (1/32)",
        ">= 0.99 at 1/16, >= 0.97 at 1/32",
        device="H100",
        link="eval/results/accuracy.md",
    ),
    Row(
        "the same step with the channel scores on tensor cores (the default where they fit)",
        "decode_step_runs/tensor_cores_1f96824_h100.json",
        _tensor_core_step,
        "**{ms:.2f} ms** ({floor:.2f}x its floor); selection + lookup {book:.0f} us per layer; the scorer alone {mma_us:.1f} us",
        "the FMA kernel in the same call: {fma_ms:.2f} ms ({fma_floor:.2f}x), {fma_book:.0f} us; the scorer alone {fma_us:.1f} us",
        "",
        device="H100",
    ),
    Row(
        "working-set control, HBM cache at 2x the working set",
        "working_set_hits.json",
        _working_set,
        "hit rate **{at_2048:.3f}** (budget 2048), {at_256:.3f} (256)",
        "",
        ">= 0.95",
        device="CPU",
    ),
    Row(
        "serving, second edition, `decode_heavy` saturated (all 40 requests at t=0, 40 GiB cap)",
        "serving_runs/decode_heavy_saturated_h100.json",
        _joined,
        "**{tps:.2f}x** the tokens/s ({ours_tps:.1f} against {stock_tps:.1f}), **{ttft:.2f}x** lower mean TTFT "
        "({ours_ttft:.1f} s against {stock_ttft:.1f} s)",
        "`{stock}`, the fastest stock cache measured on this trace, on the same {requests} requests",
        ">= 6x and >= 9x",
        device="H100",
        link="docs/serving.md",
        note=" (stock in four parts on two H100s" + HYBRID + ")",
    ),
    Row(
        "serving, second edition, `paper` saturated (all 40 requests at t=0, 40 GiB cap)",
        "serving_runs/paper_saturated_h100.json",
        _joined,
        "**{tps:.2f}x** the tokens/s ({ours_tps:.1f} against {stock_tps:.2f}), **{ttft:.2f}x** lower mean TTFT "
        "({ours_ttft:.1f} s against {stock_ttft:.1f} s)",
        "`{stock}`, the stock cache measured on this trace, on the same {requests} requests",
        ">= 3x and >= 3x",
        device="H100",
        link="docs/serving.md",
        note=" (stock in two parts on two H100s" + HYBRID + "), [figure](eval/results/serving_saturated.png)",
    ),
]


def render_row(row: Row, results: Path = RESULTS) -> str:
    """The row's markdown line, its figures read from its file now. KeyError / FileNotFoundError name
    what is missing."""
    result = read_json(results / row.file)
    figures = row.figures(result)
    device = row.device or str(result.get("device", "?")).removeprefix("NVIDIA ").split(" (")[0]
    target = row.link or f"eval/results/{stored(results / row.file).relative_to(results).as_posix()}"  # as stored
    link = f"[`{Path(target).name}`]({target})"
    cells = [row.what, row.ours.format(**figures), row.baseline.format(**figures), row.target,
             f"{device}, {link}{row.note.format(**figures)}"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def table(results: Path = RESULTS) -> str:
    """The whole table between its markers."""
    return "\n".join([BEGIN, HEADER, *(render_row(row, results) for row in ROWS), END])


def replaced(text: str, new_table: str) -> str:
    """`text` with the part from BEGIN to END replaced by `new_table`; ValueError without both markers."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no measured table markers ({BEGIN!r} ... {END!r})")
    return text[:start] + new_table + text[end + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing; exit 1 when stale")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    new = replaced(text, table())
    if args.check:
        if new != text:
            print("README.md's measured table differs from eval/results: run python -m eval.measured", file=sys.stderr)
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    print(f"wrote the measured table of {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
