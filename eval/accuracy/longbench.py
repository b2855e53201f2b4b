"""LongBench v1 (and LongBench-E) runner: dense attention vs SparseServeCache at token budgets.

Follows LongBench's `pred.py` / `eval.py` protocol: the per-task prompt templates and maximum
generation lengths of `config/dataset2prompt.json` / `dataset2maxlen.json`, truncation of the
prompt's tokens in the middle to `--max-length` (first half + last half: instructions sit at both
ends), the model's chat template except on the few-shot and code tasks, greedy decoding, and the
metrics of `eval/accuracy/longbench_metrics.py` (scores 0-100).

Data: `--data-dir DIR` reads `DIR/<task>.jsonl` (LongBench's own JSONL; no `datasets` needed), else
`datasets.load_dataset("THUDM/LongBench", task, split="test")` (needs the Hub).

    python -m eval.accuracy.longbench --tasks multi_news,multifieldqa_zh --data-dir DIR \\
        --budgets 512,1024,2048 --max-samples 50 --max-length 7500 --out eval/results/longbench_smollm2

Outputs (see eval/common.py): samples.jsonl, summary.json, results.md, score_vs_budget.png.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from eval.accuracy.longbench_metrics import DATASET_TO_METRIC, base_task, length_bucket, score_sample
from eval.common import (
    Method,
    answer_batch,
    batches,
    metadata_kinds,
    parse_budgets,
    sparse_methods,
    write_results,
)
from sparseserve_hf import SparseServeConfig

HUB_DATASET = "THUDM/LongBench"

# LongBench config/dataset2prompt.json. (Older upstream revisions spell "asconcisely" in
# narrativeqa; this is the current text.)
DATASET_TO_PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
        "Story: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single "
        "phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
        "single phrase or sentence if possible. If the question cannot be answered based on the information in the "
        'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". '
        "Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as "
        "concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered "
        'based on the information in the article, write "unanswerable". If the question is a yes/no question, '
        'answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:'
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
        "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，"
        "不要输出任何其他字词。\n\n问题：{input}\n回答："
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
        "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
        "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
        "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only contain the number, "
        "such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        'the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", '
        "etc.\n\nThe answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n"
        '{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：'
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# LongBench config/dataset2maxlen.json: maximum new tokens per task.
DATASET_TO_MAXLEN: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "multifieldqa_zh": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "dureader": 128,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "vcsum": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "lsht": 64,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32,
    "lcc": 64,
    "repobench-p": 64,
}

V1_TASKS: tuple[str, ...] = tuple(DATASET_TO_PROMPT)
E_TASKS: tuple[str, ...] = tuple(task for task in DATASET_TO_METRIC if task.endswith("_e"))
# LongBench feeds these raw: chat models do better on few-shot and code prompts without the template.
NO_CHAT_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
DEFAULT_MAX_LENGTH = 7500  # SmolLM2's 8192 positions minus the longest generation (512) and chat tokens


def parse_tasks(text: str) -> list[str]:
    """ "multi_news,hotpotqa_e" -> the list; "all" = the 21 v1 tasks, "all_e" = the 13 LongBench-E tasks.

    Raises:
        ValueError: an unknown task name, or none at all.
    """
    tasks: list[str] = []
    for name in (part.strip() for part in text.split(",")):
        if name == "all":
            tasks.extend(V1_TASKS)
        elif name == "all_e":
            tasks.extend(E_TASKS)
        elif name:
            base_task(name)  # raises ValueError for unknown names
            tasks.append(name)
    if not tasks:
        raise ValueError(f"--tasks needs at least one LongBench task, got {text!r}")
    return tasks


def build_prompt(task: str, record: dict) -> str:
    """The task's LongBench template filled with the record's `context` and `input`.

    Raises:
        ValueError: the record lacks a field the template uses.
    """
    try:
        return DATASET_TO_PROMPT[base_task(task)].format(**record)
    except KeyError as exc:
        raise ValueError(f"{task}: record {record.get('_id', '?')} has no field {exc}") from None


def truncate_middle_ids(ids: Sequence[int], max_length: int) -> tuple[list[int], list[int]] | None:
    """The first and last `max_length // 2` ids if `ids` is longer than `max_length`, else None.

    Raises:
        ValueError: `max_length` < 2.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 to keep both ends of the prompt, got {max_length}")
    if len(ids) <= max_length:
        return None
    half = max_length // 2
    return list(ids[:half]), list(ids[-half:])


