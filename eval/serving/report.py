"""Merge run JSONs into eval/results/serving.{json,md,png}: goodput, r*, the ratios against best stock, the ladder."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from eval.results_io import glob_stored, read_json, save_plot, stored
from eval.serving.metrics import SLO_MEAN_QUEUEING_S, SLO_TBT_ITERATIONS, RequestRecord, goodput, summarize
from eval.serving.setup import LADDER, STOCK

PLOTTED = (("throughput_tokens_per_s", "throughput (tokens/s)"), ("mean_ttft_s", "mean TTFT (s)"),
           ("p50_tbt_s", "p50 TBT (s)"), ("mean_queueing_s", "mean queueing delay (s)"))  # fmt: skip


def load_runs(folders: list[Path]) -> tuple[dict[str, dict[float, dict]], float | None, list[str]]:
    """{system: {rate: run}} from every run_*.json, the dense iteration from calibration.json, commands
    (either may be stored as `.gz`). A saturated run stored in parts is joined (`join_parts`)."""
    runs: dict[str, dict[float, dict]] = {}
    parts: dict[tuple[str, float], list[dict]] = {}
    dense, commands = None, []
    for folder in folders:
        calibration = folder / "calibration.json"
        if stored(calibration) is not None:
            data = read_json(calibration)
            dense = dense if dense is not None else data["dense_iteration_s"]
            commands.append(data["command"])
        for path in glob_stored(folder, "run_*.json"):
            run = read_json(path)
            parts.setdefault((run_label(run), float(run["rate"])), []).append(run)
            commands.append(run["command"])
    for (label, rate), found in sorted(parts.items(), key=lambda item: (_system_order(item[0][0]), item[0])):
        runs.setdefault(label, {})[rate] = found[0] if len(found) == 1 else join_parts(found)
    return runs, dense, list(dict.fromkeys(commands))  # one line per process, not per rate


def _system_order(label: str) -> int:
    """Where a run's system stands in the tables: stock's systems, then ours' rungs in ladder order
    (variants and random-KV runs beside their rung), then anything else."""
    order = (*STOCK, *LADDER)
    system = next((name for name in sorted(order, key=len, reverse=True) if label.startswith(name)), None)
    return order.index(system) if system is not None else len(order)


def run_label(run: dict[str, Any]) -> str:
    """The run's system, with `@random_kv` for ours' rungs run on the random model's own selections
    (the targets judge ours at real locality: the recorded selection trace drives its loads) and
    `[field=value,...]` for a rung run with config overrides (a variant, compared beside the rungs)."""
    random_kv = run.get("locality") == "random" and run["system"] in LADDER
    overrides = run.get("overrides") or {}
    variant = "[" + ",".join(f"{k}={v}" for k, v in sorted(overrides.items())) + "]" if overrides else ""
    return run["system"] + variant + ("@random_kv" if random_kv else "")


def join_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A saturated run split into parts (`--skip`: each part the requests from its own index on) as
    the one run it stands for: every part started when the parts before it had ended, so its times
    move by their spans (each part's last token). Stock's static batches are independent, which
    makes this the unsplit run up to how the batches at a part's edge were formed."""
    starts = sorted(part.get("requests_from", 0) for part in parts)
    if len(set(starts)) < len(starts) or any(float(part["rate"]) != math.inf for part in parts):
        raise ValueError(f"only saturated runs in parts from distinct requests join; got parts from {starts}")
    records, offset = [], 0.0
    for part in sorted(parts, key=lambda run: run.get("requests_from", 0)):
        ends = [offset]
        for record in part["records"]:
            moved = dict(record, token_times=[t + offset for t in record["token_times"]])
            if record.get("admitted") is not None:
                moved["admitted"] = record["admitted"] + offset
            records.append(moved)
            ends += moved["token_times"][-1:]
        offset = max(ends)
    return dict(parts[0], records=records, parts_from=starts)


