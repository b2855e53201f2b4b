"""Run JSONs made small enough to commit: everything but the per-token times.

A run's file keeps every token's time of every request (megabytes for a saturated `decode_heavy`
run). What the README and docs quote from a run is kept here instead: its summary, the engine's
counters, its config, its TBT quantiles, and per request its TTFT, queueing, first and longest gap
between tokens, finish reason and error.
"""

from __future__ import annotations

import itertools
import json
import lzma
import math
from pathlib import Path
from typing import Any

import numpy as np

from eval.results_io import read_json

TBT_QUANTILES = (0.1, 0.5, 0.9, 0.99)
PART_KEYS = ("command", "device", "git_commit")  # what a joined run says of each part
KEPT = ("system", "rate", "requests_from", "command", "device", "git_commit", "locality", "overrides", "hbm_cap",
        "trace", "summary", "engine", "kernels_first_seen", "deadline_s", "stop_queueing_s")  # fmt: skip


def compact_run(run: dict[str, Any]) -> dict[str, Any]:
    """One run's JSON (`eval.serving run`'s file) without its per-token times; seconds to 0.1 ms."""
    gaps = [_gaps(record) for record in run["records"]]
    every_gap = [gap for request_gaps in gaps for gap in request_gaps]
    out = {key: run[key] for key in KEPT if key in run}
    quantiles = np.quantile(every_gap, TBT_QUANTILES) if every_gap else [None] * len(TBT_QUANTILES)
    out["tbt_quantiles_s"] = {str(q): _seconds(v) for q, v in zip(TBT_QUANTILES, quantiles)}
    out["requests"] = [_request(record, request_gaps) for record, request_gaps in zip(run["records"], gaps)]
    return out


def _gaps(record: dict[str, Any]) -> list[float]:
    """Seconds between a request's consecutive tokens."""
    return [b - a for a, b in itertools.pairwise(record.get("token_times") or [])]


def _request(record: dict[str, Any], gaps: list[float]) -> dict[str, Any]:
    times, arrival = record.get("token_times") or [], record["arrival"]
    admitted = record.get("admitted")
    return {
        "index": record["index"],
        "prompt_tokens": record["prompt_tokens"],
        "output_tokens": record["output_tokens"],
        "ttft_s": _seconds(times[0] - arrival) if times else None,
        "queueing_s": None if admitted is None else _seconds(admitted - arrival),
        "first_gap_s": _seconds(gaps[0]) if gaps else None,
        "max_gap_s": _seconds(max(gaps)) if gaps else None,
        "finish_reason": record.get("finish_reason"),
        "error": record.get("error"),
    }


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(float(value), 4)


