"""The accuracy report: RULER-style suite and LongBench results merged into one table, JSON and plot.

Reads the runners' output folders (`samples.jsonl`, or `partial.jsonl` of a run cut short; a sweep
run in parts passes several folders) and writes `accuracy.md`, `accuracy.json` and `accuracy.png`:

    python -m eval.accuracy.accuracy_report --ruler eval/results/ruler_4k eval/results/ruler_8k \\
        --longbench eval/results/longbench_multi_news --out eval/results

`accuracy.json["ratio_to_dense_8k"]` maps each budget of the default configuration ("512") to the
mean sparse score over the RULER-style tasks at 8K divided by the mean dense score over the same
tasks; tasks where dense scores below `MIN_DENSE_SCORE` are reported but left out (a ratio to a
score near zero measures noise). The accuracy target: >= 0.99 at 1/16 of the context
(512 at 8K) and >= 0.97 at 1/32 (256).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from eval.accuracy.t7 import families_with_loads, paired_ratio, t7_at_loaded
from eval.common import DENSE, split_method, summarize
from eval.results_io import read_jsonl, save_plot, stored

MIN_DENSE_SCORE = 20.0
GEMMA3_LENGTH = 16384  # the second model's judged length (its context is 32K)
DEFAULT_FAMILY = "sparse"  # methods named "sparse_<budget>": the default SparseServeConfig (see --rename)
T7_TARGETS = {16: 0.99, 32: 0.97}  # context / budget -> minimum ratio to dense
FP8_FAMILY = "fp8_kv"  # methods "fp8_kv_<budget>": the default config with kv_dtype=float8_e4m3fn


def read_rows(folder: Path) -> list[dict]:
    """Rows of one runner folder: samples.jsonl when the run finished, else its partial.jsonl (either
    may be stored as `.gz`)."""
    for name in ("samples.jsonl", "partial.jsonl"):
        path = Path(folder) / name
        if stored(path) is not None:
            return read_jsonl(path)
    raise FileNotFoundError(f"{folder} has neither samples.jsonl nor partial.jsonl")


def read_meta(folder: Path) -> dict:
    """The run's meta from summary.json; for a run cut short, a hand-written meta.json (command, note)."""
    summary, meta = Path(folder) / "summary.json", Path(folder) / "meta.json"
    if summary.is_file():
        return json.loads(summary.read_text())["meta"]
    return json.loads(meta.read_text()) if meta.is_file() else {"note": f"{folder}: run cut short"}


def merge(folders: list[Path], renames: dict[str, str] | None = None) -> list[dict]:
    """Rows of every folder; a (task, sample, method) seen twice keeps its last row.

    `renames` maps method families to new names, all at once (so {"sparse": "quest", "hybrid_s8":
    "sparse"} swaps labels rather than chaining): runs made before a default changed keep the
    family names they were written with.
    """
    renamed = ([dict(row, method=rename_method(row["method"], renames or {})) for row in read_rows(f)] for f in folders)
    return merge_rows(*renamed)


def merge_rows(*parts: list[dict]) -> list[dict]:
    """The rows of every part; a (task, sample, method) seen twice keeps the last part's row."""
    unique = {_row_key(row): row for rows in parts for row in rows}
    return list(unique.values())


def _row_key(row: dict) -> tuple:
    return row["task"], row.get("index", row.get("id")), row["method"]


def rename_method(name: str, renames: dict[str, str]) -> str:
    """ "sparse_512" with {"sparse": "quest"} -> "quest_512"; dense and other families unchanged."""
    family, budget = split_method(name)
    return name if budget is None or family not in renames else f"{renames[family]}_{budget}"


def parse_renames(pairs: list[str]) -> dict[str, str]:
    """["OLD=NEW", ...] -> {OLD: NEW}; a clear error for anything else."""
    renames = {}
    for pair in pairs:
        old, sep, new = pair.partition("=")
        if not (sep and old and new) or DENSE in (old, new):
            raise ValueError(f"--rename takes OLD=NEW method families (not dense), got {pair!r}")
        renames[old] = new
    return renames


