#!/usr/bin/env bash
# The serving sweep in parts that each fit one 10-minute GPU call; merge them with `report`.
#
#   python -m eval.serving trace --out .gpu/serving_trace.pt         # once, on the CPU machine (real text + tokenizer)
#   bash eval/h200_serving.sh calibrate OUT TRACE                     # the dense decode iteration (SLO unit)
#   bash eval/h200_serving.sh run OUT TRACE SYSTEM RATE [RATE ...]    # one process: SYSTEM at each rate in turn
#   bash eval/h200_serving.sh sweep OUT TRACE SYSTEM:R1,R2 [SYSTEM:R1 ...]
#                                                                     # the jobs spread over every visible GPU,
#                                                                     # one queue per GPU, jobs dealt in turn
#   bash eval/h200_serving.sh probe OUT TRACE ROWS CACHE [CACHE ...]  # stock's step at ROWS of the trace's
#                                                                     # prompts: first call, warm, uncapped
#   python -m eval.serving report OUT1 OUT2 ... --out eval/results    # serving.json / .md / .png
#
# Carry the trace (git-ignored) with the call: carry [".gpu/serving_trace.pt", ".gpu_commit"]. Run from
# the repo root; EXTRA_ARGS (e.g. "--requests 20 --deadline-s 200") goes to every run; PYTHON picks
# the interpreter (default: python). Each job's progress and errors are in OUT/<system>.log; on a
# machine with two GPUs a sweep runs two jobs at once.
set -euo pipefail
part=${1:?part}
out=${2:?out dir}
trace=${3:?trace file}
shift 3
mkdir -p "$out"
export PYTHONPATH=src:. PYTHONUNBUFFERED=1
[[ -f .gpu_commit ]] && export SPARSESERVE_COMMIT=$(<.gpu_commit)
read -r -a extra <<< "${EXTRA_ARGS:-}"
python=${PYTHON:-python}  # the interpreter with torch (tests pass their own)

run_job() {  # SYSTEM RATES...: one process, its log in OUT/SYSTEM.log, one line of verdict
  local system=$1 start=$SECONDS rc=0
  shift
  "$python" -m eval.serving run --system "$system" --rate "$@" --trace "$trace" --out "$out" "${extra[@]}" \
    > "$out/$system.log" 2>&1 || rc=$?
  echo "$system at $* req/s: rc=$rc in $((SECONDS - start)) s (GPU ${CUDA_VISIBLE_DEVICES:-all})"
}

case $part in
  calibrate)
    "$python" -m eval.serving calibrate --trace "$trace" --out "$out" "${extra[@]}" 2>&1 | tail -1 ;;
  run)
    run_job "$@" ;;
  probe)
    rows=${1:?rows}
    shift
    for cache in "$@"; do
      "$python" -m eval.serving probe-stock --trace "$trace" --out "$out" --rows "$rows" --cache "$cache" "${extra[@]}" \
        > "$out/probe_$cache.log" 2>&1 && tail -4 "$out/probe_$cache.log" || echo "probe $cache: rc=$? (see $out/probe_$cache.log)"
    done ;;
  sweep)
    gpus=$("$python" -c "import torch; print(max(1, torch.cuda.device_count()))")
    jobs=("$@")
    for ((gpu = 0; gpu < gpus; gpu++)); do
      (for ((j = gpu; j < ${#jobs[@]}; j += gpus)); do
         job=${jobs[j]} rates=${jobs[j]#*:}
         CUDA_VISIBLE_DEVICES=$gpu run_job "${job%%:*}" ${rates//,/ }
       done) &
    done
    wait ;;
  *) echo "unknown part '$part' (calibrate, run, probe, sweep)" >&2; exit 2 ;;
esac
