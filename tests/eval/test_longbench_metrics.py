"""LongBench metrics against values computed by hand (and upstream quirks kept on purpose)."""

from __future__ import annotations

import pytest

pytest.importorskip("rouge")
pytest.importorskip("jieba")
pytest.importorskip("fuzzywuzzy")

from eval.accuracy.longbench_metrics import (
    DATASET_TO_METRIC,
    base_task,
    classification_score,
    code_sim_score,
    count_score,
    length_bucket,
    normalize_answer,
    normalize_zh_answer,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
    score_sample,
)


def test_normalize_answer_drops_case_punctuation_articles():
    assert normalize_answer("An apple, the PIE.") == "apple pie"
    assert normalize_answer("  The   Quick-brown fox! ") == "quickbrown fox"


def test_normalize_zh_answer_drops_both_punctuations_and_spaces():
    assert normalize_zh_answer("你好， 世界！ OK.") == "你好世界ok"


def test_qa_f1_with_articles_and_punctuation():
    # "cat sat" vs "cat sat on mat": 2 shared tokens, P = 2/2, R = 2/4 -> F1 = 2/3.
    assert qa_f1_score("The Cat, sat!", "a cat sat on the mat") == pytest.approx(2 / 3)
    assert qa_f1_score("The answer.", "answer") == 1.0
    assert qa_f1_score("dog", "cat") == 0.0
    assert qa_f1_score("", "cat") == 0.0


def test_qa_f1_zh_uses_jieba_words():
    # jieba: 首都/是/北京 vs 中国/的/首都/是/北京: 3 shared, P = 1, R = 3/5 -> F1 = 0.75.
    assert qa_f1_zh_score("首都是北京", "中国的首都是北京") == pytest.approx(0.75)
    # Same words, other order, trailing "。" dropped by the normalization -> 1.
    assert qa_f1_zh_score("北京是中国的首都。", "中国的首都是北京") == pytest.approx(1.0)


def test_rouge_l_uses_package_rouge():
    # LCS "cat sat on mat" = 4 of 6 words each way -> F = 0.8 with `rouge` (rouge-score says 0.667).
    assert rouge_score("the cat sat on the mat", "a cat sat on a mat") == pytest.approx(0.8, abs=1e-6)
    assert rouge_score("", "a cat") == 0.0  # `rouge` raises on empty text: LongBench scores 0


def test_rouge_zh_cuts_with_jieba():
    # 我/爱/北京/天安门 vs 我/爱/北京: LCS 3, P = 3/4, R = 1 -> F = 6/7.
    assert rouge_zh_score("我爱北京天安门", "我爱北京") == pytest.approx(6 / 7, abs=1e-6)


def test_classification_score_rules():
    classes = ["Fish", "Fishing", "Bird"]
    # "Fish" is a strict substring of the truth "Fishing": dropped, so "Fishing" wins alone.
    assert classification_score("Fishing and fish", "Fishing", all_classes=classes) == 1.0
    assert classification_score("Location or Description", "Location", all_classes=["Location", "Description"]) == 0.5
    assert classification_score("Bird", "Fishing", all_classes=classes) == 0.0
    assert classification_score("no class named", "Fishing", all_classes=classes) == 0.0
    with pytest.raises(ValueError, match="all_classes"):
        classification_score("Fish", "Fish")


def test_classification_keeps_upstream_remove_while_iterating():
    # Upstream removes "ab", skips "a", removes "b", so "a" survives: 1/2 (a fixed loop would give 1).
    assert classification_score("abc", "abc", all_classes=["ab", "a", "b", "abc"]) == 0.5


def test_retrieval_scores_share_of_right_numbers():
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("The answer is Paragraph 2", "Paragraph 12") == 0.0
    assert retrieval_score("no number", "Paragraph 12") == 0.0
    assert retrieval_zh_score("段落3，不是段落5", "段落3") == 0.5
    with pytest.raises(ValueError, match="paragraph"):
        retrieval_score("1", "twelve")


def test_count_score():
    assert count_score("I count 7 or 8", 7) == 0.5
    assert count_score("7", "7") == 1.0
    assert count_score("seven", 7) == 0.0


def test_code_sim_takes_first_code_line():
    prediction = "\n# a comment\n```python\nreturn x + 1\nmore"
    assert code_sim_score(prediction, "return x + 1") == 1.0
    # difflib ratio 2 * 7 / 15 = 0.933 -> fuzz.ratio 93.
    assert code_sim_score("retur x", "return x") == 0.93
    assert code_sim_score("// only comments", "x") == 0.0


def test_score_sample_max_over_answers_first_line_and_scale():
    assert score_sample("hotpotqa", "cat", ["dog", "the cat"]) == 100.0
    # trec keeps only the first line ...
    assert score_sample("trec", "\nLocation\nDescription", ["Location"], ["Location", "Description"]) == 100.0
    # ... passage_count does not: "7" and "8" both count.
    assert score_sample("passage_count", "7\n8", [7]) == 50.0
    assert score_sample("trec_e", "Location\nDescription", ["Location"], ["Location", "Description"]) == 100.0
    with pytest.raises(ValueError, match="unknown LongBench task"):
        score_sample("nope", "x", ["x"])
    with pytest.raises(ValueError, match="reference answer"):
        score_sample("hotpotqa", "x", [])


def test_task_table_covers_v1_and_e():
    assert len(DATASET_TO_METRIC) == 21 + 13
    assert DATASET_TO_METRIC["multifieldqa_zh"] is qa_f1_zh_score
    assert DATASET_TO_METRIC["repobench-p_e"] is code_sim_score
    assert base_task("lcc_e") == "lcc" and base_task("lcc") == "lcc"
    assert [length_bucket(n) for n in (3999, 4000, 8000)] == ["0-4k", "4-8k", "8k+"]
