"""eval.serving: the trace, the per-request metrics and the SLO / goodput arithmetic, by hand."""

from __future__ import annotations

import pytest
from eval.serving.metrics import RequestRecord, goodput, meets_slo, summarize
from eval.serving.trace import Trace, build_trace

TEXT = list(range(10, 310))


def record(index, arrival, admitted, times, output_tokens=None, error=None) -> RequestRecord:
    out = len(times) if output_tokens is None else output_tokens
    return RequestRecord(
        arrival=arrival, prompt_tokens=100, admitted=admitted, token_times=list(times), index=index,
        output_tokens=out, error=error,
    )  # fmt: skip


def test_summary_by_hand():
    records = [record(0, 0.0, 0.5, [1.0, 1.1, 1.3]), record(1, 1.0, 1.5, [3.0, 3.4])]
    s = summarize(records, dense_iteration_s=0.01)
    assert s["generated_tokens"] == 5 and s["span_s"] == 3.4 and s["throughput_tokens_per_s"] == pytest.approx(5 / 3.4)
    assert s["mean_ttft_s"] == pytest.approx((1.0 + 2.0) / 2) and s["mean_queueing_s"] == pytest.approx(0.5)
    assert s["p50_tbt_s"] == pytest.approx(0.2) and s["p99_tbt_s"] == pytest.approx(0.4)  # TBTs 0.1 0.2 0.4
    assert s["max_tbt_s"] == pytest.approx(0.4) and s["mean_first_tbt_s"] == pytest.approx((0.1 + 0.4) / 2)
    assert s["slo_tbt_s"] == pytest.approx(0.25) and s["meets_slo"] is False  # p99 0.4 > 25 x 0.01


def test_slo_needs_every_request_served_in_full():
    full = [record(0, 0.0, 0.1, [0.2, 0.3])]
    assert meets_slo(summarize(full), dense_iteration_s=0.01)
    short = [record(0, 0.0, 0.1, [0.2, 0.3], output_tokens=3)]
    failed = full + [record(1, 0.0, None, [], error="out of memory")]
    late = [record(0, 0.0, 2.5, [2.6, 2.7])]  # queued 2.5 s > 2 s
    assert not any(meets_slo(summarize(r), 0.01) for r in (short, failed, late))


def test_goodput_is_the_highest_rate_below_the_first_miss():
    assert goodput({0.1: True, 0.2: True, 0.3: False, 0.4: True}) == 0.2
    assert goodput({0.1: False, 0.2: True}) == 0.0 and goodput({}) == 0.0


def test_trace_is_seeded_and_arrivals_scale_with_the_rate(tmp_path):
    trace = build_trace(TEXT, num_requests=6, prompt_range=(50, 400), output_range=(4, 9), seed=3, source="t")
    again = build_trace(TEXT, num_requests=6, prompt_range=(50, 400), output_range=(4, 9), seed=3, source="t")
    assert trace == again and trace != build_trace(TEXT, num_requests=6, prompt_range=(50, 400), seed=4)
    assert all(50 <= len(r.prompt) <= 400 and 4 <= r.output_tokens <= 9 for r in trace.requests)
    assert all(set(r.prompt) <= set(TEXT) for r in trace.requests)  # windows of the text (repeated past its end)
    slow, fast = trace.arrivals(0.5), trace.arrivals(2.0)
    assert slow[0] == fast[0] == 0.0 and slow == sorted(slow)
    assert all(s == pytest.approx(4 * f) for s, f in zip(slow, fast))
    path = tmp_path / "trace.pt"
    trace.save(path)
    assert Trace.load(path) == trace


@pytest.mark.parametrize(
    "kwargs",
    [dict(prompt_range=(0, 10)), dict(prompt_range=(20, 10)), dict(output_range=(5, 1)), dict(num_requests=0)],
)
def test_bad_trace_arguments_are_refused(kwargs):
    with pytest.raises(ValueError):
        build_trace(TEXT, **kwargs)
    with pytest.raises(ValueError, match="rate"):
        build_trace(TEXT, num_requests=2).arrivals(0.0)


def _run(records) -> dict:
    return {"records": [r.as_dict() for r in records]}


