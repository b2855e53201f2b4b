#!/usr/bin/env bash
# Usage: examples/longbench_eval.sh --data-dir DIR [MORE eval.accuracy.longbench ARGS...]
#
# LongBench v1 on the default model (SmolLM2-135M-Instruct): dense attention vs SparseServeCache at
# token budget 2048, through the project's runner (`python -m eval.accuracy.longbench --help` lists every flag).
# DIR holds <task>.jsonl files in the LongBench format (THUDM/LongBench's data/ folder); without
# --data-dir the runner reads the Hub dataset, which needs network access. Run from anywhere.
#
# Defaults are small enough for a CPU (a few minutes); override them with environment variables:
#   TASKS=passage_retrieval_en   comma-separated tasks, or "all" (21 v1 tasks)
#   SAMPLES=2                    first N records per task ("" = every record)
#   BUDGET=2048                  SparseServeCache token budget(s), comma-separated
#   OUT=eval/results/longbench_example   results.md, summary and per-sample JSONL go here
#   PYTHON=python                the interpreter with torch and the eval extras installed
# Arguments after --data-dir DIR go to the runner as they are and win over these defaults
# (e.g. --max-new-tokens 16 for a smoke run, --device cuda, --batch-size 4).
#
#   TASKS=multi_news,hotpotqa SAMPLES=20 examples/longbench_eval.sh --data-dir ~/LongBench/data
set -euo pipefail

if [[ $# -lt 2 || $1 != --data-dir ]]; then
  sed -n '2p' "$0" >&2
  exit 2
fi
[[ -d $2 ]] || { echo "no such data folder: $2" >&2; exit 2; }
data_dir=$(cd "$2" && pwd)  # absolute: the runner runs from the repository root
shift 2
out=${OUT:-eval/results/longbench_example}
root=$(cd "$(dirname "$0")/.." && pwd)
[[ -n ${OUT:-} && $out != /* ]] && out="$PWD/$out"  # a relative OUT means from where you ran this

cd "$root"  # the runner's package, eval/, imports from the repository root
export PYTHONPATH="src:.${PYTHONPATH:+:$PYTHONPATH}"
samples=()
[[ -n ${SAMPLES-2} ]] && samples=(--max-samples "${SAMPLES-2}")

"${PYTHON:-python}" -m eval.accuracy.longbench \
  --tasks "${TASKS:-passage_retrieval_en}" \
  --budgets "${BUDGET:-2048}" \
  --data-dir "$data_dir" \
  --out "$out" \
  "${samples[@]}" \
  "$@"
