"""Bad requests get a clear error naming the problem; everything else keeps running and leaks nothing."""

from __future__ import annotations

import pytest
from gen_support import VOCAB, prompt, tiny_model

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig

CONFIG = SparseServeConfig(block_size=16, token_budget=48)


@pytest.mark.core
@pytest.mark.parametrize(
    "values, field",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(seed=-3), "seed"),
        (dict(stop=["x", ""]), "stop"),
        (dict(stop=("",)), "stop"),
        (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    ],
)
def test_bad_sampling_values_name_the_field(values, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**values)


@pytest.mark.core
@pytest.mark.parametrize(
    "bad, config, match",
    [
        ([], CONFIG, "empty prompt"),
        ("hello", CONFIG, "needs a tokenizer"),
        ([1, VOCAB], CONFIG, "vocabulary"),
        ([1, -2], CONFIG, "vocabulary"),
        (list(range(1, 200)) * 11, CONFIG, "max_position_embeddings"),
        (prompt(400, 1), SparseServeConfig(block_size=16, token_budget=48, hbm_cache_bytes=40 * 2048), "fit alone"),
        (prompt(300, 1), SparseServeConfig(block_size=16, token_budget=48, dram_bytes=40 * 2048), "DRAM blocks"),
    ],
    ids=["empty", "string-no-tokenizer", "id-too-big", "negative-id", "past-context", "hbm", "dram"],
)
def test_bad_prompt_is_refused_at_submit_and_others_continue(llama, bad, config, match):
    gen = Generator(llama, None, config)
    good = gen.submit(prompt(40, 2), SamplingParams(max_new_tokens=4))
    gen.step()
    with pytest.raises(ValueError, match=match):
        gen.submit(bad, SamplingParams(max_new_tokens=4))
    outs = {}
    while gen.has_unfinished:
        outs |= {e.request_id: e.output for e in gen.step() if e.finished}
    assert outs[good].finish_reason == "length" and len(outs[good].token_ids) == 4
    assert gen.dram_bytes_in_use() == 0 and gen.hbm_bytes_in_use() == 0


def test_generate_reports_a_bad_prompt_as_an_error_output(llama):
    gen = Generator(llama, None, CONFIG)
    outs = gen.generate([prompt(30, 1), [], prompt(10, 2)], SamplingParams(max_new_tokens=3))
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "empty prompt" in outs[1].error and outs[1].token_ids == ()
    assert len({o.request_id for o in outs}) == 3
    with pytest.raises(TypeError, match="SamplingParams"):
        gen.submit([1, 2], {"max_new_tokens": 3})
    with pytest.raises(ValueError, match="one per prompt"):
        gen.generate([[1, 2]], [SamplingParams(), SamplingParams()])


def test_stop_strings_need_a_tokenizer(llama):
    with pytest.raises(ValueError, match="tokenizer"):
        Generator(llama, None, CONFIG).submit([1, 2, 3], SamplingParams(stop=("x",)))


def test_unsupported_setups_are_refused(llama):
    with pytest.raises(ValueError, match="attn_implementation='sparseserve'"):
        Generator(tiny_model("llama", "sdpa"), None, CONFIG)
    with pytest.raises(NotImplementedError, match="dense_layers"):
        Generator(llama, None, SparseServeConfig(block_size=16, token_budget=48, dense_layers=(0,)))
    with pytest.raises(NotImplementedError, match="full attention"):
        Generator(tiny_model("gemma3", num_layers=3), None, CONFIG)
    with pytest.raises(ValueError, match="hbm_cache_bytes"):
        Generator(llama, None, SparseServeConfig(block_size=16, token_budget=48, hbm_cache_bytes=2048))


def test_a_failing_prefill_fails_only_its_request(llama, monkeypatch):
    gen = Generator(llama, None, CONFIG)
    first = gen.submit(prompt(40, 1), SamplingParams(max_new_tokens=6))
    gen.step()
    real_advance = gen.prefill.advance

    def broken(job, budget, **options):
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(gen.prefill, "advance", broken)
    doomed = gen.submit(prompt(50, 2), SamplingParams(max_new_tokens=6))
    events = gen.step()
    monkeypatch.setattr(gen.prefill, "advance", real_advance)
    failed = [e.output for e in events if e.finished]
    assert [(o.request_id, o.finish_reason) for o in failed] == [(doomed, "error")]
    assert "simulated device fault" in failed[0].error
    outs = {}
    while gen.has_unfinished:
        outs |= {e.request_id: e.output for e in gen.step() if e.finished}
    assert len(outs[first].token_ids) == 6 and gen.dram_bytes_in_use() == 0