def ratio_by_budget(scores: dict[str, dict[str, float]], tasks: list[str]) -> dict[str, dict[str, float]]:
    """{family: {budget: mean sparse / mean dense}} over `tasks` (those with a dense score)."""
    tasks = [t for t in tasks if DENSE in scores[t]]
    if not tasks:
        return {}
    dense = sum(scores[t][DENSE] for t in tasks) / len(tasks)
    methods = set.intersection(*(set(scores[t]) for t in tasks)) - {DENSE}
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for name in methods:
        family, budget = split_method(name)
        out[family][str(budget)] = round(sum(scores[t][name] for t in tasks) / len(tasks) / dense, 4) if dense else 0
    return {f: dict(sorted(per.items(), key=lambda kv: int(kv[0]))) for f, per in sorted(out.items())}


def ruler_report(rows: list[dict]) -> dict:
    """Scores per task, and the ratios to dense per length over the tasks dense solves (>= 20)."""
    summary = summarize(rows)
    scores = summary["score"]
    by_length: dict[int, list[str]] = defaultdict(list)
    for task in scores:
        by_length[int(task.rsplit("@", 1)[1])].append(task)
    report = {"score": scores, "samples": summary["samples"], "lengths": {}}
    for length, tasks in sorted(by_length.items()):
        kept = sorted(t for t in tasks if scores[t].get(DENSE, 0.0) >= MIN_DENSE_SCORE)
        report["lengths"][str(length)] = {
            "tasks_in_ratio": kept,
            "tasks_left_out": sorted(set(tasks) - set(kept)),
            "ratio_to_dense": ratio_by_budget(scores, kept),
        }
    return report


def variant_vs_default(folder: Path, family: str) -> dict:
    """One run's `family` (e.g. 8-bit KV blocks) against the default selector at the same budgets, in
    that run: {budget: mean family score / mean default score} over the tasks dense solves, with
    both families' ratios to dense beside it."""
    rows = read_rows(folder)
    report = ruler_report(rows)
    scores = report["score"]
    out: dict = {"run": folder.name, "lengths": {}}
    for length, detail in report["lengths"].items():
        tasks, to_dense = detail["tasks_in_ratio"], detail["ratio_to_dense"]
        budgets = [b for b in to_dense.get(family, {}) if b in to_dense.get(DEFAULT_FAMILY, {})]
        ratios, intervals = {}, {}
        for b in budgets:
            default = sum(scores[t][f"{DEFAULT_FAMILY}_{b}"] for t in tasks)
            ratios[b] = round(sum(scores[t][f"{family}_{b}"] for t in tasks) / default, 4) if default else None
            _, interval = paired_ratio(rows, tasks, f"{DEFAULT_FAMILY}_{b}", f"{family}_{b}")
            intervals[b] = None if interval is None else [round(x, 4) for x in interval]
        out["lengths"][length] = {
            "tasks_in_ratio": tasks,
            f"ratio_to_{DEFAULT_FAMILY}": ratios,
            f"ci90_to_{DEFAULT_FAMILY}": intervals,
            "ratio_to_dense": {family: to_dense.get(family, {}), DEFAULT_FAMILY: to_dense.get(DEFAULT_FAMILY, {})},
        }
    return out


