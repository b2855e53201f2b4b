"""The serving trace against an OpenAI-compatible URL: Poisson arrivals, per-request TTFT and TBT.

    python -m eval.serving.http_load --url http://127.0.0.1:8000 --trace T.pt --rate 0.5 --out run.json
    python -m eval.serving.http_load --url URL --synthetic 32 --prompt-tokens 64 --output-tokens 16 --rate 8

Each request of the trace (`eval.serving.trace`) is sent at its arrival time as a streamed
`/v1/completions` call with its prompt token ids, `max_tokens` = its output length, greedy and
`ignore_eos` (so it generates exactly that many tokens); the server sends one chunk per token,
so the chunks' arrival times are the request's token times as the client sees them. The records
are `eval.serving.metrics.RequestRecord`s, summarized by the same `summarize` as in-process runs
(queueing delay is not visible from the client: None). `--synthetic N` makes a seeded trace of N
requests with random ids below `--vocab`, for a server on any model. `--warmup K` first serves
K requests of the trace's own (all at once, not measured: kernel compilation and graph capture
are not serving); their summary is kept apart under "warmup".
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from eval.serving.metrics import RequestRecord, summarize
from eval.serving.trace import Trace, TraceRequest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the server's root, e.g. http://127.0.0.1:8000")
    add_trace_arguments(parser)
    parser.add_argument("--model", default=None, help="the served model name (default: the server's only one)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take")
    parser.add_argument("--out", default=None, help="JSON with the summary and every record")
    return parser.parse_args(argv)


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The requests and their arrivals: a trace file or a synthetic trace, the rate, the warm-up."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="a trace file (python -m eval.serving trace)")
    source.add_argument("--synthetic", type=int, help="this many seeded random requests instead")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="--synthetic: prompt length")
    parser.add_argument("--output-tokens", type=int, default=16, help="--synthetic: tokens per request")
    parser.add_argument("--vocab", type=int, default=256, help="--synthetic: ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, required=True, help="requests per second (Poisson)")
    parser.add_argument("--warmup", type=int, default=0, help="first serve this many of the trace's requests at once")


def load_trace(args: argparse.Namespace) -> Trace:
    """The trace `add_trace_arguments`' options name."""
    if args.trace:
        return Trace.load(args.trace)
    return synthetic_trace(args.synthetic, args.prompt_tokens, args.output_tokens, args.vocab, args.seed)


def warmup_trace(trace: Trace, count: int) -> Trace:
    """The trace's first `count` requests (indices -1, -2, ...), all arriving at time zero."""
    requests = tuple(replace(r, index=-1 - i, gap=0.0) for i, r in enumerate(trace.requests[:count]))
    return replace(trace, requests=requests, source=f"warm-up: the first {len(requests)} of {trace.source}")


def synthetic_trace(count: int, prompt_tokens: int, output_tokens: int, vocab: int, seed: int) -> Trace:
    """`count` requests of random ids in [2, vocab), Exp(1) gaps, all of one shape."""
    rng = random.Random(seed)
    requests = tuple(
        TraceRequest(
            index=i,
            gap=0.0 if i == 0 else rng.expovariate(1.0),
            prompt=tuple(rng.randrange(2, vocab) for _ in range(prompt_tokens)),
            output_tokens=output_tokens,
        )
        for i in range(count)
    )
    return Trace(requests, source=f"synthetic: {count} x {prompt_tokens} ids below {vocab}", seed=seed)


async def run_load(
    url: str, trace: Trace, rate: float, model: str | None = None, api_key: str | None = None, timeout: float = 3600.0
) -> list[RequestRecord]:
    """Send every request at its arrival time (seconds from the start); returns one record each."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as http:
        if model is None:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        records = [
            RequestRecord(arrival=a, prompt_tokens=len(r.prompt), index=r.index, output_tokens=r.output_tokens)
            for r, a in zip(trace.requests, trace.arrivals(rate))
        ]
        await asyncio.gather(*(_one(http, model, r, rec, start) for r, rec in zip(trace.requests, records)))
    return records


async def _one(http: httpx.AsyncClient, model: str, request: TraceRequest, record: RequestRecord, start: float) -> None:
    await asyncio.sleep(max(record.arrival - (time.perf_counter() - start), 0.0))
    body = {"model": model, "prompt": list(request.prompt), "max_tokens": request.output_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    try:
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                record.error = f"HTTP {reply.status_code}: {(await reply.aread()).decode()[:300]}"
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    return
                choice = chunk["choices"][0] if chunk["choices"] else None
                if choice is not None and choice["finish_reason"] is None:
                    record.token_times.append(time.perf_counter() - start)
                elif choice is not None:
                    record.finish, record.finish_reason = time.perf_counter() - start, choice["finish_reason"]
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    trace = load_trace(args)
    load = functools.partial(run_load, args.url, model=args.model, api_key=args.api_key, timeout=args.timeout)
    warmup = summarize(asyncio.run(load(warmup_trace(trace, args.warmup), 1.0))) if args.warmup > 0 else None
    records = asyncio.run(load(trace, args.rate))
    summary = summarize(records)
    result = {"url": args.url, "rate": args.rate, "trace": trace.summary(), "summary": summary, "warmup": warmup,
              "records": [r.as_dict() for r in records]}  # fmt: skip
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
