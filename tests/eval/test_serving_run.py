"""eval.serving end to end on CPU: a tiny random-weight Llama, a 3-request trace, every CPU-capable
system through the CLI (run, calibrate, report), the same code the H200 sweep runs."""

from __future__ import annotations

import itertools
import json
import lzma

import pytest
import torch
from eval.serving.__main__ import main
from eval.serving.compact import join_compact
from eval.serving.metrics import RequestRecord, summarize
from eval.serving.report import join_parts, run_label
from eval.serving.saturated_plot import saturated_points
from eval.serving.trace import Trace, build_trace

SMALL = ["--shape", "tiny", "--hbm-cap-gib", "0.25", "--headroom-gib", "0.05", "--dram-gib", "0.05"]
CPU_SYSTEMS = [
    "stock_generate",
    "stock_generate_no_cudnn",
    "stock_generate_batch",
    "ours_sparse",
    "ours_offload",
    "ours",
]


def _triton_knobs() -> bool:
    """Whether this machine's Triton has the knobs `KernelsFirstSeen` hooks into."""
    try:
        from triton import knobs  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serving")
    trace = build_trace(list(range(10, 250)), num_requests=3, prompt_range=(40, 90), output_range=(3, 5), seed=0)
    trace.save(folder / "trace.pt")
    common = ["--trace", str(folder / "trace.pt"), *SMALL, "--out", str(folder / "runs")]
    main(["calibrate", *common])
    for system in CPU_SYSTEMS:
        main(["run", "--system", system, "--rate", "20", *common])
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # what stock_generate_no_cudnn's process runs with
    torch.backends.cuda.enable_cudnn_sdp(True)
    return folder, trace


@pytest.mark.core
@pytest.mark.parametrize("system", CPU_SYSTEMS)
def test_every_request_is_served_in_order_of_its_times(runs, system):
    folder, trace = runs
    result = json.loads((folder / "runs" / f"run_{system}_20.json").read_text())
    assert result["summary"]["completed"] == 3 and result["summary"]["failed"] == 0
    for request, rec in zip(trace.requests, result["records"]):
        times = rec["token_times"]
        assert len(times) == request.output_tokens == rec["output_tokens"] and rec["error"] is None
        assert rec["arrival"] <= rec["admitted"] <= times[0] and times == sorted(times)
    assert result["kernels_first_seen"] == ([] if _triton_knobs() else None)  # CPU runs launch no Triton kernel
    assert "--system" in result["command"] and result["trace"]["requests"] == 3 and len(result["git_commit"]) == 40
    assert result["setup_s"] > 0  # building and warming up the system, before the run's clock starts
    engine = result["engine"]  # the warm-up request is served first and counted nowhere
    if system == "stock_generate":
        assert sum(engine["batch_sizes"]) == 3
    if system.startswith("ours"):
        by_kind = engine["iterations_by_kind"].values()
        assert engine["iterations"] == sum(k["count"] for k in by_kind) > 0
        assert engine["decode_rows"] == sum(r.output_tokens - 1 for r in trace.requests)
        assert engine["config"]["cuda_graphs"] == (system == "ours") and engine["config"]["token_budget"] == 2048


def test_report_compares_ours_with_the_best_stock_system(runs, tmp_path):
    folder, _ = runs
    main(["report", str(folder / "runs"), "--out", str(tmp_path)])
    report = json.loads((tmp_path / "serving.json").read_text())
    assert report["dense_iteration_s"] > 0 and set(report["goodput"]) == set(CPU_SYSTEMS)
    assert report["best_stock"] in {"stock_generate", "stock_generate_no_cudnn", "stock_generate_batch"}
    for key in ("throughput_ratio_vs_best_stock", "ttft_ratio_vs_best_stock", "tbt_p50_ratio", "goodput_ratio"):
        assert key in report and key in report["at_1.5r"] or key == "goodput_ratio"
    assert set(report["ladder"]) == {"ours_sparse", "ours_offload", "ours"}
    assert (tmp_path / "serving.png").stat().st_size > 0 and "r*" in (tmp_path / "serving.md").read_text()


