"""The GPU benchmarks parse their arguments and run end to end at tiny shapes (--dry-run) on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from eval.bench import channel_kernel

from kernel_support import DEVICE, ON_GPU

ROOT = Path(__file__).resolve().parents[2]


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )


@pytest.mark.parametrize(
    "module",
    [
        "eval.bench.transfer",
        "eval.bench.decode_attention",
        "eval.bench.score_tuning",
        "eval.bench.miss_copy",
        "eval.bench.prefill_memory",
        "eval.bench.step_knobs",
        "eval.bench.channel_kernel",
        "eval.bench.attention_knobs",
        "eval.bench.generator_phases",
    ],
)
def test_help(module):
    assert "--out" in run_module(module, "--help").stdout


def test_transfer_dry_run_writes_its_ratios(tmp_path):
    out = tmp_path / "transfer.json"
    run_module("eval.bench.transfer", "--dry-run", "--block-kib", "16", "--out", str(out))
    result = json.loads(out.read_text())
    assert {"device", "command", "h2d_over_bulk", "d2h_over_bulk", "flash_d2h_over_bulk"} <= result.keys()
    methods = {row["method"] for row in result["rows"]}
    assert {
        "bulk",
        "copy_ per block",
        "FlashH2D gather",
        "UVA scatter (default grid)",
        "FlashD2H (staged + CPU scatter)",
    } <= methods
    assert result["h2d_over_bulk"] > 0 and "--dry-run" in result["command"]


def test_decode_attention_dry_run_writes_its_ratios(tmp_path):
    out = tmp_path / "decode.json"
    run_module("eval.bench.decode_attention", "--dry-run", "--out", str(out))
    result = json.loads(out.read_text())
    for key in ("speedup_vs_dense_sdpa", "select_and_attend_speedup", "hbm_bandwidth_fraction", "copy_gb_per_s"):
        assert result[key] > 0, key
    assert any(row["union"] for row in result["rows"])
    located = [row for row in result["rows"] if row["locality"] is not None]
    default = {row["locality"]: row for row in located if row["metadata"] == "channels"}  # SparseServeConfig()
    union = {row["locality"]: row for row in located if row["metadata"] == "hybrid"}  # the default before
    assert set(default) == set(union) == {"real", "random"} and result["select_and_attend_speedup_default"] > 0
    assert result["select_and_attend_speedup_hybrid_union"] > 0
    assert default["real"]["metadata_dtype"] == union["real"]["metadata_dtype"] == "float8_e4m3fn"
    # the union of G x 3 picks over 15 blocks is the whole table; the trace loads fewer, as a real model does
    assert 0 < union["real"]["blocks_per_kv_head"] < union["random"]["blocks_per_kv_head"]
    assert default["random"]["blocks_per_kv_head"] == 3  # one pick per KV head: exactly the budget's full blocks


def test_channel_kernel_dry_run_launches_every_setting(tmp_path):
    out = tmp_path / "channel_kernel.json"
    run_module("eval.bench.channel_kernel", "--dry-run", "--out", str(out))
    result = json.loads(out.read_text())
    assert [{name: row[name] for name in setting} for row, setting in zip(result["rows"], channel_kernel.SETTINGS)] == (
        channel_kernel.SETTINGS
    )
    assert len(result["rows"]) == len(channel_kernel.SETTINGS) and result["metadata_bytes"] > 0


def test_attention_knobs_dry_run_checks_the_kernel_and_launches_each_setting(tmp_path):
    out = tmp_path / "attention_knobs.json"
    run_module("eval.bench.attention_knobs", "--dry-run", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["max_abs_diff_vs_reference"] < 1e-4 and result["kv_bytes"] > 0
    settings = [tuple(row[name] for name in result["default"]) for row in result["rows"]]
    assert len(settings) == len(set(settings)) >= 3  # distinct launches, the defaults among them
    assert tuple(result["default"].values()) in settings
    assert result["best"] == [] and result["best_ms"] is None  # nothing is timed without a GPU


def test_score_tuning_dry_run_times_each_launch_point(tmp_path):
    out = tmp_path / "score_tuning.json"
    run_module("eval.bench.score_tuning", "--dry-run", "--out", str(out))
    result = json.loads(out.read_text())
    points = [(r["kind"], r["part"], r["warps"]) for r in result["rows"]]
    assert points == [("quest", "score", 4), ("hybrid", "score", 4), ("hybrid", "combine", 4), ("hybrid", "select", 0)]
    assert all(r["ms"] > 0 for r in result["rows"])
    assert set(result["best"]) == {"quest_score", "hybrid_score", "hybrid_combine", "hybrid_select"}


def test_miss_copy_dry_run_times_each_size_against_bulk(tmp_path):
    out = tmp_path / "miss_copy.json"
    run_module("eval.bench.miss_copy", "--dry-run", "--out", str(out))
    result = json.loads(out.read_text())
    assert [r["misses"] for r in result["rows"]] == [16, 32]
    assert all(r["us"] > 0 and r["bulk_us"] > 0 and r["over_bulk"] > 0 for r in result["rows"])


def test_prefill_memory_dry_run_runs_all_three_ways(tmp_path):
    out = tmp_path / "prefill_memory.json"
    run_module("eval.bench.prefill_memory", "--dry-run", "--out", str(out))
    result = json.loads(out.read_text())
    assert [r["way"] for r in result["rows"]] == ["dense", "chunked", "layer_segmented"]
    assert result["layer_kv_bytes"] > 0 and "layer_segmented_over_bound" in result
    for row in result["rows"][1:]:  # each Generator way really prefilled: 300 tokens x 2 layers
        assert row["prefill_token_layers"] == 600 and row["iterations"] > 1
    chunked, segmented = (row["hbm_cache_bytes"] for row in result["rows"][1:])
    layer_kv = result["layer_kv_bytes"]  # chunked holds both layers' KV of the prompt, layer-segmented one
    assert chunked - segmented == layer_kv


def test_generator_vs_generate_dry_run_writes_each_points_target_keys_and_merges_runs(tmp_path):
    out = tmp_path / "gvg.json"
    run_module("eval.bench.generator_vs_generate", "--dry-run", "--points", "closed_loop,prefill", "--out", str(out))
    first = json.loads(out.read_text())
    for key in ("stock_s", "generator_over_stock", "prefill_stock_s", "prefill_ours_s", "prefill_over_stock"):
        assert first[key] > 0, key
    loop = first["points"]["closed_loop"]
    for block in ("real_locality", "random_kv"):
        row = loop[block]
        assert row["generated_tokens"] == 3 * 6 and row["config"]["cuda_graphs"] is True  # warm-ups not counted
        assert row["failed_requests"] == row["warm_up_failed_requests"] == 0 and row["errors"] == []
        kinds = row["iterations_by_kind"]
        assert kinds["decode"]["count"] + kinds["mixed"]["count"] >= 5  # 6 tokens: 1 from prefill, 5 decoded
    run_module("eval.bench.generator_vs_generate", "--dry-run", "--points", "capacity,prefill256k", "--localities",
               "random_kv", "--variant", "capped:block_size=16:token_budget=64:load_budget=64:selection=group_union", "--out", str(out))  # fmt: skip
    merged = json.loads(out.read_text())
    assert set(merged["points"]) == {"closed_loop", "prefill", "capacity", "prefill256k"}
    assert merged["stock_s"] == first["stock_s"] and merged["prefill256k_stock_s"] > 0
    assert merged["prefill256k_ours_s"] is None and merged["points"]["prefill256k"]["random_kv"]["over_stock"] > 0
    assert merged["prefill256k_peak_vs_stock"] is None and "peak_gib" in merged["points"]["prefill256k"]["stock"]  # CPU
    assert merged["capacity_stock_batch"] == 3 and merged["capacity_generator_over_stock"] is None  # real not run
    tried = merged["points"]["capacity"]["stock_batches_tried"]
    assert tried[-1]["runs"] and all(t["expandable_segments"] is False for t in tried if DEVICE.type != "cuda")
    assert merged["points"]["capacity"]["random_kv"]["over_stock"] > 0
    capped = merged["points"]["capacity"]["random_kv@capped"]  # the variant, beside the default, same stock
    assert capped["config"]["load_budget"] == 64 and capped["generated_tokens"] == 3 * 6 and capped["over_stock"] > 0
    assert merged["points"]["capacity"]["random_kv"]["config"]["load_budget"] is None
    assert all(point["git_commit"] == merged["git_commit"] for point in merged["points"].values())


def test_generator_vs_generate_dry_run_without_stock_compares_ours_with_a_variant(tmp_path):
    out = tmp_path / "gvg.json"
    run_module("eval.bench.generator_vs_generate", "--dry-run", "--points", "closed_loop", "--skip-stock",
               "--localities", "real_locality", "--variant", "capped:block_size=16:token_budget=64:load_budget=64:selection=group_union",
               "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    loop = result["points"]["closed_loop"]
    assert loop["stock"] is None and result["stock_s"] is None and result["generator_over_stock"] is None
    for block in ("real_locality", "real_locality@capped"):
        assert loop[block]["generated_tokens"] == 3 * 6 and loop[block]["over_stock"] is None


def test_generator_phases_dry_run_accounts_for_each_iteration(tmp_path):
    out = tmp_path / "phases.json"
    run_module("eval.bench.generator_phases", "--dry-run", "--steps", "3", "--out", str(out))
    result = json.loads(out.read_text())
    phases = result["phases_ms"]
    assert phases["step"] > 0 and phases["working_sets"] > 0 and phases["sample"] > 0 and phases["emit"] > 0
    assert abs(sum(phases.values()) - result["instrumented_ms_per_step"]) < 1e-6  # "other" is the rest
    assert result["plain_ms_per_step"] > 0 and result["decode_rows_per_step"] == 3  # every request decoding


def test_generator_vs_generate_dry_run_profiles_one_more_prefill(tmp_path):
    out, profile = tmp_path / "gvg.json", tmp_path / "prefill_profile.md"
    run_module("eval.bench.generator_vs_generate", "--dry-run", "--points", "prefill", "--localities", "random_kv",
               "--out", str(out), "--profile", str(profile))  # fmt: skip
    assert json.loads(out.read_text())["points"]["prefill"]["random_kv"]["over_stock"] > 0
    text = profile.read_text()
    assert text.startswith("# 1 request(s) through an idle Generator") and "top operations by host time" in text


def test_lookup_cost_times_every_resolver_at_a_tiny_size():
    """The lookup microbenchmark's case runs (plain calls on CPU) and reports each resolver."""
    from eval.bench.lookup_cost import one_case

    from sparseserve_hf.ops import lru, triton_resolve

    resolvers = {"tensor spec": lru.resolve_, "kernels": triton_resolve.resolve_}
    line = one_case(2, 512, DEVICE, resolvers)  # the kernels run where the ops tests run them
    assert line.startswith("B=2 Pp=512 entries/partition=496: ") and "tensor spec " in line and "kernels " in line


