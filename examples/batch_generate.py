"""Continuous batching with working-set admission on the real default model (SmolLM2-135M-Instruct).

Run: `python examples/batch_generate.py` (about half a minute on a 2-core CPU).

Eight chat prompts go through one `Generator`: every iteration decodes one token for each admitted
request in one batched forward and advances new prompts a layer segment at a time. The HBM block
cache is made deliberately small, so admission has to leave some requests out of some iterations
(their state stays in DRAM; they go first next time). Tokens stream as they come; metrics follow.
"""

from __future__ import annotations

import argparse
import json

from transformers.utils import logging as hf_logging

from sparseserve_hf import Generator, SamplingParams, SparseServeConfig
from sparseserve_hf.data.models import load_default

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clean Python code.",
    "Explain what a KV cache is in one paragraph.",
    "Write a haiku about autumn leaves.",
    "What is 17 times 23?",
    "Name three planets of the solar system.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]


def main() -> None:
    """Stream eight requests through the Generator and print per-request and total metrics."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--hbm-cache-mib", type=float, default=32.0, help="HBM block-cache size (M_avl)")
    parser.add_argument("--no-admission", action="store_true", help="turn working-set admission off")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    model, tokenizer = load_default(attn_implementation="sparseserve")
    config = SparseServeConfig(
        block_size=16,
        token_budget=128,
        hbm_cache_bytes=int(args.hbm_cache_mib * 2**20),
        max_batch=8,
        admission=not args.no_admission,
        prefill_mode="layer_segmented",
        max_inject_tokens=2048,  # token-layers of prefill per iteration
    )
    gen = Generator(model, tokenizer, config)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]  # the Generator never applies a chat template by itself
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    texts = [""] * len(prompts)
    for event in gen.stream(prompts, params):
        texts[event.prompt_index] += event.text or ""
        if event.finished:
            print(f"[{event.prompt_index}] ({event.output.finish_reason}) {QUESTIONS[event.prompt_index]}")
            print(f"    {texts[event.prompt_index].strip()!r}")
    metrics = gen.metrics()
    print("\nper request: ttft_s, mean tbt_s, queueing_delay_s, working_set_blocks")
    for rid, record in metrics["requests"].items():
        tbt = record["tbt_s"]
        mean_tbt = sum(tbt) / len(tbt) if tbt else 0.0
        print(
            f"  {rid}: {record['ttft_s']:.3f}  {mean_tbt:.3f}  {record['queueing_delay_s']:.3f}  "
            f"{record['working_set_blocks']}"
        )
    totals = metrics["totals"]
    keys = ("tokens_per_s", "hit_rate", "mean_decode_batch", "sat_out", "admitted_working_set_peak_bytes")
    keys += ("hbm_cache_bytes", "hbm_peak_bytes", "hbm_bytes_in_use", "dram_bytes_in_use")
    print(json.dumps({k: totals[k] for k in keys}, indent=2))


if __name__ == "__main__":
    main()
