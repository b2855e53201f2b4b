#!/usr/bin/env bash
# The serving sweep (issue 6) in parts that each fit one 10-minute GPU call; merge them with `report`.
#
#   python -m eval.serving trace --out .gpu/serving_trace.pt      # once, on the CPU machine (real text + tokenizer)
#   bash eval/h200_serving.sh calibrate OUT TRACE                  # the dense decode iteration (SLO unit)
#   bash eval/h200_serving.sh run OUT TRACE SYSTEM RATE [RATE ...] # one process per (system, rate)
#   python -m eval.serving report OUT1 OUT2 ... --out eval/results # serving.json / .md / .png
#
# Carry the trace (git-ignored) with the call: carry [".gpu/serving_trace.pt"]. Run from the repo
# root with PYTHONPATH=src:. ; EXTRA_ARGS (e.g. "--requests 20 --hbm-cap-gib 40") goes to every run.
set -euo pipefail
part=${1:?part}
out=${2:?out dir}
trace=${3:?trace file}
shift 3
mkdir -p "$out"
[[ -f .gpu_commit ]] && export SPARSESERVE_COMMIT=$(<.gpu_commit)
read -r -a extra <<< "${EXTRA_ARGS:-}"
case $part in
  calibrate)
    python -m eval.serving calibrate --trace "$trace" --out "$out" "${extra[@]}" 2>&1 | tail -3 ;;
  run)
    system=${1:?system}
    shift
    for rate in "$@"; do
      python -m eval.serving run --system "$system" --rate "$rate" --trace "$trace" --out "$out" "${extra[@]}" \
        2>&1 | tee "$out/run_${system}_${rate}.log" | grep -E '"(system|rate|completed|failed|throughput_tokens_per_s|mean_ttft_s|p50_tbt_s|mean_queueing_s)"'
    done ;;
  *) echo "unknown part '$part' (calibrate, run)" >&2; exit 2 ;;
esac