def truncate_middle(tokenizer, prompt: str, max_length: int) -> str:
    """LongBench's middle truncation: decode the first and last halves of the prompt's tokens and join.

    The text is returned (not the ids) because LongBench re-tokenizes after adding the chat template.
    """
    ids = tokenizer(prompt, truncation=False).input_ids
    halves = truncate_middle_ids(ids, max_length)
    if halves is None:
        return prompt
    head, tail = halves
    return tokenizer.decode(head, skip_special_tokens=True) + tokenizer.decode(tail, skip_special_tokens=True)


def uses_chat_template(tokenizer, task: str) -> bool:
    """True if the tokenizer has a chat template and LongBench applies one to `task`."""
    return bool(getattr(tokenizer, "chat_template", None)) and base_task(task) not in NO_CHAT_TASKS


def encode_sample(tokenizer, task: str, record: dict, max_length: int) -> torch.Tensor:
    """Prompt ids (1, T) for one record: template, middle truncation, chat template where used."""
    prompt = truncate_middle(tokenizer, build_prompt(task, record), max_length)
    if not uses_chat_template(tokenizer, task):
        return tokenizer(prompt, truncation=False, return_tensors="pt").input_ids
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    # The template text already carries its special tokens; adding BOS again would double it.
    return tokenizer(text, truncation=False, add_special_tokens=False, return_tensors="pt").input_ids


def read_jsonl(path: Path) -> list[dict]:
    """One dict per non-empty line of a JSON-lines file.

    Raises:
        ValueError: a line is not valid JSON (the message names file and line).
    """
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
    return records


def load_task(task: str, data_dir: str | Path | None = None, max_samples: int | None = None) -> list[dict]:
    """The task's test records: `data_dir/<task>.jsonl` if `data_dir` is given, else the Hub dataset.

    Raises:
        FileNotFoundError: `data_dir` has no `<task>.jsonl`.
        RuntimeError: no `data_dir` and the Hub dataset cannot be loaded (offline, no `datasets`).
    """
    base_task(task)  # validates the name before touching disk or network
    if data_dir is not None:
        path = Path(data_dir) / f"{task}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"no {task}.jsonl in {data_dir} (expected LongBench JSONL at {path})")
        records = read_jsonl(path)
    else:
        records = _load_from_hub(task)
    return records if max_samples is None else records[:max_samples]


def _load_from_hub(task: str) -> list[dict]:
    try:
        from datasets import load_dataset
    except ImportError:
        raise RuntimeError(
            f"loading {task} from the Hub needs `pip install datasets`; or pass --data-dir with LongBench JSONL files"
        ) from None
    try:
        return list(load_dataset(HUB_DATASET, task, split="test"))
    except Exception as exc:  # ConnectionError offline, DatasetNotFoundError, ... all mean the same here
        raise RuntimeError(
            f"could not load {HUB_DATASET}/{task} from the Hub ({type(exc).__name__}: {exc}). Offline, pass "
            "--data-dir pointing at a folder of LongBench JSONL files (<task>.jsonl)."
        ) from exc


@contextlib.contextmanager
def samsum_stopping(model, tokenizer, task: str) -> Iterator[None]:
    """On samsum, stop at the first newline after at least one token, as LongBench's pred.py does.

    Without it models repeat "\\nDialogue: ..." until the length limit. Other tasks: no change.
    """
    if base_task(task) != "samsum":
        yield
        return
    saved = copy.deepcopy(model.generation_config)
    newline = tokenizer.encode("\n", add_special_tokens=False)[-1]
    stop = [tokenizer.eos_token_id, newline] if tokenizer.eos_token_id is not None else [newline]
    model.generation_config.eos_token_id = stop
    model.generation_config.min_new_tokens = 1
    try:
        yield
    finally:
        model.generation_config = saved


