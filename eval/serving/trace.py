"""The serving trace: a fixed, seeded list of requests whose arrival times scale with the rate.

Prompt lengths are drawn log-uniformly from a long-context range, prompt tokens are windows of
real text (the Paul Graham essays through the default model's tokenizer, repeated where a prompt
is longer than the text), output lengths uniformly, and arrival gaps from Exp(1): at rate r the
gaps are divided by r, so every rate replays the same requests in the same order (Poisson
arrivals at rate r).
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


@dataclass(frozen=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    source: str  # where the prompt tokens come from
    seed: int

    def arrivals(self, rate: float) -> list[float]:
        """Seconds after time zero at which each request arrives at `rate` requests per second."""
        if not rate > 0:
            raise ValueError(f"rate must be > 0 requests per second, got {rate!r}")
        return list(itertools.accumulate(r.gap / rate for r in self.requests))

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
        return cls(tuple(requests), data["source"], data["seed"])

    def summary(self) -> dict:
        lengths = [len(r.prompt) for r in self.requests]
        outputs = [r.output_tokens for r in self.requests]
        return {
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
    seed: int = 0,
    source: str = "",
) -> Trace:
    """`num_requests` requests with prompts cut from `text_ids` (seeded: the same trace every time)."""
    (low, high), (out_low, out_high) = prompt_range, output_range
    if not 0 < low <= high or not 0 < out_low <= out_high:
        raise ValueError(f"bad ranges: prompts {prompt_range}, outputs {output_range} (need 0 < low <= high)")
    if num_requests < 1 or not text_ids:
        raise ValueError("need at least one request and some text")
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        length = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        start = rng.randrange(len(text_ids))
        prompt = tuple(itertools.islice(itertools.cycle(text_ids[start:] + text_ids[:start]), length))
        gap = 0.0 if index == 0 else rng.expovariate(1.0)
        requests.append(TraceRequest(index, gap, prompt, rng.randint(out_low, out_high)))
    return Trace(tuple(requests), source, seed)


def essay_token_ids() -> tuple[list[int], str]:
    """The Paul Graham essays through the default model's tokenizer, and a label saying so."""
    from sparseserve_hf.haystack import load_essays
    from sparseserve_hf.models import load_default

    _, tokenizer = load_default()
    ids = tokenizer(load_essays(), add_special_tokens=False).input_ids
    return ids, f"Paul Graham essays, SmolLM2 tokenizer ({len(ids)} tokens)"