def t7_verdict(ratios: dict[str, float], length: int) -> dict[str, dict]:
    """For each target fraction (1/16, 1/32) of `length`: the budget, its ratio and whether it meets the target."""
    verdict = {}
    for divisor, target in T7_TARGETS.items():
        budget = str(length // divisor)
        ratio = ratios.get(budget)
        verdict[f"1/{divisor}"] = {"budget": int(budget), "ratio": ratio, "target": target,
                                   "met": None if ratio is None else ratio >= target}  # fmt: skip
    return verdict


def build(
    ruler_folders: list[Path],
    longbench_folders: list[Path],
    renames: dict[str, str] | None = None,
    fp8_folder: Path | None = None,
    current_folders: list[Path] | None = None,
    gemma3_folders: list[Path] | None = None,
    current_renames: dict[str, str] | None = None,
) -> dict:
    """The whole report as one JSON-able dict. `renames` apply to `ruler_folders` and the LongBench
    folders, `current_renames` to `current_folders` (later runs, whose names changed less); a row of the
    latter wins a tie.
    `gemma3_folders`: RULER runs of Gemma-3-270M at 16K, judged on their own (`t7_gemma3_16k`)."""
    report: dict = {"min_dense_score": MIN_DENSE_SCORE}
    if gemma3_folders:
        report |= gemma3_report(merge(gemma3_folders))
        report["gemma3_meta"] = [read_meta(f) for f in gemma3_folders]
    if fp8_folder is not None:
        fp8 = variant_vs_default(fp8_folder, FP8_FAMILY)
        at_8k = fp8["lengths"].get("8192", {})
        report["fp8"] = fp8 | {
            "ratio_to_bf16": at_8k.get(f"ratio_to_{DEFAULT_FAMILY}", {}),
            "ci90_to_bf16": at_8k.get(f"ci90_to_{DEFAULT_FAMILY}", {}),
        }
    current_folders = current_folders or []
    if ruler_folders or current_folders:
        rows = merge_rows(merge(ruler_folders, renames), merge(current_folders, current_renames))
        ruler = ruler_report(rows)
        report["ruler"] = ruler
        report["ruler_meta"] = [read_meta(f) for f in [*ruler_folders, *current_folders]]
        eight_k = ruler["lengths"].get("8192", {}).get("ratio_to_dense", {})
        report["ratio_to_dense_8k"] = eight_k.get(DEFAULT_FAMILY, {})
        report["t7_8k"] = t7_verdict(report["ratio_to_dense_8k"], 8192)
        at_loaded = loaded_blocks(rows, 8192)
        if DEFAULT_FAMILY in at_loaded:
            report["t7"] = at_loaded[DEFAULT_FAMILY]  # the default config, judged at what it loads
        if at_loaded:
            report["t7_by_family"] = at_loaded
    if longbench_folders:
        summary = summarize(merge(longbench_folders, renames))
        report["longbench"] = {"score": summary["score"], "ratio_to_dense": summary["ratio_to_dense"],
                               "samples": summary["samples"]}  # fmt: skip
        report["longbench_meta"] = [read_meta(f) for f in longbench_folders]
    return report


def loaded_blocks(rows: list[dict], length: int) -> dict[str, dict]:
    """Every method family's accuracy block at `length` tokens, judged at what it loads (`eval.accuracy.t7`; families without
    loads or verdicts left out)."""
    blocks = {f: t7_at_loaded(rows, length, f, MIN_DENSE_SCORE) for f in families_with_loads(rows)}
    return {family: block for family, block in blocks.items() if block is not None}


def gemma3_report(rows: list[dict]) -> dict:
    """The second model's accuracy judged at what it loads at 16K: the default family's block (`t7_gemma3_16k`) and
    every family's (`t7_gemma3_16k_by_family`). Its 3 global layers are its sparse ones, so their
    loads are what each row's loaded fraction averages."""
    blocks = loaded_blocks(rows, GEMMA3_LENGTH)
    out: dict = {"t7_gemma3_16k_by_family": blocks} if blocks else {}
    if DEFAULT_FAMILY in blocks:
        out["t7_gemma3_16k"] = blocks[DEFAULT_FAMILY]
    return out


def markdown(report: dict, command: str) -> str:
    lines = ["# Accuracy: dense vs sparseserve at token budgets", "", f"Generated by `{command}`.", ""]
    lines += [f"- {note}" for note in report.get("notes", [])] + ([""] if report.get("notes") else [])
    ruler = report.get("ruler")
    if ruler:
        lines += _score_table("RULER-style suite (score 0-100, string match)", ruler["score"])
        for length, detail in ruler["lengths"].items():
            lines += [(f"**{length} tokens**: ratio of mean scores to dense over "
                       f"{', '.join(detail['tasks_in_ratio']) or 'no task'} "
                       f"(left out, dense < {MIN_DENSE_SCORE:g}: {', '.join(detail['tasks_left_out']) or 'none'})"), ""]  # fmt: skip
            lines += _ratio_table(detail["ratio_to_dense"])
        for fraction, v in report.get("t7_8k", {}).items():
            status = "no data" if v["met"] is None else ("met" if v["met"] else "missed")
            lines.append(f"- T7 at 8K, nominal budget {v['budget']} ({fraction} of the context): ratio {v['ratio']} "
                         f"vs target {v['target']}: **{status}**")  # fmt: skip
        lines.append("")
        lines += _loaded_t7_lines(report.get("t7_by_family", {}))
    lines += _loaded_t7_lines(report.get("t7_gemma3_16k_by_family", {}), "Gemma-3-270M at 16K")
    if "longbench" in report:
        lines += _score_table("LongBench", report["longbench"]["score"])
    lines += _fp8_lines(report.get("fp8"))
    for key in ("ruler_meta", "gemma3_meta", "longbench_meta"):
        for meta in report.get(key, []):
            if "command" in meta:
                lines.append(f"- `{meta['command']}` on {meta.get('device')} ({meta.get('dtype')}), "
                             f"{meta.get('seconds')} s" + (f": {meta['note']}" if "note" in meta else ""))  # fmt: skip
    return "\n".join(lines) + "\n"


def _fp8_lines(block: dict | None) -> list[str]:
    """8-bit KV blocks against model-dtype blocks, same selector and budget, one run."""
    if not block:
        return []
    lines = [(f"**8-bit KV blocks** (`{FP8_FAMILY}`, run `{block['run']}`) against the default selector with "
              "model-dtype blocks in the same run, at the same nominal budget:"), "",
             (f"| length | budget | {FP8_FAMILY} / dense | {DEFAULT_FAMILY} / dense | {FP8_FAMILY} / {DEFAULT_FAMILY} | "
              "paired bootstrap 90% CI |"), "|---|---|---|---|---|---|"]  # fmt: skip
    for length, detail in block["lengths"].items():
        to_dense, intervals = detail["ratio_to_dense"], detail.get(f"ci90_to_{DEFAULT_FAMILY}", {})
        for budget, ratio in detail[f"ratio_to_{DEFAULT_FAMILY}"].items():
            interval = intervals.get(budget)
            shown = "" if interval is None else f"[{interval[0]}, {interval[1]}]"
            lines.append(f"| {length} | {budget} | {to_dense[FP8_FAMILY][budget]} | "
                         f"{to_dense[DEFAULT_FAMILY][budget]} | {ratio} | {shown} |")  # fmt: skip
    return lines + [""]


def _loaded_t7_lines(blocks: dict[str, dict], where: str = "8K") -> list[str]:
    """Accuracy judged at the loaded fraction, one row per method family that reports loads."""
    if not blocks:
        return []
    lines = [(f"**T7 at {where} by loaded tokens** (the family's method loading the most at or below the fraction; "
              "ratio of mean scores to dense, paired bootstrap 90% CI):"), "",
             "| family | 1/16: method, loaded, ratio, CI | 1/32: method, loaded, ratio, CI | metadata fraction |",
             "|---|---|---|---|"]  # fmt: skip
    for family, block in blocks.items():
        cells = []
        for key in ("1_16", "1_32"):
            method, ratio = block[f"method_at_{key}"], block[f"ratio_at_{key}"]
            if method is None:
                cells.append("none loads that little")
                continue
            low, high = block[f"ci90_{key}"] or (None, None)
            cells.append(
                f"{method}, {block[f'loaded_fraction_{key}']:.4f}, **{ratio:.3f}**, [{_cell(low, 3)}, {_cell(high, 3)}]"
            )
        lines.append(f"| {family} | {cells[0]} | {cells[1]} | {block['metadata_fraction']:.4f} |")
    return lines + [""]


def _score_table(title: str, scores: dict[str, dict[str, float]]) -> list[str]:
    methods = sorted({m for per in scores.values() for m in per}, key=_order)
    lines = [f"## {title}", "", "| task | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for task in sorted(scores, key=lambda t: (t.rsplit("@", 1)[-1], t)):
        lines.append(f"| {task} | " + " | ".join(_cell(scores[task].get(m)) for m in methods) + " |")
    return lines + [""]


def _ratio_table(ratios: dict[str, dict[str, float]]) -> list[str]:
    budgets = sorted({int(b) for per in ratios.values() for b in per})
    lines = ["| metadata family | " + " | ".join(map(str, budgets)) + " |", "|---" * (len(budgets) + 1) + "|"]
    for family, per in ratios.items():
        lines.append(f"| {family} | " + " | ".join(_cell(per.get(str(b)), 3) for b in budgets) + " |")
    return lines + [""]


def _cell(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _order(name: str) -> tuple:
    family, budget = split_method(name)
    return (0, "", 0) if budget is None else (1, family, budget)


def budget_curves(scores: dict[str, dict[str, float]], tasks: list[str]) -> dict[str, dict[int, float]]:
    """{family: {budget: mean score over `tasks`}}, only where the family has every one of `tasks`.

    Like the dense line, a point averages all the panel's tasks: a family run on fewer of them (a
    run cut short) is left out rather than drawn over an easier or harder subset.
    """
    points: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for task in tasks:
        for name, value in scores[task].items():
            family, budget = split_method(name)
            if budget is not None:
                points[family][budget].append(value)
    curves = {f: {b: sum(v) / len(tasks) for b, v in per.items() if len(v) == len(tasks)} for f, per in points.items()}
    return {family: per for family, per in sorted(curves.items()) if per}


def plot(report: dict, path: Path) -> None:
    """Mean score over the ratio's tasks vs budget, one panel per RULER length (+ LongBench)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(f"RULER {n}", report["ruler"]["score"], d["tasks_in_ratio"])
              for n, d in report.get("ruler", {}).get("lengths", {}).items()]  # fmt: skip
    if "longbench" in report:
        panels += [(f"LongBench {t}", report["longbench"]["score"], [t]) for t in report["longbench"]["score"]]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.2 * max(len(panels), 1), 3.6), squeeze=False)
    families = sorted({split_method(m)[0] for _, scores, _ in panels for per in scores.values() for m in per} - {DENSE})
    colors = {family: f"C{i}" for i, family in enumerate(families)}  # one color per family in every panel
    for ax, (title, scores, tasks) in zip(axes[0], panels):
        if not tasks:
            continue
        for family, points in budget_curves(scores, tasks).items():
            xs = sorted(points)
            ax.plot(xs, [points[x] for x in xs], marker="o", label=family, color=colors[family])
        dense = [scores[t][DENSE] for t in tasks if DENSE in scores[t]]
        if dense:
            ax.axhline(sum(dense) / len(dense), linestyle="--", color="black", linewidth=0.8, label="dense")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token budget")
        ax.set_ylabel("mean score")
        ax.set_title(title, fontsize="medium")
        ax.legend(fontsize="small")
    fig.tight_layout()
    save_plot(fig, path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ruler", nargs="*", type=Path, default=[], help="RULER runner output folders")
    parser.add_argument(
        "--ruler-current",
        nargs="*",
        type=Path,
        default=[],
        help="later RULER runner output folders (--rename-current, not --rename, applies to them)",
    )
    parser.add_argument(
        "--gemma3",
        nargs="*",
        type=Path,
        default=[],
        help="RULER runs of Gemma-3-270M at 16K (eval.accuracy.ruler --model gemma3-270m)",
    )
    parser.add_argument("--longbench", nargs="*", type=Path, default=[], help="LongBench runner output folders")
    parser.add_argument("--out", type=Path, default=Path("eval/results"))
    parser.add_argument(
        "--note", action="append", default=[], help="a line for the report (e.g. how samples were built)"
    )
    parser.add_argument(
        "--fp8", type=Path, default=None, help=f"a RULER run with the {FP8_FAMILY} family beside the default"
    )
    parser.add_argument("--rename", action="append", default=[], help="OLD=NEW method family, e.g. sparse=quest")
    parser.add_argument("--rename-current", action="append", default=[], help="OLD=NEW for the --ruler-current folders")
    args = parser.parse_args(argv)
    if not (args.ruler or args.ruler_current or args.gemma3 or args.longbench or args.fp8 is not None):
        raise ValueError("give at least one --ruler, --ruler-current, --gemma3, --longbench or --fp8 folder")
    renames = parse_renames(args.rename)
    current_renames = parse_renames(args.rename_current)
    report = build(args.ruler, args.longbench, renames, args.fp8, args.ruler_current, args.gemma3, current_renames)
    command = "python -m eval.accuracy.accuracy_report " + " ".join(argv if argv is not None else sys.argv[1:])
    report["command"] = command
    report["notes"] = args.note
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    (args.out / "accuracy.md").write_text(markdown(report, command))
    plot(report, args.out / "accuracy.png")
    print((args.out / "accuracy.md").read_text())
    return report


if __name__ == "__main__":
    main()