def test_dropin_dry_run_writes_the_target_keys_through_generate(tmp_path):
    out = tmp_path / "dropin.json"
    run_module("eval.bench.dropin", "--dry-run", "--static", "--first-call", "--out", str(out))
    result = json.loads(out.read_text())
    keys = ("stock_32k_ms", "decode_ms_32k", "decode_vs_stock_32k", "decode_vs_stock_32k_layer_graphs")
    for key in keys + ("decode_vs_stock_32k_launched", "first_call_overhead_s_32k"):
        assert isinstance(result[key], float), key
    assert "first_call_overhead_s_32k_empty_triton_cache" in result and "peak_hbm_vs_stock_128k" in result
    point = result["points"]["32k"]
    stocks = [point[k] for k in ("stock", "stock_expandable", "stock_static")]
    assert all(row["decode_ms_per_step"] > 0 and len(row["windows_ms"]) == 3 for row in stocks)
    assert point["stock_best"] == min(stocks, key=lambda row: row["decode_ms_per_step"])  # the fastest of three
    assert point["stock"]["decode_ms_per_step"] == min(point["stock"]["windows_ms"])
    for block in ("real_locality", "random_kv"):
        rows = point[block]
        assert rows["launched"]["config"]["layer_graphs"] is False and rows["layer_graphs"]["config"]["layer_graphs"]
        captures = rows["whole_step"]["step_captures"]
        assert captures >= 1 if ON_GPU else captures == 0  # on CPU a cache from the model runs the step uncaptured
        for row in rows.values():
            assert row["decode_ms_per_step"] > 0 and 0 < row["loaded_fraction"] <= 1


