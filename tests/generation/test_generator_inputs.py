"""Every public argument of Generator, submit, stream, generate and SamplingParams is checked for
type and range: a bad one is a ValueError or TypeError naming it, raised before any state changes,
and the engine then serves the next good request as if nothing had happened."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from gen_support import VOCAB, prompt

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from toy_tokenizer import word_tokenizer

CONFIG = SparseServeConfig(block_size=16, token_budget=48)
GOOD = SamplingParams(max_new_tokens=2)


def words(ids: list[int]) -> str:
    """The toy tokenizer's text for `ids` ("w5 w6 ..." is ids 5, 6, ...)."""
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer(vocab_size=VOCAB)


def serves_normally(gen: Generator, expected_id: int, recorded: set[int] | None = None) -> None:
    """Nothing was queued or allocated, no id was used up, and a good request runs to its length;
    the engine's metrics hold the requests `recorded` (default: every id up to `expected_id`)."""
    assert not gen.has_unfinished and gen.dram_bytes_in_use() == 0 and gen.hbm_bytes_in_use() == 0
    assert gen.submit(prompt(8, 3), GOOD) == expected_id
    outs = {}
    while gen.has_unfinished:
        outs |= {e.request_id: e.output for e in gen.step() if e.finished}
    assert outs[expected_id].finish_reason == "length" and len(outs[expected_id].token_ids) == 2
    recorded = set(range(expected_id + 1)) if recorded is None else recorded
    assert set(gen.metrics()["requests"]) == recorded  # a refused request left no record


# ---- prompts ---------------------------------------------------------------------------------------

BAD_PROMPTS = [
    ([True, 2, 3], TypeError, "bool"),
    ([4, False], TypeError, "bool"),
    (torch.tensor([True, False]), TypeError, "integer dtype"),
    ([1.0, 2.0], TypeError, "float"),
    ([5, 2.5], TypeError, "float"),
    ([5, "w3"], TypeError, "str"),
    ([5, None], TypeError, "NoneType"),
    ([[1, 2, 3]], TypeError, "flat"),
    ([1, [2, 3]], TypeError, "flat"),
    (torch.tensor([1.0, 2.0]), TypeError, "integer dtype"),
    (torch.tensor([1, 2], dtype=torch.float16), TypeError, "integer dtype"),
    (np.array([1.5, 2.5]), TypeError, "integer dtype"),
    (torch.tensor(5), ValueError, r"\(T,\) or \(1, T\)"),
    (torch.ones(2, 3, dtype=torch.long), ValueError, r"\(T,\) or \(1, T\)"),
    ([-1, 2], ValueError, "vocabulary"),
    (None, TypeError, "NoneType"),
    (12345, TypeError, "int"),
    (b"w5 w6", TypeError, "bytes"),
    ({5, 6}, TypeError, "set"),
    ({"input_ids": [5, 6]}, TypeError, r"\['input_ids'\]"),
]
BAD_PROMPT_IDS = [
    "bool-first", "bool-later", "bool-tensor", "floats", "one-float", "str-id", "none-id", "nested", "nested-later",
    "float-tensor", "half-tensor", "float-array", "0-d-tensor", "2-row-tensor", "negative", "None", "int", "bytes",
    "set", "encoding",
]  # fmt: skip


@pytest.mark.core
@pytest.mark.parametrize("bad, error, match", BAD_PROMPTS, ids=BAD_PROMPT_IDS)
def test_a_malformed_prompt_is_refused_at_submit_by_name(llama, bad, error, match):
    gen = Generator(llama, None, CONFIG)
    with pytest.raises(error, match=match) as caught:
        gen.submit(bad, GOOD)
    assert "prompt" in str(caught.value)
    serves_normally(gen, expected_id=0)


@pytest.mark.core
@pytest.mark.parametrize("bad, error, match", BAD_PROMPTS[:12:3], ids=BAD_PROMPT_IDS[:12:3])
def test_generate_reports_a_malformed_prompt_as_an_error_output(llama, bad, error, match):
    gen = Generator(llama, None, CONFIG)
    outs = gen.generate([prompt(10, 1), bad], GOOD)
    assert [o.finish_reason for o in outs] == ["length", "error"]
    assert "prompt" in outs[1].error and outs[1].prompt_token_ids == () and outs[1].token_ids == ()
    serves_normally(gen, expected_id=2, recorded={0, 2})  # id 1 named the error output only


@pytest.mark.core
def test_integer_prompts_of_every_form_give_the_same_tokens(llama):
    ids = prompt(12, 4)
    forms = [
        ids,
        tuple(ids),
        torch.tensor(ids),
        torch.tensor([ids], dtype=torch.int32),
        np.array(ids),
        [np.int64(t) for t in ids],
    ]
    gen = Generator(llama, None, CONFIG)
    outs = [gen.generate([form], GOOD)[0] for form in forms]
    assert {o.prompt_token_ids for o in outs} == {tuple(ids)}
    assert len({o.token_ids for o in outs}) == 1 and all(type(t) is int for t in outs[0].prompt_token_ids)


