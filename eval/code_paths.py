"""How much of the package one decode step reads: files and functions visited, counted with sys.setprofile.

    python -m eval.code_paths                      # prints the counts and the functions per file
    python -m eval.code_paths --out docs/code_paths.json

A reader who wants to follow one decode step top to bottom meets every function of the package the
step calls. This counts them for a tiny Llama on CPU (the torch reference backend), in three steps:
- `dropin`: one steady decode forward of `model(...)` over a `SparseServeCache` (as `generate`
  runs it), in the middle of a block;
- `dropin_block_boundary`: the same on the step whose token fills a block (the save path runs);
- `generator`: one `Generator.step()` with every request decoding.
Only functions defined in `sparseserve_hf` count (comprehensions and lambdas do not); transformers'
own modules are the same for every cache and are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import sparseserve_hf
from eval.bench.decode_step_setup import build_model
from sparseserve_hf import Generator, SamplingParams, SparseServeCache, SparseServeConfig
from sparseserve_hf.compat import cache_kwarg

PACKAGE = Path(sparseserve_hf.__file__).resolve().parent
BLOCK, BUDGET, PROMPT = 16, 64, 150  # a prompt past the budget: decode is sparse
# The kernels' plain-PyTorch spec, which the CPU path runs where a GPU runs the kernels: counted apart
# too, so that a reader sees how much of a step is the spec and how much the cache's own plumbing.
SPEC_FILES = ("ops/reference.py", "ops/channels.py", "ops/lru.py")


def visited(step: Callable[[], Any]) -> dict[str, list[str]]:
    """{package file: sorted qualified names of its functions} that `step()` called."""
    seen: dict[str, set[str]] = defaultdict(set)

    def record(frame, event, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        path = Path(code.co_filename)
        if code.co_name.startswith("<") or PACKAGE not in path.parents:
            return
        seen[str(path.relative_to(PACKAGE))].add(code.co_qualname)

    sys.setprofile(record)
    try:
        step()
    finally:
        sys.setprofile(None)
    return {path: sorted(names) for path, names in sorted(seen.items())}


def summary(paths: dict[str, list[str]]) -> dict[str, Any]:
    """The counts beside the functions (`spec_functions`: those of `SPEC_FILES`)."""
    spec = sum(len(names) for path, names in paths.items() if path in SPEC_FILES)
    return {"files": len(paths), "functions": sum(map(len, paths.values())), "spec_functions": spec, "paths": paths}


def dropin_steps(config: SparseServeConfig) -> dict[str, dict[str, Any]]:
    """A steady decode forward and a block-filling one, each after warm-up steps of its own kind."""
    model = build_model("tiny", "sparseserve", torch.device("cpu"), torch.float32, 1024)
    cache = SparseServeCache(model.config, config)
    tokens = torch.randint(1, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    kwargs = {cache_kwarg(model): cache, "use_cache": True, "logits_to_keep": 1}
    steps: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        model(input_ids=tokens, **kwargs)

        def forward() -> None:
            length = cache.get_seq_length()
            next_ids = torch.ones((2, 1), dtype=torch.long)
            model(input_ids=next_ids, position_ids=torch.full((2, 1), length), **kwargs)

        while (cache.get_seq_length() + 1) % BLOCK != BLOCK // 2:  # the middle of a block, steps warmed
            forward()
        steps["dropin"] = summary(visited(forward))
        while cache.get_seq_length() % BLOCK != 0:  # the tail block is full: this token starts the next
            forward()
        steps["dropin_block_boundary"] = summary(visited(forward))
    return steps


def generator_step(config: SparseServeConfig) -> dict[str, Any]:
    """One Generator iteration in steady decode (every request prefilled, a few steps in)."""
    model = build_model("tiny", "sparseserve", torch.device("cpu"), torch.float32, 1024)
    gen = Generator(model, None, config)
    prompts = torch.randint(1, model.config.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    for row in prompts.tolist():
        gen.submit(row, SamplingParams(max_new_tokens=64, ignore_eos=True))
    for _ in range(6):  # prefills, then decode steps
        gen.step()
    return summary(visited(gen.step))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="JSON path for the counts and the functions")
    args = parser.parse_args(argv)
    config = SparseServeConfig(block_size=BLOCK, token_budget=BUDGET, backend="torch")
    result = dropin_steps(config) | {"generator": generator_step(config)}
    for name, step in result.items():
        print(
            f"{name}: {step['files']} files, {step['functions']} functions ({step['spec_functions']} of them the spec)"
        )
        for path, names in step["paths"].items():
            print(f"  {path}: {', '.join(names)}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
