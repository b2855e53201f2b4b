"""Many questions over one long document: prefix caching in the Generator against prefilling each copy.

    python -m eval.bench.longdoc --out eval/results/longdoc.json     # H200, Llama-3-8B shape
    python -m eval.bench.longdoc --dry-run                          # tiny shapes on CPU

Llama-3-8B shape, random bf16 weights, seeded random-token document (32K tokens) and questions (64
tokens each), greedy, 16 new tokens per question, EOS ignored. The questions go to one idle
`Generator` one after another (each waits for the previous answer), twice: with
`SparseServeConfig(prefix_caching=True)` and without. Both engines first answer two questions over
another document of the same length (a warm-up of every shape, the prefill over a reused prefix
included, outside the results).

Reported: each question's TTFT (submit to first token); `prefix_ttft_ratio`, the mean TTFT of
questions 2-8 over question 1's with prefix caching; the DRAM bytes in use after the last
question with prefix caching over 8 unshared copies of the document's blocks
(`prefix_dram_ratio`); whether both runs gave the same tokens (`prefix_tokens_equal`), and, since
greedy decoding of random weights flips on bf16 rounding (a question prefilled over a reused
prefix runs other kernel shapes than one prefilled with its document), the same comparison in
float32 over a shorter document (`prefix_tokens_equal_fp32`, the `check` block, selecting from block
summaries of the keys alone: channel scores, the default, weigh a block's channels by the prompt that
wrote it, so a shared prefix may lead to other picks than a request's own copy) and where the bf16
runs first part (`first_difference`, per question: the index of the first differing token).

`--profile PATH` also writes the profile of one later question's TTFT with prefix caching (submit
to first token: the kernels and host operations that take it), as markdown, and its timeline as
`PATH.trace.json`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from eval.bench.common import (
    bench_setup,
    free_memory,
    print_table,
    profiled_region,
    run_record,
    sync,
    write_json,
    write_profile,
)
from eval.bench.decode_step_setup import build_model
from eval.common import HYBRID_UNION
from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.generation.sizing import EngineSizes

SIZES = {"document": 32768, "question": 64, "questions": 8, "new_tokens": 16}
CHECK_SIZES = {"document": 4096, "question": 64, "questions": 4, "new_tokens": 16}
DRY_SIZES = {"document": 150, "question": 8, "questions": 4, "new_tokens": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument("--profile", default=None, help="markdown path: profile of one later question's prefill")
    parser.add_argument("--skip-check", action="store_true", help="skip the float32 token comparison")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (tests the script)")
    return parser.parse_args(argv)


def ask_in_turn(
    model, config: SparseServeConfig, sizes: dict[str, int], vocab: int, device, profile: str | None = None
) -> dict[str, Any]:
    """A warm-up of two questions over another document, then every question over the document, one at a time."""
    gen = Generator(model, None, config)
    params = SamplingParams(max_new_tokens=sizes["new_tokens"], ignore_eos=True)
    warm_document, document, *questions = _texts(sizes, vocab)
    gen.generate([warm_document + questions[0]], params)
    gen.generate([warm_document + questions[1]], params)
    if gen.prefixes is not None:
        gen.prefixes.index.clear()  # the warm-up's document must not count in the DRAM figure
    ttft, tokens = [], []
    for number, question in enumerate(questions):
        profiled = profile is not None and number == 2
        with profiled_region(profiled) as profiler:
            request, first, events = _first_token(gen, document + question, params, device)
        if profiled:
            write_profile(profiler, profile, "One later question's TTFT with prefix caching, profiled")
            profiler.export_chrome_trace(f"{profile}.trace.json")  # the timeline, for chrome://tracing
        ttft.append(first)
        tokens.append(_finish(gen, request, events))
    row = {"ttft_s": ttft, "dram_bytes_after": gen.dram_bytes_in_use(), "tokens": tokens,
           "totals": {k: v for k, v in gen.metrics()["totals"].items() if k.startswith("prefix_")},
           "config": config.to_dict()}  # fmt: skip
    del gen
    free_memory(device)
    return row


def _first_token(gen: Generator, prompt: list[int], params: SamplingParams, device) -> tuple[int, float, list]:
    """Submit one request to an idle Generator and step until its first token: (request id, TTFT
    in s, the events so far)."""
    sync(device)
    start = time.perf_counter()
    request = gen.submit(prompt, params)
    events = []
    while not any(e.request_id == request and e.token_id is not None for e in events):
        events += gen.step()
    sync(device)
    return request, time.perf_counter() - start, events


def _finish(gen: Generator, request: int, events: list) -> list[int]:
    """Step until the request ends; its output tokens."""
    while not any(e.request_id == request and e.finished for e in events):
        events += gen.step()
    return list(next(e for e in events if e.request_id == request and e.finished).output.token_ids)


def compare_runs(model, base: SparseServeConfig, sizes: dict[str, int], vocab: int, device, profile=None):
    """The prefix-caching run and the unshared run of one workload: (shared, plain)."""
    shared_config = SparseServeConfig(**(base.to_dict() | {"prefix_caching": True}))
    shared = ask_in_turn(model, shared_config, sizes, vocab, device, profile)
    return shared, ask_in_turn(model, base, sizes, vocab, device)


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    """Per question, the index of the first token where the two runs differ (None: equal)."""
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None if len(p) == len(q) else min(len(p), len(q)))
            for p, q in zip(a, b)]  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, shape, dtype = bench_setup(args.dry_run)
    sizes = DRY_SIZES if args.dry_run else SIZES
    model = build_model(shape, "sparseserve", device, dtype, sizes["document"] + sizes["question"] + 1024)
    text = model.config
    budget = {"block_size": 16, "token_budget": 64} if args.dry_run else {}
    base = SparseServeConfig(max_batch=1, **budget)
    shared, plain = compare_runs(model, base, sizes, text.vocab_size, device, args.profile)
    block_bytes = EngineSizes(text, base, dtype).block_bytes
    doc_blocks = sizes["document"] // base.block_size * text.num_hidden_layers * text.num_key_value_heads
    later = shared["ttft_s"][1:]
    result = run_record(device) | {
        "shape": shape,
        "dtype": str(dtype),
        "workload": sizes,
        "prefix_caching": shared,
        "no_prefix_caching": plain,
        "prefix_ttft_ratio": sum(later) / len(later) / shared["ttft_s"][0],
        "prefix_ttft_vs_unshared": sum(later) / sum(plain["ttft_s"][1:]),
        "prefix_dram_ratio": shared["dram_bytes_after"] / (sizes["questions"] * doc_blocks * block_bytes),
        "prefix_tokens_equal": shared["tokens"] == plain["tokens"],
        "first_difference": first_difference(shared["tokens"], plain["tokens"]),
    }
    if not args.skip_check:
        result |= float32_check(model, base, DRY_SIZES if args.dry_run else CHECK_SIZES, device)
    rows = [{"system": name} | {f"q{i + 1}_ttft_s": t for i, t in enumerate(result[name]["ttft_s"][:3])}
            for name in ("prefix_caching", "no_prefix_caching")]  # fmt: skip
    print_table(rows, ["system", "q1_ttft_s", "q2_ttft_s", "q3_ttft_s"])
    keys = (
        "prefix_ttft_ratio",
        "prefix_dram_ratio",
        "prefix_tokens_equal",
        "first_difference",
        "prefix_tokens_equal_fp32",
    )
    print({k: result.get(k) for k in keys})
    write_json(args.out, result)
    return result


# The float32 check's selector: block summaries that depend on the keys alone. Channel scores (the
# default) weigh each block's channels by the queries of the prompt that wrote it, so a request reading a
# shared prefix may pick other blocks than with its own copy: its tokens need not be equal.
KEYS_ONLY = HYBRID_UNION


def float32_check(model, base: SparseServeConfig, sizes: dict[str, int], device) -> dict[str, Any]:
    """The token comparison again with the model in float32 over a shorter document, selecting from block
    summaries of the keys alone (`KEYS_ONLY`): whether prefix caching hands a request exactly its blocks."""
    dtype = model.dtype
    model.float()
    try:
        keys_only = SparseServeConfig(**(base.to_dict() | KEYS_ONLY))
        shared, plain = compare_runs(model, keys_only, sizes, model.config.vocab_size, device)
    finally:
        model.to(dtype)
    return {
        "prefix_tokens_equal_fp32": shared["tokens"] == plain["tokens"],
        "check": {
            "dtype": "torch.float32",
            "selector": KEYS_ONLY,
            "workload": sizes,
            "first_difference": first_difference(shared["tokens"], plain["tokens"]),
        },
    }


def _texts(sizes: dict[str, int], vocab: int) -> list[list[int]]:
    """Seeded random token ids: a warm-up document, the document, then the questions."""
    gen = torch.Generator().manual_seed(3)
    lengths = [sizes["document"], sizes["document"]] + [sizes["question"]] * sizes["questions"]
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


if __name__ == "__main__":
    main()
