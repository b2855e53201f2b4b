"""The second edition's saturated points in one figure: tokens/s and mean TTFT, best stock beside ours,
per trace, each bar pair labelled with its ratio and the project's target for it.

Reads the files `python -m eval.serving join` writes (`compact.join_saturated` plus the command):
`python -m eval.serving plot-saturated decode_heavy=FILE "paper, first 20"=FILE --out PNG`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eval.results_io import read_json, save_plot

# The saturated-serving targets per trace (ours over best stock tokens/s; best stock's mean TTFT over ours)
TARGETS = {"paper": (3.0, 3.0), "decode_heavy": (6.0, 9.0)}
STOCK_COLOR, OURS_COLOR = "tab:blue", "tab:red"


def saturated_points(named: dict[str, Path]) -> list[dict[str, Any]]:
    """`{label: joined file}` -> one row per trace: its label, the trace (the label's first word, which
    names its targets), both systems' joined figures, the ratios, the requests compared and the GPUs
    the parts ran on.
    ValueError names a file that is not a join's output."""
    rows = []
    for label, path in named.items():
        joined = read_json(path)
        if not {"stock", "ours", "throughput_ratio", "mean_ttft_ratio"} <= set(joined):
            raise ValueError(f"{path} is not written by `python -m eval.serving join` (no stock/ours/ratios)")
        rows.append({
            "label": label,
            "trace": label.replace(",", " ").split()[0],
            "stock_system": joined["stock"]["system"],
            "stock": joined["stock"]["joined"],
            "ours": joined["ours"]["joined"],
            "throughput_ratio": joined["throughput_ratio"],
            "mean_ttft_ratio": joined["mean_ttft_ratio"],
            "requests": joined["ours"]["joined"]["requests"],
            "devices": sorted({part.get("device") or "?" for side in ("stock", "ours") for part in joined[side]["parts"]}),
        })  # fmt: skip
    return rows


def plot_saturated(rows: list[dict[str, Any]], path: Path) -> None:
    """`draw_saturated`'s figure saved as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw_saturated(rows)
    save_plot(fig, path, dpi=90)
    plt.close(fig)


def draw_saturated(rows: list[dict[str, Any]]):
    """Two panels (tokens/s, mean TTFT on a log scale), a stock and an ours bar per trace; above each
    pair its ratio and, where the trace has one, its target. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    panels = (
        ("throughput_tokens_per_s", "throughput_ratio", 0, "tokens/s (higher is better)"),
        ("mean_ttft_s", "mean_ttft_ratio", 1, "mean TTFT, s (lower is better)"),
    )
    for ax, (key, ratio_key, target_index, title) in zip(axes, panels):
        for i, row in enumerate(rows):
            stock, ours = row["stock"][key], row["ours"][key]
            ax.bar(i - 0.2, stock, 0.4, color=STOCK_COLOR, label=row["stock_system"] if i == 0 else None)
            ax.bar(i + 0.2, ours, 0.4, color=OURS_COLOR, label="ours" if i == 0 else None)
            target = TARGETS.get(row["trace"])
            note = f"{row[ratio_key]:.2f}x" + ("" if target is None else f"\n(target {target[target_index]:g}x)")
            ax.annotate(note, (i, max(stock, ours)), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), [_tick(row) for row in rows], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.25)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("Saturated serving: every request at t=0, 40 GiB HBM cap, Llama-3-8B shape", fontsize=10)
    fig.tight_layout()
    return fig


def _tick(row: dict[str, Any]) -> str:
    """A trace's axis label: its label, the requests compared, the GPU model(s)."""
    devices = ", ".join(device.removeprefix("NVIDIA ") for device in row["devices"])
    return f"{row['label']}\n{row['requests']} requests, {devices}"
