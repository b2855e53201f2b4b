#!/usr/bin/env bash
# The HTTP layer's overhead: one synthetic trace through the OpenAI-compatible server (http_load) and
# through the same engine in-process, on a random-weight Llama-3-8B-shaped model; one GPU call.
#
#   bash eval/h200_http.sh OUT           # 8B shape, bf16 on CUDA: OUT/http_load_h200.json, OUT/in_process_h200.json,
#                                        # OUT/http_overhead.{md,json}, OUT/server.log
#   TINY=1 bash eval/h200_http.sh OUT    # the tiny shape on CPU, a short trace (OUT/*_cpu.json): the same steps
#
# Steps: build the model folder (random weights and a word tokenizer, skipped when MODEL_DIR already
# holds one); the serve options of eval.serving's "ours" system under its HBM cap (the block cache and
# the pool sized as there; neither run sets the per-process memory cap); the server in the
# background until GET /health answers 200; http_load (WARMUP requests first, not measured); SIGTERM,
# the server must exit 0; then the same trace, warm-up and options in-process (after the server, so
# the two never share the GPU); the comparison. The server needs fastapi, uvicorn and pydantic: on
# the GPU machine, run this after `source /tmp/gpu-site/env.sh` (a bundle of the default model and wheels built on a machine with the registry).
# Knobs (environment): SHAPE DEVICE DTYPE REQUESTS PROMPT_TOKENS OUTPUT_TOKENS RATE WARMUP MAX_POSITIONS
# HBM_CAP_GIB HEADROOM_GIB DRAM_GIB MAX_BATCH MODEL_DIR STARTUP_S TAG PYTHON. Carry .gpu_commit so the
# JSON records the local HEAD.
set -euo pipefail
out=${1:?out dir}
mkdir -p "$out"
if [[ ${TINY:-0} == 1 ]]; then
  : "${SHAPE:=tiny}" "${DEVICE:=cpu}" "${DTYPE:=float32}" "${REQUESTS:=8}" "${PROMPT_TOKENS:=64}"
  : "${OUTPUT_TOKENS:=16}" "${RATE:=4}" "${WARMUP:=2}" "${MAX_POSITIONS:=4096}" "${HBM_CAP_GIB:=0.5}"
  : "${HEADROOM_GIB:=0.125}" "${DRAM_GIB:=0.125}" "${TAG:=cpu}"
fi
: "${SHAPE:=llama3-8b}" "${DEVICE:=cuda}" "${DTYPE:=bfloat16}" "${REQUESTS:=32}" "${PROMPT_TOKENS:=8192}"
: "${OUTPUT_TOKENS:=64}" "${RATE:=1}" "${WARMUP:=6}" "${MAX_POSITIONS:=40960}" "${HBM_CAP_GIB:=40}"
: "${HEADROOM_GIB:=8}" "${DRAM_GIB:=48}" "${MAX_BATCH:=16}" "${STARTUP_S:=600}" "${TAG:=h200}"
model=${MODEL_DIR:-/tmp/sparseserve_http_$SHAPE}
python=${PYTHON:-python3}
export PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # as eval.serving's ours
[[ -f .gpu_commit ]] && export SPARSESERVE_COMMIT=$(<.gpu_commit)
start=$SECONDS
log() { echo "[$((SECONDS - start)) s] $*"; }

if [[ ! -f $model/tokenizer.json ]]; then  # build writes the tokenizer last
  "$python" -m eval.serving.http_overhead build "$model" --shape "$SHAPE" --device "$DEVICE" --dtype "$DTYPE" \
    --max-positions "$MAX_POSITIONS" 2>&1 | grep -v "Writing model shards" || true
  [[ -f $model/tokenizer.json ]] || { echo "building $model failed" >&2; exit 1; }
fi
options=$("$python" -m eval.serving.http_overhead serve-flags "$model" --dtype "$DTYPE" --hbm-cap-gib "$HBM_CAP_GIB" \
  --headroom-gib "$HEADROOM_GIB" --dram-gib "$DRAM_GIB" --max-batch "$MAX_BATCH")
read -r -a flags <<< "$options"
serve=("$model" --dtype "$DTYPE" --device "$DEVICE" "${flags[@]}")
vocab=$("$python" -c "import json, sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$model/config.json")
load=(--synthetic "$REQUESTS" --prompt-tokens "$PROMPT_TOKENS" --output-tokens "$OUTPUT_TOKENS" --vocab "$vocab"
      --rate "$RATE" --warmup "$WARMUP")
log "model $model ($SHAPE, vocab $vocab); serve options: ${serve[*]:1}"

port=$("$python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
url=http://127.0.0.1:$port
"$python" -m sparseserve_hf.serve "${serve[@]}" --port "$port" --log-level warning > "$out/server.log" 2>&1 &
server=$!
trap 'kill -KILL "$server" 2>/dev/null || true' EXIT  # should the script stop before the server does

healthy() {  # GET /health answers 200
  "$python" -c "import httpx, sys; sys.exit(httpx.get(sys.argv[1] + '/health', timeout=2).status_code != 200)" \
    "$url" 2>/dev/null
}
launched=$SECONDS
until healthy; do
  if ! kill -0 "$server" 2>/dev/null || ((SECONDS - launched > STARTUP_S)); then
    echo "the server did not become healthy within $STARTUP_S s; the end of $out/server.log:" >&2
    tail -n 40 "$out/server.log" >&2
    exit 1
  fi
  sleep 2
done
log "server healthy at $url"

"$python" -m eval.serving.http_load --url "$url" "${load[@]}" --out "$out/http_load_$TAG.json" > "$out/http_load.log" 2>&1 \
  || { echo "http_load failed; its log, then the end of the server's:" >&2; cat "$out/http_load.log" >&2
       tail -n 40 "$out/server.log" >&2; exit 1; }
log "http_load done: $out/http_load_$TAG.json"

kill -TERM "$server"
for ((waited = 0; waited < 120; waited++)); do kill -0 "$server" 2>/dev/null && sleep 1 || break; done
kill -0 "$server" 2>/dev/null && { echo "the server did not exit within 120 s of SIGTERM: killed" >&2; kill -KILL "$server"; }
server_rc=0
wait "$server" || server_rc=$?
trap - EXIT
log "server stopped: exit status $server_rc"

"$python" -m eval.serving.http_overhead in-process "${serve[@]}" "${load[@]}" --out "$out/in_process_$TAG.json" \
  > "$out/in_process.log" 2>&1 || { echo "the in-process run failed:" >&2; tail -n 40 "$out/in_process.log" >&2; exit 1; }
log "in-process done: $out/in_process_$TAG.json"

"$python" -m eval.serving.http_overhead compare "$out/http_load_$TAG.json" "$out/in_process_$TAG.json" --out "$out"
log "done; the server exited with $server_rc"
[[ $server_rc == 0 ]]