def write_compact(named_runs: dict[str, Path], note: str, out: Path) -> dict[str, Any]:
    """`{name: run file}` -> one JSON of their compact forms under `"runs"`, with `note`; written to
    `out`, xz-compressed where its name ends in `.xz`."""
    result = {
        "note": note,
        "runs": {name: compact_run(json.loads(path.read_text())) for name, path in named_runs.items()},
    }
    text = json.dumps(result, indent=1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(lzma.compress(text.encode()) if out.suffix == ".xz" else text.encode())
    return result


def join_compact(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Compact saturated runs of one system over consecutive parts of a trace (each `--skip`-ped past the
    parts before it, listed in that order) as the one run they stand for, as `report.join_parts` joins
    full runs: a part starts when the parts before it have ended, so its requests' TTFTs grow by the
    spans before it. Returns that run's requests, generated tokens, span, tokens/s and mean TTFT.

    ValueError where the parts cannot stand for one run: a part that did not serve every request it
    was given (a ratio over the rest would flatter it), a run at a finite rate, or parts whose
    requests are not consecutive in the listed order."""
    offset, tokens, ttfts, last = 0.0, 0, [], None
    for number, part in enumerate(parts):
        _check_part(number, part, last)
        tokens += part["summary"]["generated_tokens"]
        ttfts += [offset + r["ttft_s"] for r in part["requests"]]
        offset += part["summary"]["span_s"]
        last = part["requests"][-1]["index"]
    return {
        "requests": len(ttfts),
        "generated_tokens": tokens,
        "span_s": offset,
        "throughput_tokens_per_s": tokens / offset,
        "mean_ttft_s": sum(ttfts) / len(ttfts),
    }


def _check_part(number: int, part: dict[str, Any], last_index: int | None) -> None:
    """ValueError naming part `number` where it is not a saturated run that served all its requests,
    or its requests do not follow `last_index` (the part before's last request) one by one."""
    summary, indices = part["summary"], [r["index"] for r in part["requests"]]
    if float(part.get("rate", math.inf)) != math.inf:
        raise ValueError(f"part {number} ran at {part['rate']} requests/s: only saturated runs join")
    served = [r for r in part["requests"] if r["error"] is None and r["ttft_s"] is not None]
    if not indices or summary["failed"] or summary["completed"] != len(indices) or len(served) != len(indices):
        raise ValueError(
            f"part {number} completed {summary['completed']} of {len(indices)} requests: a joined run needs all"
        )
    first = indices[0] if last_index is None else last_index + 1
    if indices != list(range(first, first + len(indices))):
        raise ValueError(f"part {number} serves requests {indices[0]}..{indices[-1]}, not the ones after {last_index}")


def join_saturated(stock: list[str], ours: list[str]) -> dict[str, Any]:
    """Stock's and ours' saturated runs, each given as `FILE:RUN` parts of compact files (`write_compact`)
    in trace order, joined (`join_compact`) and compared: ours' tokens/s and stock's mean TTFT over
    ours'. Both must have served the same requests."""
    files = {item.rpartition(":")[0]: None for item in stock + ours}
    runs = {path: read_json(Path(path))["runs"] for path in files if path}  # each file read once
    sides = {}
    for side, items in (("stock", stock), ("ours", ours)):
        parts = [_compact_part(item, runs) for item in items]
        systems = {part["system"] for _, part in parts}
        if len(systems) != 1:
            raise ValueError(f"{side}'s parts come from several systems: {sorted(systems)}")
        sides[side] = {
            "system": systems.pop(),
            "parts": [{"part": item, **{k: part.get(k) for k in PART_KEYS}} for item, part in parts],
            "joined": join_compact([part for _, part in parts]),
            "served": sorted(r["index"] for _, part in parts for r in part["requests"]),
        }  # fmt: skip
    if sides["stock"]["served"] != sides["ours"]["served"]:
        raise ValueError("stock and ours must have served the same requests")
    stock_joined, ours_joined = sides["stock"]["joined"], sides["ours"]["joined"]
    return sides | {
        "throughput_ratio": ours_joined["throughput_tokens_per_s"] / stock_joined["throughput_tokens_per_s"],
        "mean_ttft_ratio": stock_joined["mean_ttft_s"] / ours_joined["mean_ttft_s"],
    }


def merge_saturated(serving_json: Path, name: str, joined: dict[str, Any], source: Path) -> None:
    """`join_saturated`'s result (written to `source`) as trace `name`'s saturated point in serving.json,
    under the keys `report` gives a saturated point (`saturated_best_stock`, `saturated_throughput_ratio`,
    `saturated_ttft_ratio`), with the joined figures, `source` and the stock systems compared (one: the
    joined one) under `saturated_joined`. Other keys and blocks are kept, but an earlier saturated note
    goes. A later `report --name` rewrites the whole block: join again after it."""
    merged = json.loads(serving_json.read_text()) if serving_json.is_file() else {}
    block = merged.setdefault(name, {})
    block.pop("saturated_note", None)
    block["saturated_best_stock"] = joined["stock"]["system"]
    block["saturated_throughput_ratio"] = joined["throughput_ratio"]
    block["saturated_ttft_ratio"] = joined["mean_ttft_ratio"]
    block["saturated_joined"] = {
        "source": str(source),
        "stock_systems_compared": [joined["stock"]["system"]],
        "stock": joined["stock"]["joined"],
        "ours": joined["ours"]["joined"],
    }
    serving_json.write_text(json.dumps(merged, indent=2) + "\n")


def _compact_part(item: str, runs: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """`FILE:RUN` -> (item, that compact run), from `runs` ({file: its runs})."""
    path, sep, name = item.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"each part is FILE:RUN, got {item!r}")
    if name not in runs[path]:
        raise ValueError(f"{path} has no run {name!r} (it has {', '.join(runs[path])})")
    return item, runs[path][name]