def analyse(runs: dict[str, dict[float, dict]], dense: float | None) -> dict[str, Any]:
    """Per-system summaries with the SLO verdict, goodputs, r*, the ratios at r* and 1.5 r*, the ladder;
    saturated runs (rate inf) in their own block, and the goodput pair."""
    table = {
        system: {rate: summarize([RequestRecord.from_dict(r) for r in run["records"]], dense) for rate, run in by_rate.items()}
        for system, by_rate in runs.items()
    }  # fmt: skip
    saturated = {s: by_rate.pop(math.inf) for s, by_rate in table.items() if math.inf in by_rate}
    table = {s: by_rate for s, by_rate in table.items() if by_rate}
    served = {s: frozenset(r["index"] for r in runs[s][math.inf]["records"]) for s in saturated}
    head = saturated_ratios(saturated, served)
    good = {s: goodput({rate: bool(v.get("meets_slo")) for rate, v in by_rate.items()}) for s, by_rate in table.items()}
    result = _analyse_rates(table, good, runs, dense) | head
    if "ours" in table:
        result |= goodput_pair(table, good)
    return result


def saturated_ratios(saturated: dict[str, dict], served: dict[str, frozenset[int]]) -> dict[str, Any]:
    """Every request at time zero: ours against the stock system with the most tokens/s among those
    that served the same requests (`served`: each system's request indices; a run in parts covers
    the trace once every part has run). Where none did, a note says what each served instead."""
    out: dict[str, Any] = {"saturated": saturated}
    if "ours" not in saturated:
        return out
    stock = [s for s in STOCK if s in saturated and served[s] == served["ours"]]
    if not stock:
        others = [f"{s} {len(served[s])}" for s in STOCK if s in saturated]
        if others:
            out["saturated_note"] = f"no stock run served ours' {len(served['ours'])} requests ({', '.join(others)})"
        return out
    best = max(stock, key=lambda s: saturated[s].get("throughput_tokens_per_s") or 0.0)
    ours, theirs = saturated["ours"], saturated[best]
    return out | {
        "saturated_best_stock": best,
        "saturated_throughput_ratio": _ratio(
            ours.get("throughput_tokens_per_s"), theirs.get("throughput_tokens_per_s")
        ),
        "saturated_ttft_ratio": _ratio(theirs.get("mean_ttft_s"), ours.get("mean_ttft_s")),
    }


def goodput_pair(table: dict[str, dict[float, dict]], good: dict[str, float]) -> dict[str, Any]:
    """Ours at its goodput against the highest rate of at most a third of it where every stock
    system that ran there missed the SLO: the lower bound of the goodput ratio, and p50 TBT there."""
    rate = good["ours"]
    stock = [s for s in STOCK if s in table]
    missed = [
        r for r in {r for s in stock for r in table[s]}
        if r <= rate / 3 * (1 + 1e-9) and all(not table[s][r].get("meets_slo") for s in stock if r in table[s])
    ]  # fmt: skip
    out: dict[str, Any] = {"goodput_rate_ours": rate, "goodput_rate_stock_missed": max(missed) if missed else None}
    if rate > 0 and missed:
        low = max(missed)
        tbt = min((table[s][low]["p50_tbt_s"] for s in stock if low in table[s] and table[s][low].get("p50_tbt_s")),
                  default=None)  # fmt: skip
        out |= {
            "goodput_ratio_lower_bound": rate / low,
            "goodput_tbt_p50_ratio": _ratio(_at(table["ours"], rate, "p50_tbt_s"), tbt),
        }
    return out