def test_compact_keeps_each_request_s_latencies_without_its_token_times(runs, tmp_path):
    folder, _ = runs
    run_file = folder / "runs" / "run_ours_20.json"
    run = json.loads(run_file.read_text())
    out = tmp_path / "small.json.xz"
    main(["compact", f"ours_first3={run_file}", "--note", "CPU, tiny", "--out", str(out)])
    small = json.loads(lzma.decompress(out.read_bytes()))
    kept = small["runs"]["ours_first3"]
    assert small["note"] == "CPU, tiny" and kept["summary"] == run["summary"] and kept["engine"] == run["engine"]
    assert "records" not in kept and len(kept["requests"]) == 3
    for record, request in zip(run["records"], kept["requests"]):
        times = record["token_times"]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert request["ttft_s"] == pytest.approx(times[0] - record["arrival"], abs=1e-4)
        assert request["queueing_s"] == pytest.approx(record["admitted"] - record["arrival"], abs=1e-4)
        assert request["first_gap_s"] == pytest.approx(gaps[0], abs=1e-4)
        assert request["max_gap_s"] == pytest.approx(max(gaps), abs=1e-4)
    assert kept["tbt_quantiles_s"]["0.1"] <= kept["tbt_quantiles_s"]["0.5"] <= kept["tbt_quantiles_s"]["0.99"]
    with pytest.raises(SystemExit, match="NAME=RUN_JSON"):
        main(["compact", str(run_file), "--note", "x", "--out", str(tmp_path / "bad.json")])
    assert not (tmp_path / "bad.json").exists()


def test_a_trace_past_the_model_vocabulary_is_refused(tmp_path):
    trace = build_trace([5, 300], num_requests=1, prompt_range=(8, 8), output_range=(2, 2))
    trace.save(tmp_path / "trace.pt")
    with pytest.raises(ValueError, match="vocabulary of 256"):
        main(
            [
                "run",
                "--system",
                "ours",
                "--rate",
                "1",
                "--trace",
                str(tmp_path / "trace.pt"),
                *SMALL,
                "--out",
                str(tmp_path),
            ]
        )


@pytest.mark.parametrize("system", ["stock_generate", "stock_generate_batch", "ours"])
def test_a_run_cut_at_its_deadline_fails_the_rest_and_the_system_serves_the_next_rate(runs, system):
    from eval.serving.setup import HbmCap, build

    folder, trace = runs
    trace = Trace.load(folder / "trace.pt")
    runner = build(system, "tiny", trace, HbmCap(int(0.25 * 2**30), int(0.05 * 2**30)), 16, int(0.05 * 2**30))
    cut = runner(20.0, deadline_s=1e-4)
    assert all(r.error is not None for r in cut.records)  # nobody got every token before the deadline
    assert any("deadline" in r.error for r in cut.records)
    full = runner(20.0)  # the same model (and Generator) again, with no deadline
    assert [len(r.token_times) for r in full.records] == [r.output_tokens for r in trace.requests]
    assert all(r.error is None for r in full.records)


def test_a_stock_run_stops_once_its_queue_grows_past_the_limit_and_the_rest_fail(tmp_path):
    trace = build_trace(list(range(10, 250)), num_requests=6, prompt_range=(40, 90), output_range=(3, 5), seed=1)
    trace.save(tmp_path / "trace.pt")
    common = ["--trace", str(tmp_path / "trace.pt"), *SMALL, "--out", str(tmp_path), "--max-batch", "1"]
    main(["run", "--system", "stock_generate", "--rate", "inf", "--stop-queueing-s", "0", *common])
    result = json.loads((tmp_path / "run_stock_generate_inf.json").read_text())
    records = result["records"]  # one row per batch, all at t=0: each batch waited longer than the one before
    assert [r["error"] is None for r in records] == [True, True, False, False, False, False]
    assert all(r["admitted"] is None and r["error"].startswith("not started: the run stopped at") for r in records[2:])
    assert result["stop_queueing_s"] == 0 and result["engine"]["stopped_at_s"] >= records[1]["token_times"][-1]
    assert result["summary"]["completed"] == 2 and result["summary"]["failed"] == 4
    with pytest.raises(ValueError, match="queueing stop applies to stock's static batches"):
        main(["run", "--system", "stock_generate_batch", "--rate", "inf", "--stop-queueing-s", "2", *common])


def test_a_queueing_stop_needs_batches_past_the_limit_each_waiting_longer():
    from eval.serving.common import QueueingStop

    never = QueueingStop(None)
    assert not any(never.stop(i, 100.0 + i, 0.0) for i in range(5)) and never.stopped_at_s is None
    queue = QueueingStop(2.0, batches=3)
    assert not queue.stop(0, 3.0, 1.0) and not queue.stop(1, 4.0, 2.0)
    assert not queue.stop(1, 9.0, 2.5)  # the same batch tried again (one row fewer) counts once
    assert not queue.stop(2, 3.5, 3.0)  # past the limit, but shorter than the wait before: not growing
    assert not queue.stop(3, 1.0, 4.0) and not queue.stop(4, 5.0, 5.0) and not queue.stop(5, 6.0, 6.0)  # 1.0 <= 2
    assert queue.stop(6, 7.0, 7.0) and queue.stopped_at_s == 7.0
    with pytest.raises(ValueError, match=">= 0 s"):
        QueueingStop(-1.0)


