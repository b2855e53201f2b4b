"""Accuracy judged at what a budget loads: the ratio to dense at <= 1/16 and <= 1/32 of the context *loaded*.

A budget's cost is the tokens a KV head loads per decode step (its loaded
blocks + the tail), not the nominal `token_budget`. Every sparse row of `eval.accuracy.ruler` carries the
batch's `loaded_fraction` and `metadata_fraction` (`eval.common.answer_batch`). For one method family
at one length this picks, per target fraction, the family's method with the largest mean loaded
fraction at or below it, and reports its ratio of mean scores to dense over the tasks dense solves,
with a paired bootstrap 90% interval (samples resampled within each task, the same draw for dense and
sparse).
"""

from __future__ import annotations

import random
from collections import defaultdict

from eval.common import DENSE, ORACLE, split_method

FRACTIONS = {"1_16": 1 / 16, "1_32": 1 / 32}
TARGETS = {"1_16": 0.99, "1_32": 0.97}


def t7_at_loaded(
    rows: list[dict], length: int, family: str, min_dense: float, resamples: int = 1000, seed: int = 0
) -> dict | None:
    """The loaded-fraction verdicts of `family` at `length` tokens, or None when no row of it carries loads.

    Keys: ratio_at_1_16 / _1_32 (None where no method loads that little), loaded_fraction_1_16 /
    _1_32 (the chosen method's mean), method_at_1_16 / _1_32, ci90_1_16 / _1_32 ([low, high]),
    metadata_fraction (the family's mean), oracle_at_1_16 / _1_32 (the block oracle's ratio, picked
    the same way from the "oracle" family over the same tasks; None without one),
    target_1_16 / _1_32, n_tasks, n_samples_per_task (the smallest over the tasks), tasks.
    """
    at_length = [r for r in rows if r["task"].endswith(f"@{length}")]
    scores = _scores_by_task(at_length)  # task -> method -> {sample index: score}
    tasks = sorted(t for t, per in scores.items() if DENSE in per and _mean(per[DENSE]) >= min_dense)
    loads = _family_loads(at_length, family)  # method -> (loaded fraction, metadata fraction)
    if not tasks or not loads:
        return None
    block: dict = {"tasks": tasks, "n_tasks": len(tasks)}
    block["metadata_fraction"] = sum(m for _, m in loads.values()) / len(loads)
    oracle_loads = _family_loads(at_length, ORACLE)
    counts = []
    for key, fraction in FRACTIONS.items():
        method = _largest_fitting(loads, fraction, scores, tasks)
        block[f"method_at_{key}"] = method
        block[f"loaded_fraction_{key}"] = loads[method][0] if method else None
        block[f"target_{key}"] = TARGETS[key]
        oracle = _largest_fitting(oracle_loads, fraction, scores, tasks)
        block[f"oracle_at_{key}"] = (
            _ratio({t: _paired(scores[t][DENSE], scores[t][oracle]) for t in tasks}) if oracle else None
        )
        if method is None:
            block[f"ratio_at_{key}"] = block[f"ci90_{key}"] = None
            continue
        pairs = {t: _paired(scores[t][DENSE], scores[t][method]) for t in tasks}
        counts += [len(p) for p in pairs.values()]
        block[f"ratio_at_{key}"] = _ratio(pairs)
        block[f"ci90_{key}"] = _bootstrap(pairs, resamples, seed)
    block["n_samples_per_task"] = min(counts) if counts else 0
    return block


def paired_ratio(
    rows: list[dict], tasks: list[str], base: str, other: str, resamples: int = 1000, seed: int = 0
) -> tuple[float | None, list[float] | None]:
    """`other`'s mean score over `base`'s (methods of one run) over `tasks`, on the samples both
    answered, and its paired bootstrap 90% interval (the same draw for both methods)."""
    scores = _scores_by_task(rows)
    pairs = {t: _paired(scores[t][base], scores[t][other]) for t in tasks if base in scores[t] and other in scores[t]}
    return _ratio(pairs), _bootstrap(pairs, resamples, seed)


def _largest_fitting(
    loads: dict[str, tuple[float, float]], fraction: float, scores: dict, tasks: list[str]
) -> str | None:
    """The method loading the most at or below `fraction` among those every task has, or None."""
    fitting = {m: f for m, (f, _) in loads.items() if f <= fraction and all(m in scores[t] for t in tasks)}
    return max(fitting, key=fitting.get) if fitting else None


def families_with_loads(rows: list[dict]) -> list[str]:
    """The method families whose rows carry a loaded fraction."""
    return sorted({split_method(r["method"])[0] for r in rows if "loaded_fraction" in r})


def _scores_by_task(rows: list[dict]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        out[row["task"]][row["method"]][row.get("index", row.get("id"))] = row["score"]
    return out


def _family_loads(rows: list[dict], family: str) -> dict[str, tuple[float, float]]:
    values: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        if "loaded_fraction" in row and split_method(row["method"])[0] == family:
            values[row["method"]].append((row["loaded_fraction"], row.get("metadata_fraction", 0.0)))
    return {m: (sum(f for f, _ in v) / len(v), sum(x for _, x in v) / len(v)) for m, v in values.items()}


def _paired(dense: dict, sparse: dict) -> list[tuple[float, float]]:
    """(dense, sparse) scores of the samples both methods answered."""
    return [(dense[i], sparse[i]) for i in sorted(dense, key=str) if i in sparse]


def _mean(values: dict) -> float:
    return sum(values.values()) / len(values) if values else 0.0


def _ratio(pairs: dict[str, list[tuple[float, float]]]) -> float | None:
    """Mean over tasks of the sparse task means / the same for dense (the suite's ratio of mean scores)."""
    dense = sum(sum(d for d, _ in p) / len(p) for p in pairs.values() if p)
    sparse = sum(sum(s for _, s in p) / len(p) for p in pairs.values() if p)
    return sparse / dense if dense else None


def _bootstrap(pairs: dict[str, list[tuple[float, float]]], resamples: int, seed: int) -> list[float] | None:
    """The 5th and 95th percentiles of the ratio over `resamples` paired resamples within each task."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        drawn = {t: [p[rng.randrange(len(p))] for _ in p] for t, p in pairs.items() if p}
        ratio = _ratio(drawn)
        if ratio is not None:
            ratios.append(ratio)
    if not ratios:
        return None
    ratios.sort()
    return [ratios[int(0.05 * (len(ratios) - 1))], ratios[int(0.95 * (len(ratios) - 1))]]
