#!/usr/bin/env bash
# Usage: examples/serve_benchmark.sh [OUT_DIR]        (SMALL=1 examples/serve_benchmark.sh [OUT_DIR] on a CPU)
#
# The serving sweep end to end, through eval/h200_serving.sh and `python -m eval.serving`:
#   1. build the trace if TRACE does not exist yet,
#   2. calibrate: time one dense decode iteration (the SLO unit),
#   3. sweep: every system in SYSTEMS at every rate in RATES (one queue per visible GPU),
#   4. report: OUT_DIR/serving.json, serving.md and serving.png; the runs' JSON and logs in OUT_DIR/runs.
#
# Default: the H200 setup. A random-weight Llama-3-8B-shaped model under a 40 GiB HBM cap, the
# 40-request trace of 8K-64K-token prompts (its first 20 requests), each run cut at 240 s: up to
# 9 systems x 3 rates x 4 min on one GPU, spread over every visible GPU (CUDA_VISIBLE_DEVICES picks).
# SMALL=1: the same steps on a CPU in about a minute. A tiny random-weight model (vocabulary 256)
# under tiny memory caps, and a 3-request trace of short prompts built from token ids 10-249
# (the real trace holds SmolLM2 token ids, past the tiny model's vocabulary).
#
# Environment (each has a default per mode):
#   TRACE       the trace file            (.gpu/serving_trace.pt | OUT_DIR/tiny_trace.pt)
#   SYSTEMS     space-separated systems   (all of eval.serving.setup.SYSTEMS | "stock_generate ours")
#   RATES       comma-separated req/s     (0.1,0.15,0.225 | 10,20)
#   EXTRA_ARGS  more flags for every calibrate and run ("--requests 20 --deadline-s 240" | "")
#   PYTHON      the interpreter with torch (python)
set -euo pipefail

caller=$PWD
cd "$(dirname "$0")/.."  # eval/ imports from the repository root
absolute() { [[ $1 == /* ]] && echo "$1" || echo "$caller/$1"; }
python=${PYTHON:-python}
export PYTHON=$python PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}"

if [[ ${SMALL:-0} == 1 ]]; then
  out=$(absolute "${1:-eval/results/serving_small}")
  trace=$(absolute "${TRACE:-$out/tiny_trace.pt}")
  systems=${SYSTEMS:-stock_generate ours}
  rates=${RATES:-10,20}
  # The caps of tests/eval/test_serving_run.py: they leave the tiny model room for a few requests.
  shape_args="--shape tiny --hbm-cap-gib 0.25 --headroom-gib 0.05 --dram-gib 0.05"
  extra=${EXTRA_ARGS:-}
else
  out=$(absolute "${1:-eval/results/serving_sweep}")
  trace=$(absolute "${TRACE:-.gpu/serving_trace.pt}")
  systems=${SYSTEMS:-$("$python" -c "from eval.serving.setup import SYSTEMS; print(*SYSTEMS)")}
  rates=${RATES:-0.1,0.15,0.225}
  shape_args="--shape llama3-8b --hbm-cap-gib 40 --headroom-gib 8"
  extra=${EXTRA_ARGS---requests 20 --deadline-s 240}
fi
export EXTRA_ARGS="$shape_args $extra"  # h200_serving.sh hands these to every calibrate and run
mkdir -p "$out/runs" "$(dirname "$trace")"

echo "[1/4] trace: $trace"
if [[ ! -f $trace ]]; then
  if [[ ${SMALL:-0} == 1 ]]; then
    "$python" -c "
import sys
from eval.serving.trace import build_trace
trace = build_trace(list(range(10, 250)), num_requests=3, prompt_range=(40, 90), output_range=(3, 5), seed=0,
                    source='token ids 10-249 (tiny CPU trace)')
trace.save(sys.argv[1])" "$trace"
  else
    "$python" -m eval.serving trace --out "$trace" > "$out/trace_summary.json"
  fi
fi

echo "[2/4] calibrate ($shape_args)"
bash eval/h200_serving.sh calibrate "$out/runs" "$trace"

jobs=()
for system in $systems; do jobs+=("$system:$rates"); done
echo "[3/4] sweep: ${jobs[*]} (logs: $out/runs/<system>.log)"
verdicts=$(bash eval/h200_serving.sh sweep "$out/runs" "$trace" "${jobs[@]}")
echo "$verdicts"
# The sweep runs every job even when one fails, and says so per job; a failed job fails this script
# after the report, so the runs that did finish still get compared.
failed=$(grep -v "rc=0 " <<< "$verdicts" || true)

echo "[4/4] report: $out/serving.{json,md,png}"
"$python" -m eval.serving report "$out/runs" --out "$out"
if [[ -n $failed ]]; then
  echo "failed jobs (see their logs in $out/runs):" >&2
  echo "$failed" >&2
  exit 1
fi