def test_several_rates_in_one_process_write_one_json_each(runs, tmp_path):
    folder, _ = runs
    main(["run", "--system", "ours", "--rate", "20", "5", "--trace", str(folder / "trace.pt"), *SMALL,
          "--out", str(tmp_path)])  # fmt: skip
    for rate in ("20", "5"):
        result = json.loads((tmp_path / f"run_ours_{rate}.json").read_text())
        assert result["summary"]["completed"] == 3 and result["engine"]["iterations"] > 0
        assert result["allocator"] == "expandable_segments:True"


def test_a_rung_runs_as_a_variant_with_config_overrides_and_stock_takes_none(runs, tmp_path):
    folder, _ = runs
    common = ["--trace", str(folder / "trace.pt"), *SMALL, "--out", str(tmp_path)]
    main(["run", "--system", "ours", "--rate", "20", "--set", "target_tbt_ms=150", "--set", "max_batch=2", *common])
    result = json.loads((tmp_path / "run_ours_set-max_batch-2_set-target_tbt_ms-150_20.json").read_text())
    assert result["overrides"] == {"target_tbt_ms": 150.0, "max_batch": 2} and result["summary"]["completed"] == 3
    assert result["engine"]["config"]["target_tbt_ms"] == 150.0 and result["engine"]["config"]["max_batch"] == 2
    assert run_label(result) == "ours[max_batch=2,target_tbt_ms=150]"
    with pytest.raises(ValueError, match="ours' rungs"):
        main(["run", "--system", "stock_generate", "--rate", "20", "--set", "target_tbt_ms=150", *common])
    with pytest.raises(ValueError, match="target_tbt_ms"):
        main(["run", "--system", "ours", "--rate", "20", "--set", "target_tbt_ms=0", *common])


