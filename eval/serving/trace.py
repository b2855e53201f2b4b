"""The serving trace: a fixed, seeded list of requests whose arrival times scale with the rate.

Prompt lengths are drawn log-uniformly from a long-context range, prompt tokens are windows of
real text (the Paul Graham essays through the default model's tokenizer, repeated where a prompt
is longer than the text), output lengths uniformly or from a weighted set of lengths, and arrival
gaps from Exp(1): at rate r the gaps are divided by r, so every rate replays the same requests in
the same order (Poisson arrivals at rate r); at rate inf every request arrives at time zero (a
saturated run).

Two presets (`PRESETS`): "paper", SparseServe's workload (8K-64K prompts, LongBench's output
lengths: each task's maximum generation length, clipped to 64-512, weighted by the task's share
of LongBench's records), and "decode_heavy" (16K-32K prompts, 512-2048 new tokens), where
offload and working-set admission pay most.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TraceRequest:
    index: int
    gap: float  # Exp(1) gap before this arrival, in units of 1/rate (0 for the first request)
    prompt: tuple[int, ...]
    output_tokens: int


# LongBench v1: each task's maximum generation length (config/dataset2maxlen.json) and its records.
LONGBENCH_TASKS: dict[str, tuple[int, int]] = {
    "narrativeqa": (128, 200), "qasper": (128, 200), "multifieldqa_en": (64, 150), "multifieldqa_zh": (64, 200),
    "hotpotqa": (32, 200), "2wikimqa": (32, 200), "musique": (32, 200), "dureader": (128, 200),
    "gov_report": (512, 200), "qmsum": (512, 200), "multi_news": (512, 200), "vcsum": (512, 200),
    "trec": (64, 200), "triviaqa": (32, 200), "samsum": (128, 200), "lsht": (64, 200),
    "passage_count": (32, 200), "passage_retrieval_en": (32, 200), "passage_retrieval_zh": (32, 200),
    "lcc": (64, 500), "repobench-p": (64, 500),
}  # fmt: skip


def longbench_output_mix(low: int = 64, high: int = 512) -> tuple[tuple[int, int], ...]:
    """(output tokens, weight) pairs: LongBench's per-task maximum generation lengths clipped to
    [low, high], each weighted by its tasks' records."""
    weights: dict[int, int] = {}
    for max_len, records in LONGBENCH_TASKS.values():
        length = min(max(max_len, low), high)
        weights[length] = weights.get(length, 0) + records
    return tuple(sorted(weights.items()))


PRESETS: dict[str, dict] = {
    "paper": {"prompt_range": (8192, 65536), "output_choices": longbench_output_mix()},
    "decode_heavy": {"prompt_range": (16384, 32768), "output_range": (512, 2048)},
}


@dataclass(frozen=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    source: str  # where the prompt tokens come from
    seed: int
    name: str = ""  # the preset it was built from, if any

    def arrivals(self, rate: float) -> list[float]:
        """Seconds after time zero at which each request arrives at `rate` requests per second
        (inf: all at time zero, a saturated run)."""
        if not rate > 0:
            raise ValueError(f"rate must be > 0 requests per second, got {rate!r}")
        return list(itertools.accumulate(0.0 if math.isinf(rate) else r.gap / rate for r in self.requests))

    def save(self, path: str | Path) -> None:
        ids = torch.tensor([t for r in self.requests for t in r.prompt], dtype=torch.int32)
        torch.save(
            {
                "ids": ids,
                "lengths": [len(r.prompt) for r in self.requests],
                "gaps": [r.gap for r in self.requests],
                "output_tokens": [r.output_tokens for r in self.requests],
                "source": self.source,
                "seed": self.seed,
                "name": self.name,
            },
            path,
        )

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        data = torch.load(path, weights_only=True)
        ids, requests, start = data["ids"].tolist(), [], 0
        for index, (length, gap, out) in enumerate(zip(data["lengths"], data["gaps"], data["output_tokens"])):
            requests.append(TraceRequest(index, gap, tuple(ids[start : start + length]), out))
            start += length
        return cls(tuple(requests), data["source"], data["seed"], data.get("name", ""))

    def summary(self) -> dict:
        lengths = [len(r.prompt) for r in self.requests]
        outputs = [r.output_tokens for r in self.requests]
        return {
            "name": self.name,
            "requests": len(self.requests),
            "source": self.source,
            "seed": self.seed,
            "prompt_tokens": {"min": min(lengths), "mean": sum(lengths) / len(lengths), "max": max(lengths)},
            "output_tokens": {"min": min(outputs), "mean": sum(outputs) / len(outputs), "max": max(outputs)},
        }


def build_trace(
    text_ids: list[int],
    *,
    num_requests: int = 40,
    prompt_range: tuple[int, int] = (8192, 65536),
    output_range: tuple[int, int] = (32, 128),
    output_choices: tuple[tuple[int, int], ...] | None = None,
    seed: int = 0,
    source: str = "",
    name: str = "",
) -> Trace:
    """`num_requests` requests with prompts cut from `text_ids` (seeded: the same trace every time).

    Output lengths: uniform over `output_range`, or drawn from `output_choices` ((length, weight)
    pairs) when given."""
    (low, high), (out_low, out_high) = prompt_range, output_range
    if not 0 < low <= high or not 0 < out_low <= out_high:
        raise ValueError(f"bad ranges: prompts {prompt_range}, outputs {output_range} (need 0 < low <= high)")
    if num_requests < 1 or not text_ids:
        raise ValueError("need at least one request and some text")
    if output_choices is not None and (not output_choices or any(n < 1 or w <= 0 for n, w in output_choices)):
        raise ValueError(f"output_choices must be (length >= 1, weight > 0) pairs, got {output_choices!r}")
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        length = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        start = rng.randrange(len(text_ids))
        prompt = tuple(itertools.islice(itertools.cycle(text_ids[start:] + text_ids[:start]), length))
        gap = 0.0 if index == 0 else rng.expovariate(1.0)
        if output_choices is None:
            output = rng.randint(out_low, out_high)
        else:
            output = rng.choices([n for n, _ in output_choices], weights=[w for _, w in output_choices])[0]
        requests.append(TraceRequest(index, gap, prompt, output))
    return Trace(tuple(requests), source, seed, name)


def essay_token_ids() -> tuple[list[int], str]:
    """The Paul Graham essays through the default model's tokenizer, and a label saying so."""
    from sparseserve_hf.data.haystack import load_essays
    from sparseserve_hf.data.models import load_default

    _, tokenizer = load_default()
    ids = tokenizer(load_essays(), add_special_tokens=False).input_ids
    return ids, f"Paul Graham essays, SmolLM2 tokenizer ({len(ids)} tokens)"