def test_report_judges_at_the_lowest_rate_when_no_stock_system_meets_the_slo():
    from eval.serving.report import analyse

    slow = [record(0, 0.0, 5.0, [6.0, 6.1])]  # queued 5 s: misses the SLO
    quick = [record(0, 0.0, 0.1, [0.3, 0.35])]  # 2 tokens in 0.35 s: meets it
    runs = {
        "stock_generate": {0.1: _run(slow), 0.15: _run(slow)},
        "stock_generate_batch": {0.1: _run(slow)},
        "ours": {0.1: _run(quick), 0.15: _run(quick)},
    }
    result = analyse(runs, dense=0.01)
    assert result["r_star"] == 0.0 and result["judged_at"] == 0.1 and "r* < 0.1" in result["r_star_note"]
    assert result["goodput"]["ours"] == 0.15 and result["goodput_ratio"] is None  # ours / 0
    assert result["ttft_ratio_vs_best_stock"] == pytest.approx(6.0 / 0.3)
    assert result["at_1.5r"]["rate"] == pytest.approx(0.15) and result["at_1.5r"]["tbt_p50_ratio"] == pytest.approx(0.5)
    assert result["ladder"]["ours"]["goodput"] == 0.15


def test_the_ladder_is_compared_at_a_rate_every_rung_ran_and_commands_are_listed_once(tmp_path):
    import json

    from eval.serving.report import analyse, load_runs

    quick = [record(0, 0.0, 0.1, [0.3, 0.35])]
    runs = {
        "stock_generate": {0.1: _run(quick)},
        "ours_sparse": {0.225: _run(quick)},  # the rungs ran at 0.225 only, r* is judged at 0.1
        "ours": {0.1: _run(quick), 0.225: _run(quick)},
    }
    result = analyse(runs, dense=0.01)
    assert result["judged_at"] == 0.1
    assert {rung: row["rate"] for rung, row in result["ladder"].items()} == {"ours_sparse": 0.225, "ours": 0.225}
    assert result["ladder"]["ours_sparse"]["p50_tbt_s"] == pytest.approx(0.05)
    for rate in (0.1, 0.225):  # one process served both rates: one command
        data = {"system": "ours", "rate": rate, "command": "run --rate 0.1 0.225", **_run(quick)}
        (tmp_path / f"run_ours_{rate:g}.json").write_text(json.dumps(data))
    assert load_runs([tmp_path])[2] == ["run --rate 0.1 0.225"]


def test_presets_draw_the_papers_and_the_decode_heavy_lengths():
    from eval.serving.trace import PRESETS, longbench_output_mix

    assert longbench_output_mix() == ((64, 3150), (128, 800), (512, 800))  # 4,750 LongBench records
    paper = build_trace(TEXT, num_requests=40, seed=0, name="paper", **PRESETS["paper"])
    assert {r.output_tokens for r in paper.requests} == {64, 128, 512} and paper.summary()["name"] == "paper"
    assert all(8192 <= len(r.prompt) <= 65536 for r in paper.requests)
    heavy = build_trace(TEXT, num_requests=40, seed=0, **PRESETS["decode_heavy"])
    assert all(16384 <= len(r.prompt) <= 32768 and 512 <= r.output_tokens <= 2048 for r in heavy.requests)
    assert paper == build_trace(TEXT, num_requests=40, seed=0, name="paper", **PRESETS["paper"])
    with pytest.raises(ValueError, match="output_choices"):
        build_trace(TEXT, num_requests=2, output_choices=((64, 0),))


def test_a_saturated_run_has_every_request_at_time_zero_and_its_own_ratios():
    from eval.serving.report import analyse

    trace = build_trace(TEXT, num_requests=5, prompt_range=(50, 60), output_range=(2, 3))
    assert trace.arrivals(float("inf")) == [0.0] * 5
    slow = [record(0, 0.0, 5.0, [6.0, 7.0]), record(1, 0.0, 0.2, [1.0, 2.0])]  # 4 tokens in 7 s, mean TTFT 3.5
    quick = [record(0, 0.0, 0.1, [0.5, 0.6]), record(1, 0.0, 0.1, [0.5, 0.7])]  # 4 tokens in 0.7 s, TTFT 0.5
    inf = float("inf")
    runs = {
        "stock_generate": {inf: _run(slow), 0.1: _run(slow)},
        "stock_offload": {inf: _run(slow[:1])},
        "ours": {inf: _run(quick), 0.1: _run(quick), 0.3: _run(quick), 0.4: _run(slow)},
    }
    result = analyse(runs, dense=0.01)
    assert (
        set(result["saturated"]) == {"stock_generate", "stock_offload", "ours"}
        and "inf" not in result["systems"]["ours"]
    )
    assert result["saturated_best_stock"] == "stock_generate"
    assert result["saturated_throughput_ratio"] == pytest.approx((4 / 0.7) / (4 / 7.0))
    assert result["saturated_ttft_ratio"] == pytest.approx(3.5 / 0.5)
    # goodput pair: ours meets at 0.3 (misses at 0.4); stock missed at 0.1 <= 0.3 / 3
    assert result["goodput_rate_ours"] == 0.3 and result["goodput_rate_stock_missed"] == 0.1
    assert result["goodput_ratio_lower_bound"] == pytest.approx(3.0)
    assert result["goodput_tbt_p50_ratio"] == pytest.approx(0.1 / 1.0)  # p50 by nearest rank: TBTs 0.1, 0.2 vs 1.0, 1.0
    # stock_offload served request 0 only: never the best stock, and alone it gives no ratio at all
    partial = analyse({"stock_offload": {inf: _run(slow[:1])}, "ours": {inf: _run(quick)}}, dense=0.01)
    assert partial["saturated_note"] == "no stock run served ours' 2 requests (stock_offload 1)"
    assert "saturated_throughput_ratio" not in partial and "saturated_best_stock" not in partial