def test_the_sweep_script_runs_every_job_and_reports_each(runs, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    folder, _ = runs
    root = Path(__file__).resolve().parents[2]
    # A fresh process per job: stock keeps the default allocator, ours gets expandable segments.
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    env |= {"EXTRA_ARGS": " ".join(SMALL), "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "eval/h200_serving.sh", "sweep", str(tmp_path), str(folder / "trace.pt"), "ours:20,5",
         "stock_generate:20"],
        check=False, cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "ours at 20 5 req/s: rc=0" in done.stdout and "stock_generate at 20 req/s: rc=0" in done.stdout
    names = sorted(p.name for p in tmp_path.glob("run_*.json"))
    assert names == ["run_ours_20.json", "run_ours_5.json", "run_stock_generate_20.json"]
    allocators = {name: json.loads((tmp_path / name).read_text())["allocator"] for name in names}
    assert allocators == {"run_ours_20.json": "expandable_segments:True", "run_ours_5.json": "expandable_segments:True",
                          "run_stock_generate_20.json": None}  # fmt: skip


def test_the_probe_part_runs_each_cache_it_is_given(runs, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    folder, _ = runs
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, EXTRA_ARGS="--shape tiny", CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", "eval/h200_serving.sh", "probe", str(tmp_path), str(folder / "trace.pt"), "2", "dynamic", "static"],
        check=False, cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.glob("probe_stock_*.json")) == [
        "probe_stock_dynamic_2rows.json", "probe_stock_static_2rows.json",
    ]  # fmt: skip
    trace = Trace.load(folder / "trace.pt")
    for cache in ("dynamic", "static"):
        result = json.loads((tmp_path / f"probe_stock_{cache}_2rows.json").read_text())
        assert result["rows"] == 2 and result["cache"] == cache
        assert result["prompt_tokens"] == [len(r.prompt) for r in trace.requests[:2]]
        assert all(result[phase]["step_ms"] > 0 for phase in ("capped_first", "capped_warm", "uncapped_warm"))
        assert result["command"].startswith("python -m eval.serving probe-stock")


def test_the_probe_times_batches_new_to_the_warm_process_with_and_without_cudnn(runs):
    from eval.serving.probe import stock_step_probe
    from eval.serving.setup import HbmCap

    _, trace = runs
    result = stock_step_probe("tiny", trace, HbmCap(1 << 28, 1 << 26), rows=1, steps=3)
    for phase, index in (("capped_new_lengths", 1), ("capped_new_lengths_no_cudnn", 2)):
        for timed in (phase, f"{phase}_warm"):
            assert result[timed]["step_ms"] > 0 and result[timed]["prompt_tokens"] == [
                len(trace.requests[index].prompt)
            ]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # switched back on


def test_join_of_compact_parts_equals_the_report_s_join_of_full_runs(runs, tmp_path):
    folder, _ = runs
    common = ["--trace", str(folder / "trace.pt"), *SMALL, "--out", str(tmp_path / "parts")]
    main(["run", "--system", "stock_generate", "--rate", "inf", "--requests", "2", *common])
    main(["run", "--system", "stock_generate", "--rate", "inf", "--skip", "2", *common])
    main(["run", "--system", "ours_sparse", "--rate", "inf", *common])
    files = {path.stem: path for path in (tmp_path / "parts").glob("run_*.json")}
    names = {"first2": "run_stock_generate_inf", "last1": "run_stock_generate_inf_from2", "ours": "run_ours_sparse_inf"}
    small = tmp_path / "small.json.xz"
    main(["compact", *(f"{n}={files[stem]}" for n, stem in names.items()), "--note", "CPU", "--out", str(small)])
    out = tmp_path / "joined.json"
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps({"paper": {"kept": 1}, "dense_iteration_s": 0.5}))
    main(["join", "--stock", f"{small}:first2", f"{small}:last1", "--ours", f"{small}:ours", "--out", str(out),
          "--serving-block", "decode_heavy", "--serving-json", str(serving)])  # fmt: skip
    joined = json.loads(out.read_text())
    parts = [json.loads(files[names[n]].read_text()) for n in ("first2", "last1")]
    full = summarize([RequestRecord.from_dict(r) for r in join_parts(parts)["records"]])
    stock = joined["stock"]["joined"]
    assert stock["requests"] == 3 and joined["stock"]["served"] == joined["ours"]["served"] == [0, 1, 2]
    assert stock["span_s"] == pytest.approx(full["span_s"], abs=1e-9)
    assert stock["throughput_tokens_per_s"] == pytest.approx(full["throughput_tokens_per_s"], rel=1e-9)
    assert stock["mean_ttft_s"] == pytest.approx(full["mean_ttft_s"], abs=1e-3)  # compact rounds to 0.1 ms
    ours = json.loads(files[names["ours"]].read_text())["summary"]
    assert joined["throughput_ratio"] == pytest.approx(
        ours["throughput_tokens_per_s"] / stock["throughput_tokens_per_s"]
    )
    assert joined["ours"]["joined"]["mean_ttft_s"] == pytest.approx(ours["mean_ttft_s"], abs=1e-3)
    assert joined["mean_ttft_ratio"] == pytest.approx(stock["mean_ttft_s"] / joined["ours"]["joined"]["mean_ttft_s"])
    merged = json.loads(serving.read_text())
    assert merged["paper"] == {"kept": 1} and merged["dense_iteration_s"] == 0.5
    block = merged["decode_heavy"]
    assert block["saturated_best_stock"] == "stock_generate" and block["saturated_joined"]["stock"] == stock
    assert block["saturated_joined"] == {
        "source": str(out), "stock_systems_compared": ["stock_generate"], "stock": stock,
        "ours": joined["ours"]["joined"],
    }  # fmt: skip
    assert block["saturated_throughput_ratio"] == joined["throughput_ratio"]
    assert joined["stock"]["parts"][1]["command"].endswith(parts[1]["command"].split("run", 1)[1])
    with pytest.raises(ValueError, match="part 1 serves requests 0..1, not the ones after 2"):
        main(["join", "--stock", f"{small}:last1", f"{small}:first2", "--ours", f"{small}:ours", "--out", str(out)])
    cut_short = json.loads(lzma.decompress(small.read_bytes()))["runs"]["last1"]
    cut_short["summary"] |= {"completed": 0, "failed": 1}
    cut_short["requests"][0] |= {"error": "deadline", "ttft_s": None}
    with pytest.raises(ValueError, match="part 0 completed 0 of 1 requests"):
        join_compact([cut_short])
    with pytest.raises(ValueError, match="same requests"):
        main(["join", "--stock", f"{small}:first2", "--ours", f"{small}:ours", "--out", str(tmp_path / "bad.json")])
    with pytest.raises(ValueError, match="no run 'nope'"):
        main(["join", "--stock", f"{small}:nope", "--ours", f"{small}:ours", "--out", str(tmp_path / "bad.json")])
    assert not (tmp_path / "bad.json").exists()
    figure = tmp_path / "saturated.png"
    main(["plot-saturated", f"decode_heavy, CPU={out}", "--out", str(figure)])
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (row,) = saturated_points({"decode_heavy, CPU": out})
    assert row["trace"] == "decode_heavy" and row["requests"] == 3 and row["stock"] == stock
    assert row["throughput_ratio"] == joined["throughput_ratio"] and row["stock_system"] == "stock_generate"
    assert row["devices"] == ["cpu"]  # every part ran on the CPU
    with pytest.raises(ValueError, match="not written by `python -m eval.serving join`"):
        saturated_points({"paper": serving})
