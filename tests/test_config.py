"""SparseServeConfig validation: every bad value names its field; every field is documented."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from sparseserve_hf import SparseServeConfig


@pytest.mark.core
@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(block_size=24), "block_size"),
        (dict(block_size=0), "block_size"),
        (dict(token_budget=16), "token_budget"),  # smaller than one 32-token block
        (dict(token_budget=64, sink_blocks=1, window_blocks=1), "token_budget"),  # no room for the tail block
        (dict(sink_blocks=-1), "sink_blocks"),
        (dict(window_blocks=1.5), "window_blocks"),
        (dict(dense_layers=(-1,)), "dense_layers"),
        (dict(dense_layers="01"), "dense_layers"),  # a sequence, but of characters
        (dict(dense_layers=(0, True)), "dense_layers"),
        (dict(dense_layers=3), "dense_layers"),
        (dict(dense_layers=None), "dense_layers"),
        (dict(metadata=["quest"]), "metadata"),
        (dict(block_size=32.0), "block_size"),
        (dict(hbm_cache_bytes="1GiB"), "hbm_cache_bytes"),
        (dict(metadata="minmax"), "metadata"),
        (dict(metadata_dtype="float16"), "metadata_dtype"),
        (dict(selection="head"), "selection"),
        (dict(group_aggregation="mean"), "group_aggregation"),
        (dict(hbm_cache_bytes=0), "hbm_cache_bytes"),
        (dict(dram_bytes=-5), "dram_bytes"),
        (dict(backend="cuda"), "backend"),
        (dict(max_batch=0), "max_batch"),
        (dict(max_batch_tokens=0), "max_batch_tokens"),
        (dict(max_batch=8, max_batch_tokens=8), "max_batch_tokens"),  # no room left for prefill
        (dict(working_set_window=0), "working_set_window"),
        (dict(admission="yes"), "admission"),
        (dict(prefill_mode="segmented"), "prefill_mode"),
        (dict(max_inject_tokens=0), "max_inject_tokens"),
        (dict(max_inject_tokens=-64), "max_inject_tokens"),
        (dict(target_tbt_ms=0), "target_tbt_ms"),
        (dict(target_tbt_ms=float("nan")), "target_tbt_ms"),
        (dict(target_tbt_ms=float("inf")), "target_tbt_ms"),
        (dict(target_tbt_ms="50"), "target_tbt_ms"),
        (dict(target_tbt_ms=True), "target_tbt_ms"),
        (dict(load_budget=0), "load_budget"),
        (dict(load_budget=1024), "load_budget"),  # below token_budget: less than one head's pick
        (dict(load_budget=4096, selection="kv_head"), "load_budget"),  # one pick per KV head: no union to cap
    ],
)
def test_bad_values_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        SparseServeConfig(**overrides)


@pytest.mark.core
def test_defaults_and_derived_sizes():
    config = SparseServeConfig()
    assert (config.block_size, config.token_budget) == (32, 2048)
    # channel scores, one selection per KV head by the group's summed estimate, the last step's exact numbers fed back
    assert (config.metadata, config.selection, config.group_aggregation) == ("channels", "kv_head", "sum")
    assert config.channel_feedback is None and config.feeds_back
    assert not SparseServeConfig(backend="flash").feeds_back  # fa4 writes no per-block log-sum-exps
    assert not SparseServeConfig(metadata="hybrid").feeds_back
    assert config.budget_blocks == 64 and config.selected_full_blocks == 63 and config.topk_blocks == 61
    assert (config.max_batch, config.max_batch_tokens, config.working_set_window, config.admission) == (
        32,
        None,
        12,
        True,
    )
    assert (config.prefill_mode, config.max_inject_tokens) == ("layer_segmented", None)
    assert config.load_budget is None and config.load_blocks is None
    assert SparseServeConfig(selection="group_union", load_budget=4096).load_blocks == 127  # the tail block on top


@pytest.mark.core
@pytest.mark.parametrize("layers", [[1, 0], (0, 1), range(2), [0, 1, 1]], ids=["list", "tuple", "range", "repeats"])
def test_dense_layers_take_any_sequence_of_ints(layers):
    config = SparseServeConfig(dense_layers=layers)
    assert config.dense_layers == (0, 1)
    assert config == SparseServeConfig(dense_layers=(0, 1))  # one config however the layers were spelled


def test_numpy_ints_become_plain_ints():
    np = pytest.importorskip("numpy")
    config = SparseServeConfig(
        token_budget=np.int64(512), dram_bytes=np.int32(1 << 20), dense_layers=[np.int64(1), np.int64(0)]
    )
    assert type(config.token_budget) is int and type(config.dram_bytes) is int
    assert config.dense_layers == (0, 1) and all(type(i) is int for i in config.dense_layers)


def test_from_dict_needs_a_mapping():
    with pytest.raises(TypeError, match="mapping"):
        SparseServeConfig.from_dict(None)


def test_frozen_and_round_trips_through_dict():
    config = SparseServeConfig(token_budget=512, dense_layers=(0, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.token_budget = 1024
    assert SparseServeConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown SparseServeConfig fields"):
        SparseServeConfig.from_dict({"token_budgett": 512})


@pytest.mark.core
@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(offload="no"), "offload"),
        (dict(fused_norms=1), "fused_norms"),
        (dict(fused_rope="yes"), "fused_rope"),
        (dict(transfer="memcpy"), "transfer"),
        (dict(save_path="d2h"), "save_path"),
        (dict(offload=False, hbm_cache_bytes=1 << 20), "hbm_cache_bytes"),  # no block cache without offload
        (dict(offload=False, save_path="flash_d2h"), "save_path"),  # FlashD2H stages through host memory
        (dict(transfer="copy", save_path="flash_d2h"), "save_path"),  # copy saves block by block itself
    ],
)
def test_ablation_switches_reject_bad_values_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        SparseServeConfig(**overrides)


@pytest.mark.core
def test_ablation_switch_defaults_and_round_trip():
    config = SparseServeConfig()
    assert (config.offload, config.transfer, config.save_path) == (True, "kernel", "scatter")
    ablation = SparseServeConfig(offload=False, transfer="copy", dram_bytes=1 << 20)
    assert SparseServeConfig.from_dict(ablation.to_dict()) == ablation


def test_kv_dtype_takes_float8_and_refuses_the_flash_backend():
    assert SparseServeConfig().kv_dtype == "auto"
    assert SparseServeConfig(kv_dtype="float8_e4m3fn").kv_dtype == "float8_e4m3fn"
    with pytest.raises(ValueError, match="kv_dtype"):
        SparseServeConfig(kv_dtype="int8")
    with pytest.raises(NotImplementedError, match="kv_dtype"):
        SparseServeConfig(kv_dtype="float8_e4m3fn", backend="flash")


@pytest.mark.core
def test_every_field_has_a_row_in_the_readme_and_in_the_configuration_reference_with_its_default():
    root = Path(__file__).resolve().parents[1]
    for page in (root / "README.md", root / "docs" / "configuration.md"):
        rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", page.read_text(encoding="utf-8"), re.MULTILINE))
        for field in dataclasses.fields(SparseServeConfig):
            assert field.name in rows, f"{page.name} has no row for SparseServeConfig.{field.name}"
            written = rows[field.name].strip().strip("`")  # e.g. 32, None, "hybrid", ()
            assert written == repr(field.default).replace("'", '"'), (page.name, field.name, written, field.default)
