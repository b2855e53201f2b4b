"""Many questions over one long document: prefix caching in the Generator against prefilling each copy.

    python -m eval.bench.longdoc --out eval/results/longdoc.json     # H200, Llama-3-8B shape
    python -m eval.bench.longdoc --dry-run                          # tiny shapes on CPU

Llama-3-8B shape, random bf16 weights, seeded random-token document (32K tokens) and questions (64
tokens each), greedy, 16 new tokens per question, EOS ignored. The questions go to one idle
`Generator` one after another (each waits for the previous answer), twice: with
`SparseServeConfig(prefix_caching=True)` and without. Both engines first answer one question over
another document of the same length (a warm-up of every shape, outside the results).

Reported: each question's TTFT (submit to first token); `prefix_ttft_ratio`, the mean TTFT of
questions 2-8 over question 1's with prefix caching; the DRAM bytes in use after the last
question with prefix caching over 8 unshared copies of the document's blocks
(`prefix_dram_ratio`); and whether both runs gave the same tokens (`prefix_tokens_equal`).
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
    run_record,
    sync,
    write_json,
)
from eval.bench.decode_step_setup import build_model
from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.generation.sizing import EngineSizes

SIZES = {"document": 32768, "question": 64, "questions": 8, "new_tokens": 16}
DRY_SIZES = {"document": 150, "question": 8, "questions": 4, "new_tokens": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (tests the script)")
    return parser.parse_args(argv)


def ask_in_turn(model, config: SparseServeConfig, sizes: dict[str, int], vocab: int, device) -> dict[str, Any]:
    """A warm-up question over another document, then every question over the document, one at a time."""
    gen = Generator(model, None, config)
    params = SamplingParams(max_new_tokens=sizes["new_tokens"], ignore_eos=True)
    warm_document, document, *questions = _texts(sizes, vocab)
    gen.generate([warm_document + questions[0]], params)
    if gen.prefixes is not None:
        gen.prefixes.index.clear()  # the warm-up's document must not count in the DRAM figure
    ttft, tokens = [], []
    for question in questions:
        sync(device)
        start = time.perf_counter()
        request = gen.submit(document + question, params)
        first = None
        while gen.has_unfinished:
            for event in gen.step():
                if event.request_id == request and first is None and event.token_id is not None:
                    sync(device)
                    first = time.perf_counter() - start
                if event.finished:
                    tokens.append(list(event.output.token_ids))
        ttft.append(first)
    row = {"ttft_s": ttft, "dram_bytes_after": gen.dram_bytes_in_use(), "tokens": tokens,
           "totals": {k: v for k, v in gen.metrics()["totals"].items() if k.startswith("prefix_")},
           "config": config.to_dict()}  # fmt: skip
    del gen
    free_memory(device)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, shape, dtype = bench_setup(args.dry_run)
    sizes = DRY_SIZES if args.dry_run else SIZES
    model = build_model(shape, "sparseserve", device, dtype, sizes["document"] + sizes["question"] + 1024)
    text = model.config
    budget = {"block_size": 16, "token_budget": 64} if args.dry_run else {}
    base = SparseServeConfig(max_batch=1, **budget)
    shared = ask_in_turn(model, SparseServeConfig(**(base.to_dict() | {"prefix_caching": True})), sizes,
                         text.vocab_size, device)  # fmt: skip
    plain = ask_in_turn(model, base, sizes, text.vocab_size, device)
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
    }
    rows = [{"system": name} | {f"q{i + 1}_ttft_s": t for i, t in enumerate(result[name]["ttft_s"][:3])}
            for name in ("prefix_caching", "no_prefix_caching")]  # fmt: skip
    print_table(rows, ["system", "q1_ttft_s", "q2_ttft_s", "q3_ttft_s"])
    print({k: result[k] for k in ("prefix_ttft_ratio", "prefix_dram_ratio", "prefix_tokens_equal")})
    write_json(args.out, result)
    return result


def _texts(sizes: dict[str, int], vocab: int) -> list[list[int]]:
    """Seeded random token ids: a warm-up document, the document, then the questions."""
    gen = torch.Generator().manual_seed(3)
    lengths = [sizes["document"], sizes["document"]] + [sizes["question"]] * sizes["questions"]
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


if __name__ == "__main__":
    main()
