"""The Generator builds its one store from the config: the ablation switches reach it and keep the tokens."""

from __future__ import annotations

import pytest
from gen_support import prompt

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.cache.resident import ResidentBlocks

LENGTHS = (5, 37, 80, 130, 16)


def config(**overrides) -> SparseServeConfig:
    return SparseServeConfig(**(dict(block_size=16, token_budget=48, max_batch=3) | overrides))


def run(model, **overrides) -> tuple[list[tuple[int, ...]], Generator]:
    gen = Generator(model, None, config(**overrides))
    outs = gen.generate([prompt(n, seed=n) for n in LENGTHS], SamplingParams(max_new_tokens=16))
    return [o.token_ids for o in outs], gen


@pytest.mark.core
@pytest.mark.parametrize(
    "overrides",
    [dict(offload=False), dict(offload=False, dram_bytes=1 << 20), dict(transfer="copy"), dict(save_path="flash_d2h")],
    ids=["no-offload", "no-offload-fixed-pool", "copy", "flash-d2h"],
)
def test_switches_keep_the_generators_tokens(llama, overrides):
    expected, _ = run(llama)
    tokens, gen = run(llama, **overrides)
    assert tokens == expected
    totals = gen.metrics()["totals"]
    assert totals["hbm_bytes_in_use"] == 0 and totals["dram_bytes_in_use"] == 0 and gen.store.dram.num_used == 0
    if overrides.get("transfer") == "copy":
        assert gen.store.ops.name == "torch+copy"
    if "save_path" in overrides:
        assert gen.store.saver is not None
        gen.store.saver.close()


@pytest.mark.core
def test_no_offload_counts_blocks_as_hbm_and_never_misses(llama):
    gen = Generator(llama, None, config(offload=False))
    ids = [gen.submit(prompt(n, seed=n), SamplingParams(max_new_tokens=8)) for n in (80, 130)]
    for _ in range(6):
        gen.step()
    assert isinstance(gen.store.hbm, ResidentBlocks) and gen.store.dram.num_used > 0
    assert gen.dram_bytes_in_use() == 0
    assert gen.hbm_bytes_in_use() >= gen.store.dram.num_used * gen.store.block_bytes
    while gen.has_unfinished:
        gen.step()
    totals = gen.metrics()["totals"]
    assert totals["hit_rate"] == 1.0 and totals["misses"] == 0 and totals["h2d_bytes"] == 0 and totals["hits"] > 0
    assert len(ids) == totals["finished"] == 2
