"""What the accuracy runners share: methods to compare, greedy answers, and result files.

A method is dense attention, `SparseServeCache` at one token budget, or the block oracle
(`eval.accuracy.oracle_attention`) at one budget: the ceiling of a selector. Every runner writes, under
its output folder: `samples.jsonl` (one JSON line per sample and method), `summary.json`
(score per task and method, and sparse/dense ratios), `results.md` (the same as a table) and
`score_vs_budget.png`.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from eval.accuracy.oracle_attention import oracle_run
from eval.results_io import save_plot
from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.compat import cache_kwarg
from sparseserve_hf.generation.sizing import EngineSizes

DENSE = "dense"
ORACLE = "oracle"  # the block oracle's method family (`eval.accuracy.oracle_attention`)


@dataclass(frozen=True)
class Method:
    """One way of answering: dense attention (config None) or SparseServeCache with `config`.

    Sparse names are "<family>_<budget>": "sparse_512" for the default config, "cuboid_512" for a
    variant family, so tables and plots group a family's budgets into one curve.
    """

    name: str
    config: SparseServeConfig | None = None
    oracle: bool = False  # attend through the block oracle at `config`'s budget (dense KV, no cache)

    @property
    def budget(self) -> int | None:
        return None if self.config is None else self.config.token_budget


def methods_for(budgets: list[int], base: SparseServeConfig | None = None, family: str = "sparse") -> list[Method]:
    """Dense first, then one sparse method per budget (other fields from `base`)."""
    base = base or SparseServeConfig()
    return [Method(DENSE)] + [Method(f"{family}_{b}", replace(base, token_budget=b)) for b in budgets]


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """ "quest_s8:metadata_sub_blocks=4:window_blocks=2" -> ("quest_s8", {...}): a method family and its
    SparseServeConfig overrides (validated by building a config). Values parse as int, float, bool
    ("true"/"false"), comma-separated ints for `dense_layers`, else str.
    """
    family, *parts = text.split(":")
    if not family or "=" in family:
        raise ValueError(f"--variant needs FAMILY:field=value[:field=value...], got {text!r}")
    overrides: dict[str, Any] = {}
    for part in parts:
        field, sep, raw = part.partition("=")
        if not sep:
            raise ValueError(f"--variant {text!r}: {part!r} is not field=value")
        overrides[field] = _parse_value(field, raw)
    SparseServeConfig.from_dict(overrides)  # unknown fields and bad values fail here, naming the field
    return family, overrides


def _parse_value(field: str, raw: str) -> Any:
    if field == "dense_layers":
        return tuple(int(x) for x in raw.split(",") if x.strip())
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


# The hybrid group union: SparseServeConfig() until channel scores became the default, and the selection
# every block-summary run (quest, cuboid, hybrid) was made with.
HYBRID_UNION = {"metadata": "hybrid", "selection": "group_union", "group_aggregation": "max"}


def kind_config(kind: str) -> SparseServeConfig:
    """The default config with `kind` of metadata (its own default sub-blocks); a block summary (quest,
    cuboid, hybrid) with the group union and max aggregation every run of it was made with."""
    if kind == SparseServeConfig().metadata:
        return SparseServeConfig()
    return SparseServeConfig(**(HYBRID_UNION | {"metadata": kind}))


def sparse_methods(
    budgets: list[int], metadata_kinds: list[str], variants: list[str] | None = None, oracle: bool = False
) -> list:
    """Dense, then every budget for each metadata kind ("quest_<b>", "cuboid_<b>"; the default
    configuration's kind is "sparse_<b>"), for each `--variant` family ("FAMILY:field=value:..."
    -> "FAMILY_<b>", other fields at their defaults) and, with `oracle`, the block oracle
    ("oracle_<b>": exactly the budget's blocks per KV head, as `selection="kv_head"` loads).
    """
    methods = []
    for kind in metadata_kinds:
        config = kind_config(kind)
        family = "sparse" if config == SparseServeConfig() else kind
        methods += methods_for(budgets, config, family)
    for text in variants or []:
        family, overrides = parse_variant(text)
        if family in ("dense", "sparse", ORACLE, *metadata_kinds):
            raise ValueError(f"--variant family {family!r} clashes with a built-in method family")
        methods += methods_for(budgets, SparseServeConfig(**overrides), family)
    if oracle:
        base = SparseServeConfig(selection="kv_head")
        methods += [Method(f"{ORACLE}_{b}", replace(base, token_budget=b), oracle=True) for b in budgets]
    methods = [Method(DENSE)] + [m for m in methods if m.name != DENSE]
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"two methods share a name: {sorted(n for n in set(names) if names.count(n) > 1)}")
    return methods


def metadata_kinds(text: str) -> list[str]:
    """ "quest,cuboid" -> ["quest", "cuboid"]; "none" -> [] (dense and the --variant families only)."""
    if text.strip() == "none":
        return []
    kinds = [part.strip() for part in text.split(",") if part.strip()]
    if not kinds:
        raise ValueError(f'--metadata needs comma-separated metadata kinds or "none", got {text!r}')
    return kinds


def split_method(name: str) -> tuple[str, int | None]:
    """ "cuboid_512" -> ("cuboid", 512); "dense" -> ("dense", None)."""
    if name == DENSE:
        return DENSE, None
    family, _, budget = name.rpartition("_")
    return family, int(budget)


def parse_budgets(text: str) -> list[int]:
    """ "512,1024" -> [512, 1024]; a clear error for anything else."""
    try:
        budgets = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--budgets takes comma-separated integers, got {text!r}") from None
    if not budgets or min(budgets) <= 0:
        raise ValueError(f"--budgets needs positive integers, got {text!r}")
    return budgets


def answer(
    model,
    tokenizer,
    input_ids: torch.Tensor,
    method: Method,
    max_new_tokens: int,
    cache: SparseServeCache | None = None,
) -> str:
    """Greedy-decode up to `max_new_tokens` after `input_ids` (1, T); returns the new text.

    A sparse method gets a fresh SparseServeCache, or `cache` when the caller wants its stats.
    """
    return answer_batch(model, tokenizer, [input_ids[0]], method, max_new_tokens, cache)[0][0]


LOAD_KEYS = ("loaded_tokens_per_kv_head", "loaded_tokens_p95_over_heads", "loaded_fraction", "metadata_fraction")


def answer_batch(
    model,
    tokenizer,
    prompts: list[torch.Tensor],
    method: Method,
    max_new_tokens: int,
    cache: SparseServeCache | None = None,
) -> tuple[list[str], dict[str, float]]:
    """Greedy answers to several prompts (each (T_i,) ids) in one left-padded `generate` call, and
    what its decode steps read: the cache's `LOAD_KEYS` from `stats()` (the batch's averages:
    loaded tokens per KV head and row, their p95 over heads, their fraction of the context, the
    metadata read over the dense KV bytes), the oracle's under the same names; {} for dense methods.

    Padding never reaches the sparse blocks (the cache commits real tokens only), so a prompt's
    answer does not depend on its batch-mates beyond floating-point rounding.
    """
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)  # masked anyway
    input_ids, attention_mask = left_pad(prompts, pad_id)
    kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    if method.config is not None and not method.oracle:
        if cache is None:
            tokens = len(prompts) * (input_ids.shape[1] + max_new_tokens)
            config = sized_dram_pool(method.config, model.config, tokens, model.dtype)
            cache = SparseServeCache(model.config, config)
        kwargs[cache_kwarg(model)] = cache
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    # An oracle method attends through `eval.accuracy.oracle_attention` over a dense cache meanwhile.
    routing = oracle_run(model, method.config) if method.oracle else contextlib.nullcontext()
    with torch.inference_mode(), routing as oracle:
        out = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    loads = {}
    if oracle is not None:
        loads = oracle.loads()
    elif cache is not None:
        stats = cache.stats()
        loads = {key: stats[key] for key in LOAD_KEYS}
    del kwargs, cache
    # `del` frees the cache and its pinned DRAM pool at once (a cache is no reference cycle); the
    # collect also clears cycles elsewhere (e.g. in generate's outputs) that could hold device memory.
    # Emptying the allocator's cache hands the next method whole free segments: each method grows
    # its pools by doubling, and segments split by an earlier method's sizes can leave no room for
    # one large pool while most of the device sits reserved but unused.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokenizer.batch_decode(out[:, input_ids.shape[1] :], skip_special_tokens=True), loads


def sized_dram_pool(config: SparseServeConfig, model_config, tokens: int, dtype: torch.dtype) -> SparseServeConfig:
    """`config` with a fixed DRAM pool that holds `tokens` positions of every layer (a power of two bytes).

    A growing pool re-pins and copies host memory at every doubling (pinning takes time per GiB); one
    fixed size per run is pinned once, and later caches of the same size reuse it through torch's
    pinned-memory caching allocator. A config that already fixes `dram_bytes` is kept.
    """
    if config.dram_bytes is not None:
        return config
    sizes = EngineSizes(model_config, config, dtype)
    needed = sizes.lifetime_dram_blocks(tokens) * sizes.block_bytes
    return replace(config, dram_bytes=1 << (needed - 1).bit_length())


def left_pad(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T_max) ids and attention mask with every prompt right-aligned."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel() :] = prompt
        mask[row, width - prompt.numel() :] = 1
    return ids, mask


def batches(items: list, size: int) -> list[list]:
    """Consecutive chunks of at most `size` items."""
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    return [items[i : i + size] for i in range(0, len(items), size)]


def summarize(rows: list[dict]) -> dict:
    """Mean score per (task, method) and each sparse method's ratio to dense per task.

    Each row needs "task", "method" and "score" (0..100).
    """
    scores: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        scores[row["task"]][row["method"]].append(row["score"])
    mean = {t: {m: sum(v) / len(v) for m, v in per.items()} for t, per in scores.items()}
    ratio = {
        t: {m: (s / per[DENSE] if per.get(DENSE) else None) for m, s in per.items() if m != DENSE}
        for t, per in mean.items()
    }
    counts = {t: {m: len(v) for m, v in per.items()} for t, per in scores.items()}
    return {"score": mean, "ratio_to_dense": ratio, "samples": counts, "loads": method_loads(rows)}


def method_loads(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Each sparse method's mean of `LOAD_KEYS` over its rows (rows without them are dense)."""
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        for key in LOAD_KEYS:
            if key in row:
                values[row["method"]][key].append(row[key])
    return {m: {k: sum(v) / len(v) for k, v in per.items()} for m, per in values.items()}