# ---- one prompt or a list of them --------------------------------------------------------------------


@pytest.mark.core
def test_generate_takes_one_prompt_as_a_list_of_one(llama, tokenizer):
    text = words(prompt(8, 5))
    ids = tokenizer(text)["input_ids"]
    gen = Generator(llama, tokenizer, CONFIG)
    (listed,) = gen.generate([text], GOOD)
    for single in (text, ids, torch.tensor(ids)):
        outs = gen.generate(single, GOOD)
        assert len(outs) == 1, single
        assert outs[0].prompt_token_ids == tuple(ids) and outs[0].token_ids == listed.token_ids
    events = list(gen.stream(text, GOOD))
    assert {e.prompt_index for e in events} == {0} and events[-1].output.token_ids == listed.token_ids
    rows = gen.generate(torch.tensor([ids, ids[::-1]]), GOOD)  # a 2-D tensor is a list of rows
    assert [o.prompt_token_ids for o in rows] == [tuple(ids), tuple(ids[::-1])]
    assert gen.generate([], GOOD) == []


@pytest.mark.core
@pytest.mark.parametrize("bad", [None, 12345, 2.5, {"a": 1}], ids=["None", "int", "float", "dict"])
def test_generate_and_stream_refuse_what_is_no_prompt_at_the_call(llama, bad):
    gen = Generator(llama, None, CONFIG)
    with pytest.raises(TypeError, match="prompts"):
        gen.generate(bad, GOOD)
    with pytest.raises(TypeError, match="prompts"):
        gen.stream(bad, GOOD)  # at the call, not at the first next()
    serves_normally(gen, expected_id=0)


@pytest.mark.core
@pytest.mark.parametrize(
    "params, error",
    [
        ({"max_new_tokens": 3}, TypeError),
        ("greedy", TypeError),
        (3, TypeError),
        ([GOOD, {"max_new_tokens": 3}], TypeError),
        ([GOOD, GOOD, GOOD], ValueError),
    ],
    ids=["dict", "str", "int", "list-with-dict", "too-many"],
)
def test_generate_and_stream_refuse_bad_params_at_the_call(llama, params, error):
    gen = Generator(llama, None, CONFIG)
    with pytest.raises(error, match="SamplingParams"):
        gen.generate([prompt(5, 1), prompt(5, 2)], params)
    with pytest.raises(error, match="SamplingParams"):
        gen.stream([prompt(5, 1), prompt(5, 2)], params)
    serves_normally(gen, expected_id=0)


@pytest.mark.core
def test_a_params_list_may_hold_none_for_the_defaults(llama):
    outs = Generator(llama, None, CONFIG).generate([prompt(5, 1), prompt(5, 2)], [GOOD, None])
    assert [len(o.token_ids) for o in outs] == [2, SamplingParams().max_new_tokens]


@pytest.mark.core
@pytest.mark.parametrize(
    "index, error", [(-1, ValueError), ("0", TypeError), (1.0, TypeError), (True, TypeError)], ids=str
)
def test_submit_checks_prompt_index(llama, index, error):
    gen = Generator(llama, None, CONFIG)
    with pytest.raises(error, match="prompt_index"):
        gen.submit(prompt(5, 1), GOOD, prompt_index=index)
    serves_normally(gen, expected_id=0)


@pytest.mark.core
def test_stop_token_ids_past_the_vocabulary_are_refused_at_submit(llama):
    gen = Generator(llama, None, CONFIG)
    with pytest.raises(ValueError, match="stop_token_ids"):
        gen.submit(prompt(5, 1), SamplingParams(max_new_tokens=3, stop_token_ids=(3, VOCAB)))
    serves_normally(gen, expected_id=0)


# ---- SamplingParams ------------------------------------------------------------------------------------


@pytest.mark.core
@pytest.mark.parametrize(
    "values, field",
    [
        (dict(max_new_tokens=True), "max_new_tokens"),
        (dict(max_new_tokens="4"), "max_new_tokens"),
        (dict(temperature=1e-50), "temperature"),  # 0 in float32: logits / 0
        (dict(temperature=1e-40), "temperature"),  # logits / 1e-40 overflow float32
        (dict(temperature=1e-6), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1e39), "temperature"),  # inf in float32
        (dict(temperature=True), "temperature"),
        (dict(temperature="0.7"), "temperature"),
        (dict(top_k=True), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(top_k=2**63), "top_k"),
        (dict(top_p=1e-50), "top_p"),  # 0 in float32: even the likeliest token is cut
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_p="0.9"), "top_p"),
        (dict(seed=2**64), "seed"),
        (dict(seed=True), "seed"),
        (dict(seed=1.0), "seed"),
        (dict(ignore_eos="no"), "ignore_eos"),
        (dict(ignore_eos=1), "ignore_eos"),
        (dict(ignore_eos=None), "ignore_eos"),
        (dict(stop=None), "stop"),
        (dict(stop=b"x"), "stop"),
        (dict(stop=["x", 3]), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=3), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(stop_token_ids=[2.0]), "stop_token_ids"),
        (dict(stop_token_ids="12"), "stop_token_ids"),
    ],
    ids=str,
)
def test_every_sampling_field_is_checked_for_type_and_range(values, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**values)


