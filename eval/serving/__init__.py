"""Serving benchmark: a fixed, seeded trace of long prompts with Poisson arrivals, run
in real time through stock transformers and through sparseserve_hf's `Generator` (and its
ablation ladder) under one HBM cap; per-request TTFT, TBT and queueing delay, throughput and
goodput; a report with the paper's plots (metric vs rate).

    python -m eval.serving trace --out .gpu/serving_trace.pt           # CPU: real text, the default tokenizer
    python -m eval.serving trace --preset paper --out .gpu/paper.pt    # or decode_heavy (trace.PRESETS)
    python -m eval.serving calibrate --trace T --out DIR               # GPU: the dense decode iteration (SLO unit)
    python -m eval.serving run --system NAME --rate R [R ...] --trace T --out DIR   # R = inf: saturated
    python -m eval.serving report DIR [DIR ...] --out eval/results      # serving.json, plots, markdown
    python -m eval.serving report DIR ... --name paper                 # one trace's block of serving.json

Modules: `trace` (the requests), `setup` (systems, the HBM cap, the ladder), `common` (clock,
budget, warm-up, run results), `stock` and `ours` (the runners), `metrics` (per-request records,
SLO, goodput), `report`. `bash eval/h200_serving.sh` runs the sweep in parts that each fit one
GPU call, spread over every visible GPU.
"""