def test_dropin_set_reaches_our_config(tmp_path):
    out = tmp_path / "dropin.json"
    run_module(
        "eval.bench.dropin", "--dry-run", "--points", "32k", "--localities", "real_locality", "--windows", "1",
        "--no-stock-expandable", "--set", "kv_dtype=float8_e4m3fn", "--out", str(out),
    )  # fmt: skip
    rows = json.loads(out.read_text())["points"]["32k"]["real_locality"]
    assert {row["config"]["kv_dtype"] for row in rows.values()} == {"float8_e4m3fn"}
    assert all(row["decode_ms_per_step"] > 0 and len(row["windows_ms"]) == 1 for row in rows.values())


def test_multi_gpu_dry_run_serves_each_engines_share(tmp_path):
    out = tmp_path / "multi_gpu.json"
    run_module("eval.bench.multi_gpu", "--dry-run", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["devices"] == ["cpu", "cpu"] and result["requests_per_engine"] == [2, 2]
    assert result["dp2_over_dp1"] > 0 and [row["generated_tokens"] for row in result["rows"]] == [12, 24]


def test_capacity_sizing_counts_the_metadata_the_store_allocates():
    """The capacity point leaves room for the block metadata: exactly what a Generator's store holds."""
    from eval.bench.generator_vs_generate import metadata_pool_bytes

    from sparseserve_hf import Generator, SparseServeConfig
    from tiny_models import tiny_model

    model = tiny_model()
    config = SparseServeConfig(block_size=16, token_budget=64, dram_bytes=3 << 20)
    store = Generator(model, None, config).store
    assert metadata_pool_bytes(config, model) == store.metadata.numel() * store.metadata.element_size() > 0


def test_longdoc_dry_run_reports_the_prefix_targets_with_equal_tokens(tmp_path):
    out = tmp_path / "longdoc.json"
    profile = tmp_path / "profile.md"
    run_module("eval.bench.longdoc", "--dry-run", "--out", str(out), "--profile", str(profile))
    result = json.loads(out.read_text())
    assert result["prefix_tokens_equal_fp32"] is True and result["check"]["dtype"] == "torch.float32"
    assert result["check"]["first_difference"] == [None] * 4  # block summaries of the keys alone: exact
    assert isinstance(result["prefix_tokens_equal"], bool) and len(result["first_difference"]) == 4
    assert "top operations by device time" in profile.read_text()
    assert result["prefix_ttft_ratio"] > 0 and 0 < result["prefix_dram_ratio"] < 1
    shared = result["prefix_caching"]
    assert len(shared["ttft_s"]) == 4 and shared["totals"]["prefix_hits"] == 4  # warm-up question 2, questions 2-4
    assert result["no_prefix_caching"]["dram_bytes_after"] == 0


@pytest.mark.parametrize(
    "mode",
    [["--no-fused-norms"], ["--graph", "--set", "kv_dtype=float8_e4m3fn", "--knob", "triton_channels.BLOCK_N=8"]],
    ids=["eager", "graph_fp8_kv"],
)
def test_profile_step_dry_run_tables_the_kernels_per_layer(tmp_path, mode):
    """The kernel profile of eager steps, or of `StaticDecoder`'s static step (its CPU form),
    under config overrides and launch knobs."""
    out = tmp_path / "profile.md"
    run_module("eval.bench.profile_step", "--dry-run", *mode, "--out", str(out))
    text = out.read_text()
    if "--graph" in mode:
        steps = "CUDA-graph replays, fused_norms=True, kv_dtype=float8_e4m3fn, triton_channels.BLOCK_N=8"
    else:
        steps = "eager steps, fused_norms=False"
    assert steps in text and "| us/layer | calls/layer | kernel |" in text and "misses per layer" in text


def test_step_knobs_dry_run_applies_its_knobs_and_appends_a_line(tmp_path):
    out = tmp_path / "knobs.jsonl"
    for knobs in ([], ["--knob", "triton_decode.PROGRAMS_PER_SM=3", "--knob", "triton_resolve.MAX_WARPS=8"]):
        run_module("eval.bench.step_knobs", "--dry-run", "--set", "fused_activation=False", *knobs, "--out", str(out))
    default, tuned = (json.loads(line) for line in out.read_text().splitlines())
    assert default["knobs"] == {} and tuned["knobs"] == {
        "triton_decode.PROGRAMS_PER_SM": 3,
        "triton_resolve.MAX_WARPS": 8,
    }
    for run in (default, tuned):
        assert run["us_per_layer"] > 0 and len(run["ms_per_step"]) == 3 and 0 < run["hit_rate"] <= 1
        assert run["config"]["fused_activation"] is False and "--dry-run" in run["command"]


def test_step_knobs_refuses_a_knob_that_names_no_constant():
    from eval.bench.step_knobs import apply_knobs

    for knob in (
        "triton_decode.PROGRAMS_PER_SM",
        "PROGRAMS_PER_SM=3",
        "triton_decode.NO_SUCH_KNOB=1",
        "triton_decode._merge=1",
    ):
        with pytest.raises(ValueError, match="knob"):
            apply_knobs([knob])


def test_a_knob_may_name_a_constant_of_a_nested_package_module(monkeypatch):
    from eval.bench.step_knobs import apply_knobs

    from sparseserve_hf.cache import block_cache

    monkeypatch.setattr(block_cache, "FREE_AHEAD", block_cache.FREE_AHEAD)  # restored after the test
    assert apply_knobs(["cache.block_cache.FREE_AHEAD=0"]) == {"cache.block_cache.FREE_AHEAD": 0}
    assert block_cache.FREE_AHEAD == 0


def test_decode_attention_default_rows_alone_with_a_knob(tmp_path):
    out = tmp_path / "decode_default.json"
    run_module(
        "eval.bench.decode_attention", "--dry-run", "--default-only", "--knob", "triton_rank.COMBINE_WARPS=4",
        "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert [(row["locality"], row["metadata"]) for row in result["rows"]] == [
        ("real", "hybrid"),
        ("random", "hybrid"),
        ("real", "channels"),
        ("random", "channels"),
    ]
    assert result["knobs"] == {"triton_rank.COMBINE_WARPS": 4} and result["select_and_attend_speedup_default"] > 0
    assert result["speedup_vs_dense_sdpa"] is None  # the Quest rows did not run


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="inline PTX runs on a CUDA GPU only")
def test_mma_probe_hands_lane_registers_to_a_tensor_core_instruction():
    from eval.bench import mma_probe

    result = mma_probe.probe()
    assert result["matches"], result


def test_projections_dry_run_times_each_projection_and_the_merged_and_beside_groups(tmp_path):
    out = tmp_path / "projections.json"
    run_module("eval.bench.projections", "--dry-run", "--rows", "1,16", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    names = {row["name"] for row in rows if row["rows"] == 16}
    assert {"q", "gate", "down", "qkv_merged", "gate_up_beside", "gate_up_serial"} <= names
    assert all(row["us"] > 0 and row["gb_per_s"] > 0 for row in rows)
    assert all(isinstance(row["merged_bits_equal"], bool) for row in rows if row["name"].endswith("_merged"))
    assert not any("merged_bits_equal" in row for row in rows if row["name"].endswith(("_serial", "_beside")))