@pytest.mark.core
def test_stop_lists_become_tuples_and_one_stop_string_is_one_stop():
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4])
    assert params.stop == ("a", "b") and params.stop_token_ids == (3, 4)
    assert SamplingParams(stop="a b").stop == ("a b",)  # one string, not the strings "a", " ", "b"
    assert SamplingParams(stop_token_ids=range(2)).stop_token_ids == (0, 1)
    assert hash(params) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(3, 4)))  # still hashable


@pytest.mark.core
@pytest.mark.parametrize(
    "values",
    [dict(temperature=1e-5), dict(temperature=1e38), dict(top_p=1e-30), dict(seed=2**64 - 1), dict(seed=0)],
    ids=str,
)
def test_sampling_at_the_edges_of_the_ranges_runs(llama, values):
    gen = Generator(llama, None, CONFIG)
    params = SamplingParams(**(dict(max_new_tokens=2, temperature=0.8) | values))
    out = gen.generate([prompt(8, 1)], params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2
    serves_normally(gen, expected_id=1)


# ---- the constructor ---------------------------------------------------------------------------------


@pytest.mark.core
@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (("MODEL", CONFIG), {}, "config goes third"),
        (("MODEL", None, {"block_size": 16, "token_budget": 48}), {}, "config must be a SparseServeConfig"),
        ((None, None, CONFIG), {}, "model must be"),
        ((object(), None, CONFIG), {}, "model must be"),
        (("MODEL", object(), CONFIG), {}, "tokenizer must be"),
        (("MODEL", "HuggingFaceTB/SmolLM2-135M-Instruct", CONFIG), {}, "tokenizer must be"),
        (("MODEL", None, CONFIG), {"metrics_file": 3}, "metrics_file"),
        (("MODEL", None, CONFIG), {"metrics_file": io.BytesIO()}, "metrics_file"),
        (("MODEL", None, CONFIG), {"metrics_file": b"metrics.jsonl"}, "metrics_file"),
    ],
    ids=[
        "config-as-tokenizer",
        "dict-config",
        "None-model",
        "object-model",
        "object-tokenizer",
        "str-tokenizer",
        "int-metrics",
        "binary-metrics",
        "bytes-metrics",
    ],
)
def test_bad_constructor_arguments_are_type_errors_naming_them(llama, args, kwargs, match):
    args = tuple(llama if a == "MODEL" else a for a in args)
    with pytest.raises(TypeError, match=match):
        Generator(*args, **kwargs)
    serves_normally(Generator(llama, None, CONFIG), expected_id=0)


@pytest.mark.core
def test_metrics_file_takes_a_path_like_and_refuses_a_missing_folder(llama, tmp_path):
    with pytest.raises(ValueError, match="metrics_file"):
        Generator(llama, None, CONFIG, metrics_file=tmp_path / "missing" / "m.jsonl")
    with pytest.raises(ValueError, match="metrics_file"):
        Generator(llama, None, CONFIG, metrics_file=tmp_path)
    gen = Generator(llama, None, CONFIG, metrics_file=tmp_path / "m.jsonl")  # a Path, not only a str
    serves_normally(gen, expected_id=0)
    assert len(Path(tmp_path / "m.jsonl").read_text().splitlines()) == 1


@pytest.mark.core
@pytest.mark.parametrize("bad", [True, False, 1.0, "1", None], ids=["True", "False", "float", "str", "None"])
def test_cancel_refuses_what_is_no_request_id(llama, bad):
    """A bool hashes like 0 or 1: cancel(True) would have cancelled request 1."""
    gen = Generator(llama, config=CONFIG)
    first, second = gen.submit(prompt(8, 3), GOOD), gen.submit(prompt(8, 4), GOOD)
    with pytest.raises(TypeError, match="request_id"):
        gen.cancel(bad)
    outs = {}
    while gen.has_unfinished:
        outs |= {e.request_id: e.output for e in gen.step() if e.finished}
    assert {outs[first].finish_reason, outs[second].finish_reason} == {"length"}
    assert gen.cancel(second) is False  # finished: unknown now
