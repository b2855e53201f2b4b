"""eval.accuracy.accuracy_report: ratios over the tasks dense solves, loaded-fraction verdicts, merged partial runs, files."""

from __future__ import annotations

import json

import pytest
from eval.accuracy import accuracy_report
from eval.accuracy.t7 import paired_ratio


def _write(folder, rows, name="samples.jsonl"):
    folder.mkdir(parents=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rows(task, scores_by_method):
    return [
        {"task": task, "index": i, "method": method, "score": score}
        for method, scores in scores_by_method.items()
        for i, score in enumerate(scores)
    ]


def test_ratio_leaves_out_tasks_dense_cannot_do_and_judges_t7(tmp_path):
    rows = _rows("niah@8192", {"dense": [100, 100], "sparse_256": [100, 50], "sparse_512": [100, 100]})
    rows += _rows("qa@8192", {"dense": [50, 50], "sparse_256": [50, 0], "sparse_512": [50, 50]})
    rows += _rows("cwe@8192", {"dense": [10, 0], "sparse_256": [100, 100], "sparse_512": [100, 100]})  # dense 5: out
    rows += _rows("niah@4096", {"dense": [100], "cuboid_128": [0]})
    _write(tmp_path / "part1", rows[: len(rows) // 2])
    _write(tmp_path / "part2", rows[len(rows) // 2 :], name="partial.jsonl")  # a part cut short
    report = accuracy_report.main(["--ruler", str(tmp_path / "part1"), str(tmp_path / "part2"), "--out", str(tmp_path)])
    # 8K: niah and qa kept (dense 100 and 50, mean 75); budget 256: (75 + 25) / 2 = 50 -> 0.6667.
    assert report["ratio_to_dense_8k"] == {"256": 0.6667, "512": 1.0}
    assert report["ruler"]["lengths"]["8192"]["tasks_left_out"] == ["cwe@8192"]
    assert report["ruler"]["lengths"]["4096"]["ratio_to_dense"] == {"cuboid": {"128": 0.0}}
    assert report["t7_8k"]["1/16"] == {"budget": 512, "ratio": 1.0, "target": 0.99, "met": True}
    assert report["t7_8k"]["1/32"]["met"] is False
    for name in ("accuracy.json", "accuracy.md", "accuracy.png"):
        assert (tmp_path / name).is_file()
    assert "missed" in (tmp_path / "accuracy.md").read_text()


def test_longbench_only_and_bad_input(tmp_path):
    _write(tmp_path / "lb", _rows("multi_news", {"dense": [20, 30], "sparse_2048": [25, 25]}))
    report = accuracy_report.main(["--longbench", str(tmp_path / "lb"), "--out", str(tmp_path)])
    assert report["longbench"]["score"]["multi_news"] == {"dense": 25.0, "sparse_2048": 25.0}
    assert "ratio_to_dense_8k" not in report
    with pytest.raises(ValueError, match="give at least one --ruler"):
        accuracy_report.main(["--out", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="samples.jsonl"):
        accuracy_report.main(["--ruler", str(tmp_path / "missing"), "--out", str(tmp_path)])


def test_fp8_block_compares_the_variant_with_the_default_of_its_own_run(tmp_path):
    rows = _rows("niah@8192", {"dense": [100, 100], "sparse_256": [100, 50], "fp8_kv_256": [100, 0]})
    rows += _rows("qa@8192", {"dense": [50, 50], "sparse_256": [50, 50], "fp8_kv_256": [50, 50]})
    rows += _rows("cwe@8192", {"dense": [0, 0], "sparse_256": [0, 0], "fp8_kv_256": [100, 100]})  # dense 0: out
    _write(tmp_path / "fp8run", rows)
    _write(tmp_path / "lb", _rows("multi_news", {"dense": [20], "sparse_2048": [25]}))
    report = accuracy_report.main(["--longbench", str(tmp_path / "lb"), "--fp8", str(tmp_path / "fp8run"),
                                   "--out", str(tmp_path)])  # fmt: skip
    # kept: niah, qa (dense mean 75); sparse (75 + 50) / 2 = 62.5; fp8 (50 + 50) / 2 = 50 -> 0.8
    assert report["fp8"]["ratio_to_bf16"] == {"256": 0.8}
    detail = report["fp8"]["lengths"]["8192"]
    assert detail["tasks_in_ratio"] == ["niah@8192", "qa@8192"]
    assert detail["ratio_to_dense"] == {"fp8_kv": {"256": 0.6667}, "sparse": {"256": 0.8333}}
    assert "| 8192 | 256 | 0.6667 | 0.8333 | 0.8 |" in (tmp_path / "accuracy.md").read_text()
    # paired resamples: niah's pairs (sparse, fp8) are (100, 100) and (50, 0), qa's both (50, 50), so every
    # resample's ratio lies in [0.5, 1.0] and the 90% interval holds the point ratio
    low, high = report["fp8"]["ci90_to_bf16"]["256"]
    assert 0.5 <= low <= 0.8 <= high <= 1.0 and low < high


def test_paired_ratio_pairs_samples_by_index_and_skips_tasks_without_both_methods():
    rows = _rows("niah@8192", {"a_1": [100, 50, 0], "b_1": [50, 50]})  # sample 2 answered by a alone
    rows += _rows("qa@8192", {"a_1": [10]})  # b missing: the task is left out
    ratio, interval = paired_ratio(rows, ["niah@8192", "qa@8192"], "a_1", "b_1")
    assert ratio == pytest.approx(50 / 75)
    assert interval is not None and interval[0] <= ratio <= interval[1]
    assert paired_ratio(rows, ["qa@8192"], "a_1", "b_1") == (None, None)


def test_rename_swaps_families_at_once(tmp_path):
    rows = _rows("niah@8192", {"dense": [100], "sparse_512": [0], "hybrid_s8_512": [100]})
    _write(tmp_path / "run", rows)
    args = [
        "--ruler",
        str(tmp_path / "run"),
        "--out",
        str(tmp_path),
        "--rename",
        "sparse=quest",
        "--rename",
        "hybrid_s8=sparse",
    ]
    report = accuracy_report.main(args)
    assert report["ruler"]["score"]["niah@8192"] == {"dense": 100.0, "quest_512": 0.0, "sparse_512": 100.0}
    assert report["ratio_to_dense_8k"] == {"512": 1.0}  # the renamed default family
    for bad in ("sparse", "=x", "dense=quest", "sparse="):
        with pytest.raises(ValueError, match="OLD=NEW"):
            accuracy_report.main(["--ruler", str(tmp_path / "run"), "--out", str(tmp_path), "--rename", bad])


def test_current_runs_keep_their_names_and_win_a_tie(tmp_path):
    _write(tmp_path / "old", _rows("niah@8192", {"dense": [100], "sparse_512": [0], "hybrid_s8_512": [50]}))
    _write(tmp_path / "now", _rows("niah@8192", {"dense": [100], "sparse_512": [100]}))
    args = ["--ruler", str(tmp_path / "old"), "--ruler-current", str(tmp_path / "now"), "--out", str(tmp_path)]
    report = accuracy_report.main([*args, "--rename", "sparse=quest", "--rename", "hybrid_s8=sparse"])
    # the old run's sparse is renamed to quest, its hybrid_s8 to sparse; the current run's sparse wins over the latter
    assert report["ruler"]["score"]["niah@8192"] == {"dense": 100.0, "quest_512": 0.0, "sparse_512": 100.0}
    assert len(report["ruler_meta"]) == 2
    alone = accuracy_report.main(["--ruler-current", str(tmp_path / "now"), "--out", str(tmp_path)])
    assert alone["ratio_to_dense_8k"] == {"512": 1.0}


def test_budget_curves_leave_out_a_family_missing_tasks():
    scores = {"a@4096": {"dense": 90, "quest_256": 50, "sparse_256": 10}, "b@4096": {"dense": 70, "quest_256": 30}}
    assert accuracy_report.budget_curves(scores, ["a@4096", "b@4096"]) == {"quest": {256: 40.0}}
    assert accuracy_report.budget_curves(scores, ["a@4096"]) == {"quest": {256: 50.0}, "sparse": {256: 10.0}}


def _loaded(rows, method, loaded_fraction, metadata_fraction=0.047):
    """`rows` of `method` with the load keys every sparse `eval.accuracy.ruler` row carries."""
    return [dict(r, loaded_fraction=loaded_fraction, metadata_fraction=metadata_fraction)
            if r["method"] == method else r for r in rows]  # fmt: skip


def test_t7_is_judged_at_the_loaded_fraction_with_a_paired_bootstrap(tmp_path):
    scores = {"dense": [100] * 10, "sparse_256": [100] * 8 + [0] * 2, "sparse_512": [100] * 10}
    rows = _rows("niah@8192", scores) + _rows("qa@8192", {m: [s / 2 for s in v] for m, v in scores.items()})
    rows = _loaded(_loaded(rows, "sparse_256", 0.05), "sparse_512", 0.09)  # 512 loads past 1/16
    rows += [dict(r, method="kvh_512", loaded_fraction=0.06, metadata_fraction=0.047)
             for r in rows if r["method"] == "sparse_512"]  # fmt: skip
    _write(tmp_path / "run", rows)
    report = accuracy_report.main(["--ruler", str(tmp_path / "run"), "--out", str(tmp_path)])
    t7 = report["t7"]
    assert t7["method_at_1_16"] == "sparse_256"  # not 512: it loads 0.09
    assert t7["loaded_fraction_1_16"] == pytest.approx(0.05)
    assert t7["ratio_at_1_16"] == pytest.approx(0.8)
    low, high = t7["ci90_1_16"]
    assert low < 0.8 < high <= 1.0  # two misses in ten: the interval is wide
    assert t7["method_at_1_32"] is None and t7["ratio_at_1_32"] is None  # nothing loads <= 1/32
    assert t7["n_tasks"] == 2 and t7["n_samples_per_task"] == 10 and t7["metadata_fraction"] == pytest.approx(0.047)
    assert t7["oracle_at_1_16"] is None
    kvh = report["t7_by_family"]["kvh"]
    assert kvh["method_at_1_16"] == "kvh_512" and kvh["ratio_at_1_16"] == 1.0 and kvh["ci90_1_16"] == [1.0, 1.0]
    assert "T7 at 8K by loaded tokens" in (tmp_path / "accuracy.md").read_text()


def test_t7_reads_the_oracle_family_at_the_same_loaded_fractions(tmp_path):
    scores = {"dense": [100] * 10, "sparse_256": [100] * 8 + [0] * 2, "oracle_256": [100] * 10}
    scores["oracle_128"] = [100] * 9 + [0]
    rows = _rows("niah@8192", scores)
    rows = _loaded(_loaded(rows, "sparse_256", 0.05), "oracle_256", 0.04, metadata_fraction=0.0)
    rows = _loaded(rows, "oracle_128", 0.02, metadata_fraction=0.0)
    _write(tmp_path / "run", rows)
    t7 = accuracy_report.main(["--ruler", str(tmp_path / "run"), "--out", str(tmp_path)])["t7"]
    assert t7["ratio_at_1_16"] == pytest.approx(0.8)
    assert t7["oracle_at_1_16"] == 1.0  # oracle_256: the most the oracle loads at or below 1/16
    assert t7["oracle_at_1_32"] == pytest.approx(0.9)  # oracle_128


def test_gemma3_runs_are_judged_on_their_own_at_16k(tmp_path):
    scores = {"dense": [100] * 10, "sparse_512": [100] * 9 + [0], "sparse_1024": [100] * 10}
    rows = _rows("niah@16384", scores) + _rows("vt@16384", {"dense": [0] * 10, "sparse_512": [100] * 10})
    rows = _loaded(_loaded(rows, "sparse_512", 0.03), "sparse_1024", 0.06)
    _write(tmp_path / "gemma", rows)
    _write(tmp_path / "smol", _rows("niah@8192", {"dense": [100], "sparse_256": [50]}))
    report = accuracy_report.main(
        ["--ruler", str(tmp_path / "smol"), "--gemma3", str(tmp_path / "gemma"), "--out", str(tmp_path)]
    )
    block = report["t7_gemma3_16k"]
    assert block["tasks"] == ["niah@16384"]  # vt: dense 0, left out
    assert block["method_at_1_16"] == "sparse_1024" and block["ratio_at_1_16"] == 1.0
    assert block["method_at_1_32"] == "sparse_512" and block["ratio_at_1_32"] == pytest.approx(0.9)
    assert report["ratio_to_dense_8k"] == {"256": 0.5}  # the default model's rows stay its own
    assert "T7 at Gemma-3-270M at 16K by loaded tokens" in (tmp_path / "accuracy.md").read_text()