def run(
    model,
    tokenizer,
    tasks: Sequence[str],
    methods: Sequence[Method],
    data_dir: str | Path | None = None,
    max_samples: int | None = None,
    max_length: int = DEFAULT_MAX_LENGTH,
    max_new_tokens: int | None = None,
    batch_size: int = 1,
) -> list[dict]:
    """Answer every sample of every task with every method; one row per (sample, method).

    Args:
        max_new_tokens: cap on LongBench's per-task generation length (smoke runs only; None keeps
            the protocol's length).
        batch_size: samples per `generate` call (left-padded; samples are batched in order of
            length so little padding is computed).

    Returns:
        Rows with task, method, budget, id, score (0-100), prediction, answers, length, bucket
        (LongBench-E length bucket) and prompt_tokens, in record order per method.
    """
    rows: list[dict] = []
    for task in tasks:
        records = load_task(task, data_dir, max_samples)
        max_gen = DATASET_TO_MAXLEN[base_task(task)]
        if max_new_tokens is not None:
            max_gen = min(max_gen, max_new_tokens)
        # One tokenization per sample, shared by all methods.
        prompts = [encode_sample(tokenizer, task, record, max_length)[0] for record in records]
        by_length = sorted(range(len(records)), key=lambda i: prompts[i].numel())
        predictions: dict[tuple[str, int], tuple[str, dict]] = {}
        for batch in tqdm(batches(by_length, batch_size), desc=task):
            for method in methods:
                with samsum_stopping(model, tokenizer, task):
                    texts, loads = answer_batch(model, tokenizer, [prompts[i] for i in batch], method, max_gen)
                predictions.update({(method.name, i): (text, loads) for i, text in zip(batch, texts)})
        for method in methods:
            for index, record in enumerate(records):
                prediction, loads = predictions[(method.name, index)]
                rows.append(_row(task, index, record, method, prediction, prompts[index].numel()) | loads)
    return rows


def _row(task: str, index: int, record: dict, method: Method, prediction: str, prompt_tokens: int) -> dict:
    score = score_sample(task, prediction, record["answers"], record.get("all_classes"))
    length = record.get("length")
    return {
        "task": task,
        "method": method.name,
        "budget": method.budget,
        "id": record.get("_id", index),
        "score": score,
        "prediction": prediction,
        "answers": record["answers"],
        "length": length,
        "bucket": length_bucket(length) if isinstance(length, int) else None,
        "prompt_tokens": prompt_tokens,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", required=True, help='comma-separated tasks; "all" (21 v1 tasks), "all_e" (13)')
    parser.add_argument("--data-dir", default=None, help="folder of <task>.jsonl; default: the Hub dataset")
    parser.add_argument("--budgets", default="512,1024,2048", help="SparseServeCache token budgets")
    parser.add_argument(
        "--metadata",
        default=SparseServeConfig().metadata,
        help='block metadata kinds to compare, e.g. "hybrid,quest" (the default kind is "sparse_*"); "none": '
        "only dense and the --variant families",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help='a selection variant as its own method family, repeatable: "FAMILY:field=value[:field=value]"',
    )
    parser.add_argument("--max-samples", type=int, default=None, help="first N records per task")
    parser.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH, help="prompt tokens kept")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="cap on generation (smoke runs only)")
    parser.add_argument("--batch-size", type=int, default=1, help="samples per generate call")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="eval/results/longbench")
    args = parser.parse_args(argv)
    if args.max_samples is not None and args.max_samples <= 0:
        parser.error(f"--max-samples must be positive, got {args.max_samples}")
    if args.batch_size <= 0:
        parser.error(f"--batch-size must be positive, got {args.batch_size}")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """CLI entry point; returns the summary written to `--out`."""
    from sparseserve_hf.data.models import DEFAULT_MODEL_NAME, load_default

    args = parse_args(argv)
    tasks = parse_tasks(args.tasks)
    methods = sparse_methods(parse_budgets(args.budgets), metadata_kinds(args.metadata), args.variant)
    dtype = torch.bfloat16 if str(args.device).startswith("cuda") else torch.float32
    model, tokenizer = load_default(dtype=dtype, attn_implementation="sparseserve", device=args.device)
    start = time.time()
    rows = run(
        model, tokenizer, tasks, methods, args.data_dir, args.max_samples, args.max_length, args.max_new_tokens,
        args.batch_size,
    )  # fmt: skip
    meta = {
        "benchmark": "LongBench v1",
        "command": " ".join(["python -m eval.accuracy.longbench", *(argv if argv is not None else sys.argv[1:])]),
        "model": DEFAULT_MODEL_NAME,
        "device": str(args.device),
        "dtype": str(dtype),
        "tasks": tasks,
        "methods": [m.name for m in methods],
        "data": str(args.data_dir) if args.data_dir else HUB_DATASET,
        "max_samples": args.max_samples,
        "max_length": args.max_length,
        "max_new_tokens_cap": args.max_new_tokens,
        "seconds": round(time.time() - start, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    summary = write_results(Path(args.out), rows, meta)
    print((Path(args.out) / "results.md").read_text())
    return summary


if __name__ == "__main__":
    main()