def test_a_named_report_is_one_traces_block_of_serving_json(tmp_path):
    import json

    from eval.serving.report import write_report

    quick, slow = [record(0, 0.0, 0.1, [0.3, 0.35])], [record(0, 0.0, 5.0, [6.0, 6.1])]
    runs = tmp_path / "runs"
    runs.mkdir()
    for system, rate, records in (("ours", 0.3, quick), ("stock_generate", 0.1, slow), ("ours", float("inf"), quick)):
        data = {"system": system, "rate": rate, "command": f"run {system}", **_run(records)}
        (runs / f"run_{system}_{rate:g}.json").write_text(json.dumps(data))
    (runs / "calibration.json").write_text(json.dumps({"dense_iteration_s": 0.01, "command": "calibrate"}))
    out = tmp_path / "results"
    out.mkdir()
    (out / "serving.json").write_text(json.dumps({"paper": {"kept": True}}))
    block = write_report([runs], out, "report", name="decode_heavy")
    merged = json.loads((out / "serving.json").read_text())
    assert merged["paper"] == {"kept": True} and merged["decode_heavy"] == block
    assert block["goodput_rate_ours"] == 0.3 and block["goodput_rate_stock_missed"] == 0.1
    assert block["tbt_p50_ratio"] == pytest.approx(0.05 / 0.1) and "rate" in block["at_judged"]
    assert (out / "serving_decode_heavy.md").is_file() and (out / "serving_decode_heavy.png").is_file()
    assert (out / "serving_decode_heavy_tbt.png").is_file()  # the saturated run's TBT distribution


def test_a_saturated_run_in_parts_is_joined_end_to_end_and_random_kv_runs_stand_apart(tmp_path):
    import json

    from eval.serving.report import load_runs

    inf = float("inf")
    first = [record(0, 0.0, 0.0, [2.0, 3.0]), record(1, 0.0, 0.0, [2.0, 4.0])]  # the part ends at 4 s
    second = [record(2, 0.0, 0.5, [1.0, 1.5])]
    points = (
        ("stock_generate", first, {"requests_from": 0}, "a"),
        ("stock_generate", second, {"requests_from": 2}, "b"),
        ("ours", second, {"locality": "real", "requests_from": 0}, "c"),
        ("ours", first, {"locality": "random", "requests_from": 0}, "d"),
    )
    for system, records, extra, name in points:
        data = {"system": system, "rate": inf, "command": f"run {name}", **_run(records), **extra}
        (tmp_path / f"run_{name}.json").write_text(json.dumps(data))
    runs, _, commands = load_runs([tmp_path])
    assert set(runs) == {"stock_generate", "ours", "ours@random_kv"} and commands == [
        "run a",
        "run b",
        "run c",
        "run d",
    ]
    joined = runs["stock_generate"][inf]
    assert joined["parts_from"] == [0, 2]
    assert [r["token_times"] for r in joined["records"]] == [[2.0, 3.0], [2.0, 4.0], [5.0, 5.5]]
    assert joined["records"][2]["admitted"] == 4.5 and joined["records"][2]["arrival"] == 0.0
    summary = summarize([RequestRecord.from_dict(r) for r in joined["records"]])
    assert summary["throughput_tokens_per_s"] == pytest.approx(6 / 5.5) and summary["mean_ttft_s"] == pytest.approx(3.0)


def test_parts_of_one_request_range_or_of_a_poisson_rate_are_refused():
    from eval.serving.report import join_parts

    part = {"system": "stock_generate", "rate": float("inf"), "records": [], "requests_from": 0}
    with pytest.raises(ValueError, match="distinct requests"):
        join_parts([part, dict(part)])
    with pytest.raises(ValueError, match="saturated"):
        join_parts([dict(part, rate=0.1), dict(part, requests_from=3, rate=0.1)])


def test_each_point_locality_and_part_has_its_own_file_name():
    from eval.serving.__main__ import run_file_name

    assert run_file_name("ours", float("inf"), "real", 0) == "run_ours_inf.json"
    assert run_file_name("ours", 0.5, "random", 0) == "run_ours_0.5_random.json"
    assert run_file_name("stock_generate", float("inf"), "random", 10) == "run_stock_generate_inf_from10.json"