def _analyse_rates(
    table: dict[str, dict[float, dict]], good: dict[str, float], runs: dict[str, dict[float, dict]], dense: float | None
) -> dict[str, Any]:
    """The Poisson-rate part of `analyse` (rate inf set aside)."""
    stock = [s for s in STOCK if s in table]
    result: dict[str, Any] = {"dense_iteration_s": dense, "goodput": good, "systems": _json_rates(table)}
    if not stock or "ours" not in table or dense is None:
        result["missing"] = "need a calibration, a stock system and `ours` to compare"
        return result
    lowest = {s: min(table[s]) for s in stock}

    def judged_rate(system: str) -> float:  # its goodput, or its lowest rate where it met the SLO at none
        return good[system] if good[system] > 0 else lowest[system]

    best = max(stock, key=lambda s: (good[s], _at(table[s], judged_rate(s), "throughput_tokens_per_s") or 0.0))
    r_star, judged = good[best], judged_rate(best)
    result |= {"best_stock": best, "r_star": r_star, "judged_at": judged, "goodput_ratio": _ratio(good["ours"], r_star)}
    if r_star == 0:
        result["r_star_note"] = f"{best} met the SLO at no measured rate (r* < {judged:g}): ratios at {judged:g} req/s"
    result |= _ratios(table["ours"], table[best], judged)
    result["at_1.5r"] = _ratios(table["ours"], table[best], 1.5 * judged)
    rungs = [s for s in LADDER if s in table]
    ladder_rate = _ladder_rate([table[s] for s in rungs], judged)
    result["ladder"] = {s: _ladder_row(table[s], good[s], ladder_rate) for s in rungs}
    result["engine"] = {
        s: {f"{rate:g}": run.get("engine", {}) for rate, run in sorted(runs[s].items()) if rate != math.inf}
        for s in LADDER
        if s in runs
    }
    return result


def _ladder_rate(tables: list[dict[float, dict]], judged: float) -> float:
    """The rate the rungs are compared at: r*'s (judged), or else the highest rate every rung ran."""
    shared = set.intersection(*(set(t) for t in tables)) if tables else set()
    return judged if judged in shared or not shared else max(shared)


def _ladder_row(table: dict[float, dict], good: float, rate: float) -> dict[str, float | None]:
    """One rung: its goodput and, at the judged rate, its throughput and latencies."""
    keys = ("throughput_tokens_per_s", "mean_ttft_s", "p50_tbt_s", "mean_queueing_s")
    return {"goodput": good, "rate": rate} | {key: _at(table, rate, key) for key in keys}


def _ratios(ours: dict[float, dict], stock: dict[float, dict], rate: float) -> dict[str, float | None]:
    """The throughput, TTFT and TBT ratios at one rate (None where either side has no run at that rate)."""

    def at(table: dict[float, dict], key: str) -> float | None:
        return _at(table, rate, key)

    return {
        "rate": rate,
        "throughput_ratio_vs_best_stock": _ratio(
            at(ours, "throughput_tokens_per_s"), at(stock, "throughput_tokens_per_s")
        ),
        "ttft_ratio_vs_best_stock": _ratio(at(stock, "mean_ttft_s"), at(ours, "mean_ttft_s")),
        "tbt_p50_ratio": _ratio(at(ours, "p50_tbt_s"), at(stock, "p50_tbt_s")),
    }


def _at(table: dict[float, dict], rate: float, key: str) -> float | None:
    match = [v for r, v in table.items() if abs(r - rate) <= 1e-9 * max(1.0, rate)]
    return match[0].get(key) if match else None


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return None if top is None or not bottom else top / bottom


def _json_rates(table: dict[str, dict[float, dict]]) -> dict[str, dict[str, dict]]:
    return {s: {f"{rate:g}": v for rate, v in sorted(by_rate.items())} for s, by_rate in table.items()}


def write_report(folders: list[Path], out: Path, command: str, name: str | None = None) -> dict[str, Any]:
    """serving.json, .md and .png in `out`; with `name`, the runs are one trace's block of
    serving.json (other blocks kept) and the files are serving_NAME.md / .png."""
    runs, dense, commands = load_runs(folders)
    result = analyse(runs, dense) | {"command": command, "runs": commands}
    out.mkdir(parents=True, exist_ok=True)
    stem = "serving" if name is None else f"serving_{name}"
    (out / f"{stem}.md").write_text(markdown(result))
    plot(result, out / f"{stem}.png")
    plot_tbt(runs, dense, out / f"{stem}_tbt.png")
    print(markdown(result))
    if name is None:
        (out / "serving.json").write_text(json.dumps(result, indent=2) + "\n")
        return result
    path = out / "serving.json"
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged[name] = named_block(result)
    path.write_text(json.dumps(merged, indent=2) + "\n")
    return merged[name]