def write_results(out_dir: Path, rows: list[dict], meta: dict) -> dict:
    """Write samples.jsonl, summary.json, results.md and score_vs_budget.png; returns the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "samples.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    summary = {"meta": meta, **summarize(rows)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False))
    (out_dir / "results.md").write_text(markdown_table(summary))
    plot_score_vs_budget(summary, out_dir / "score_vs_budget.png")
    return summary


def markdown_table(summary: dict) -> str:
    methods = sorted({m for per in summary["score"].values() for m in per}, key=_method_order)
    lines = ["| task | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for task, per in sorted(summary["score"].items()):
        cells = []
        for m in methods:
            ratio = summary["ratio_to_dense"][task].get(m)
            cell = "" if m not in per else f"{per[m]:.1f}"
            cells.append(cell + (f" ({ratio:.2f}x)" if ratio is not None else ""))
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n\nScores 0-100; in brackets: sparse / dense.\n"
    loads = summary.get("loads") or {}
    if loads:
        text += (
            "\nWhat each method's decode steps read (means over its batches): tokens per KV head and row"
            " (loaded blocks + tail), their p95 over (layer, KV head), their fraction of the context, and"
            " the metadata read over the dense KV bytes.\n\n"
            "| method | loaded tokens / KV head | p95 over heads | loaded fraction | metadata fraction |\n"
            "|---|---|---|---|---|\n"
        )
        for m in sorted(loads, key=_method_order):
            row = loads[m]
            text += (
                f"| {m} | {row.get('loaded_tokens_per_kv_head', 0):.0f} | "
                f"{row.get('loaded_tokens_p95_over_heads', 0):.0f} | {row.get('loaded_fraction', 0):.4f} | "
                f"{row.get('metadata_fraction', 0):.4f} |\n"
            )
    return text


def plot_score_vs_budget(summary: dict, path: Path) -> None:
    """Score vs token budget per task, dense as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for task, per in sorted(summary["score"].items()):
        curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for name, value in per.items():
            family, budget = split_method(name)
            if budget is not None:
                curves[family].append((budget, value))
        color = None
        for family, points in sorted(curves.items()):
            style = "-" if family == "sparse" else ":"
            line = ax.plot(*zip(*sorted(points)), marker="o", linestyle=style, color=color, label=f"{task} {family}")[0]
            color = line.get_color()
        if DENSE in per and color is not None:
            ax.axhline(per[DENSE], linestyle="--", color=color, linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token budget")
    ax.set_ylabel("score")
    ax.set_title("score vs budget (dashed: dense)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    save_plot(fig, path, dpi=120)
    plt.close(fig)


def _method_order(name: str) -> tuple[int, str, int]:
    family, budget = split_method(name)
    return (0, "", 0) if budget is None else (1, family, budget)
