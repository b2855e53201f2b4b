"""The committed results: small, and still what their commands regenerate (compressed raw files included)."""

from __future__ import annotations

import gzip
import json
import lzma
from pathlib import Path

import pytest
from eval.accuracy import accuracy_report
from eval.results_io import glob_stored, read_json, read_jsonl, read_text, save_plot, stored
from eval.serving.report import load_runs

RESULTS = Path(__file__).resolve().parents[2] / "eval" / "results"
MAX_RESULTS_BYTES = 1_500_000
RULER_RUNS = ("ruler_8k_a", "ruler_8k", "ruler_8k_budgets", "ruler_8k_hybrid", "ruler_4k", "ruler_4k_hybrid")
CURRENT_RULER_RUNS = (
    "ruler_8k_metadata_dtype",
    "ruler_8k_oracle",
    "ruler_8k_fp8_kv",
    "ruler_8k_channels",
    "ruler_8k_feedback",
)


def test_results_stay_small():
    size = sum(path.stat().st_size for path in RESULTS.rglob("*") if path.is_file())
    assert size < MAX_RESULTS_BYTES, f"eval/results holds {size} bytes; compress raw outputs (see eval/results_io.py)"


def test_the_accuracy_report_regenerates_from_the_committed_runs(tmp_path):
    argv = ["--ruler", *(str(RESULTS / name) for name in RULER_RUNS)]
    argv += ["--ruler-current", *(str(RESULTS / name) for name in CURRENT_RULER_RUNS)]
    argv += ["--fp8", str(RESULTS / "ruler_8k_fp8_kv")]
    argv += ["--longbench", str(RESULTS / "longbench_multi_news"), "--out", str(tmp_path)]
    argv += ["--gemma3", str(RESULTS / "ruler_16k_gemma3")]
    argv += ["--rename", "sparse=quest", "--rename", "hybrid_s8=hybrid"]  # as accuracy.json's command
    argv += ["--rename-current", "sparse=hybrid", "--rename-current", "channels_feedback=sparse"]
    accuracy_report.main(argv)
    committed = json.loads((RESULTS / "accuracy.json").read_text())
    regenerated = json.loads((tmp_path / "accuracy.json").read_text())
    keys = ("ruler", "ratio_to_dense_8k", "t7_8k", "t7_by_family", "fp8", "longbench", "t7_gemma3_16k_by_family")
    for key in keys:
        assert regenerated[key] == committed[key], key


def test_the_serving_runs_load_as_serving_json_lists_them():
    folders = sorted(p for p in (RESULTS / "serving_runs").iterdir() if p.is_dir())
    runs, dense, _ = load_runs(folders)
    committed = json.loads((RESULTS / "serving.json").read_text())
    assert dense == committed["dense_iteration_s"]
    assert set(runs) == set(committed["systems"])


def test_a_plain_file_is_read_before_its_compressed_copy(tmp_path):
    (tmp_path / "a.json").write_text('{"plain": 1}')
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(b'{"plain": 0}'))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"x": 1}\n\n{"x": 2}\n'))
    (tmp_path / "d.json.xz").write_bytes(lzma.compress(b'{"packed": "xz"}'))
    assert read_json(tmp_path / "a.json") == {"plain": 1}
    assert read_jsonl(tmp_path / "b.jsonl") == [{"x": 1}, {"x": 2}]
    assert read_json(tmp_path / "d.json") == {"packed": "xz"}
    assert stored(tmp_path / "b.jsonl") == tmp_path / "b.jsonl.gz" and stored(tmp_path / "c.json") is None
    assert glob_stored(tmp_path, "*.json*") == [tmp_path / "a.json", tmp_path / "b.jsonl", tmp_path / "d.json"]
    with pytest.raises(FileNotFoundError, match=r"c\.json \(nor c\.json\.gz or \.xz"):
        read_text(tmp_path / "c.json")


def test_a_saved_plot_is_a_palette_png_smaller_than_matplotlibs_own(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    fig, ax = plt.subplots(figsize=(6, 4))
    for i in range(6):
        ax.plot(range(50), [((x * (i + 1)) % 17) for x in range(50)], marker="o", label=f"line {i}")
    ax.legend()
    save_plot(fig, tmp_path / "small.png")
    fig.savefig(tmp_path / "full.png", dpi=120)
    plt.close(fig)
    with Image.open(tmp_path / "small.png") as small, Image.open(tmp_path / "full.png") as full:
        assert small.mode == "P" and small.size == full.size
    assert (tmp_path / "small.png").stat().st_size < (tmp_path / "full.png").stat().st_size / 2