def named_block(result: dict[str, Any]) -> dict[str, Any]:
    """A trace's block under its named keys: the goodput pair's p50 TBT ratio is
    `tbt_p50_ratio`; the ratios at the rate r* judged are under `at_judged`."""
    block = dict(result)
    judged = {key: block.pop(key) for key in ("rate", "throughput_ratio_vs_best_stock", "ttft_ratio_vs_best_stock",
                                              "tbt_p50_ratio") if key in block}  # fmt: skip
    block["at_judged"] = judged
    block["tbt_p50_ratio"] = block.pop("goodput_tbt_p50_ratio", None)
    return block


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Serving benchmark",
        "",
        f"Dense decode iteration (SLO unit): {_fmt(result.get('dense_iteration_s'))} s",
        "",
        (
            f"SLO: p99 TBT <= {SLO_TBT_ITERATIONS:g} dense iterations, mean queueing delay <= {SLO_MEAN_QUEUEING_S:g} s, "
            "and every request served in full. Goodput: the highest rate below the first missed one."
        ),
        "",
    ]
    lines += ["| system | goodput (req/s) |", "|---|---|"] + [f"| {s} | {g:g} |" for s, g in result["goodput"].items()]
    if result.get("saturated"):
        lines += ["", "Saturated (every request at time zero):", "",
                  "| system | served | tokens/s | mean TTFT s | p50 TBT s | p99 TBT s |", "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {s} | {v['completed']}/{v['requests']} | {_fmt(v.get('throughput_tokens_per_s'))} | "
                  f"{_fmt(v.get('mean_ttft_s'))} | {_fmt(v.get('p50_tbt_s'))} | {_fmt(v.get('p99_tbt_s'))} |"
                  for s, v in result["saturated"].items()]  # fmt: skip
        if "saturated_note" in result:
            lines += ["", f"no saturated ratios: {result['saturated_note']}"]
        if "saturated_throughput_ratio" in result:
            lines += ["", (f"saturated vs {result['saturated_best_stock']}: tokens/s "
                      f"{_fmt(result['saturated_throughput_ratio'])}x, mean TTFT {_fmt(result['saturated_ttft_ratio'])}x")]  # fmt: skip
    if result.get("goodput_rate_stock_missed") is not None:
        lines += ["", (f"goodput pair: ours meets the SLO at {result['goodput_rate_ours']:g} req/s, stock misses it at "
                  f"{result['goodput_rate_stock_missed']:g} (ratio >= {_fmt(result.get('goodput_ratio_lower_bound'))}, "
                  f"p50 TBT ours/stock {_fmt(result.get('goodput_tbt_p50_ratio'))})")]  # fmt: skip
    if "r_star" in result:
        lines += ["", f"r* = {result['r_star']:g} req/s (best stock: {result['best_stock']})", ""]
        if "r_star_note" in result:
            lines += [result["r_star_note"], ""]
        lines += ["| at | throughput x | mean TTFT x | p50 TBT (ours/stock) |", "|---|---|---|---|"]
        for row in (result, result["at_1.5r"]):
            lines.append(f"| {row['rate']:g} req/s | {_fmt(row['throughput_ratio_vs_best_stock'])} | "
                         f"{_fmt(row['ttft_ratio_vs_best_stock'])} | {_fmt(row['tbt_p50_ratio'])} |")  # fmt: skip
    lines += ["", "| system | rate | served | tokens/s | mean TTFT s | p50 TBT s | p99 TBT s | mean queueing s | SLO |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for system, by_rate in result["systems"].items():
        for rate, v in by_rate.items():
            lines.append(
                f"| {system} | {rate} | {v['completed']}/{v['requests']} | {_fmt(v['throughput_tokens_per_s'])} | "
                f"{_fmt(v['mean_ttft_s'])} | {_fmt(v['p50_tbt_s'])} | {_fmt(v['p99_tbt_s'])} | "
                f"{_fmt(v['mean_queueing_s'])} | {'met' if v.get('meets_slo') else 'missed'} |"
            )
    if result.get("ladder"):
        lines += ["", "Ablation ladder (each rung adds one switch; `ours` adds CUDA graphs to the last):", "",
                  "| rung | rate | tokens/s | mean TTFT s | p50 TBT s | mean queueing s |", "|---|---|---|---|---|---|"]  # fmt: skip
        for rung, v in result["ladder"].items():
            lines.append(f"| {rung} | {v['rate']:g} | {_fmt(v['throughput_tokens_per_s'])} | {_fmt(v['mean_ttft_s'])} | "
                         f"{_fmt(v['p50_tbt_s'])} | {_fmt(v['mean_queueing_s'])} |")  # fmt: skip
    if result.get("engine"):
        lines += ["", "Engine breakdown (ours and its rungs): seconds in iterations by kind (count)", "",
                  "| rung | rate | hit rate | H2D GiB | graph captures | decode | mixed | prefill |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for rung, by_rate in result["engine"].items():
            for rate, e in by_rate.items():
                lines.append(f"| {rung} | {rate} | {_fmt(e.get('hit_rate'))} | {_fmt(e.get('h2d_bytes', 0) / 2**30)} | "
                             f"{e.get('graph_captures', 'n/a')} | " + " | ".join(_kind(e, k) for k in ("decode", "mixed", "prefill")) + " |")  # fmt: skip
    lines += ["", "Commands:", ""] + [f"- `{c}`" for c in result["runs"]]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """The paper's Figs. 10-12 style: each metric against the arrival rate, a line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    colors = {system: f"C{i % 10}" for i, system in enumerate(result["systems"])}  # one per system in every panel
    for ax, (key, label) in zip(axes.flat, PLOTTED):
        for system, by_rate in result["systems"].items():
            points = [(float(r), v.get(key)) for r, v in by_rate.items() if v.get(key) is not None]
            if points:
                ax.plot(*zip(*sorted(points)), marker="o", label=system, color=colors[system])
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel(label)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    save_plot(fig, path)
    plt.close(fig)


def tbt_by_system(runs: dict[str, dict[float, dict]], rate: float = math.inf) -> dict[str, list[float]]:
    """Every time between tokens of the served requests, per system, in its run at `rate`."""
    out = {}
    for system, by_rate in runs.items():
        if rate in by_rate:
            records = [RequestRecord.from_dict(r) for r in by_rate[rate]["records"]]
            out[system] = sorted(x for r in records if r.error is None for x in r.tbt)
    return {system: tbt for system, tbt in out.items() if tbt}


def plot_tbt(runs: dict[str, dict[float, dict]], dense: float | None, path: Path) -> None:
    """The distribution of the time between tokens in the saturated runs (one CDF per system), the
    SLO's p99 bound beside it: whether prefill work stalls the decode steps it shares iterations with."""
    tbt = tbt_by_system(runs)
    if not tbt:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, values in sorted(tbt.items()):
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=system)
    if dense is not None:
        ax.axvline(SLO_TBT_ITERATIONS * dense, color="k", linestyle="--", label="SLO: p99 TBT bound")
    ax.set_xscale("log")
    ax.set_xlabel("time between tokens (s), every request at time zero")
    ax.set_ylabel("fraction of tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_plot(fig, path)
    plt.close(fig)


def _kind(engine: dict[str, Any], kind: str) -> str:
    spent = engine.get("iterations_by_kind", {}).get(kind)
    return "n/a" if spent is None else f"{spent['total_s']:.3g} ({spent['count']})"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"
