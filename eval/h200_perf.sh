#!/usr/bin/env bash
# The GPU fast path's checks and benchmarks, in parts that each fit one 10-minute GPU call.
#
#   bash eval/h200_perf.sh PART OUT_DIR
#
# Run from a snapshot of the repo root with PYTHONPATH=src:. (and, for the flash-attn-4 parts,
# with flash-attn-4 installed and on PYTHONPATH). Parts:
#   tests       every GPU-marked kernel / cache / graph test but the benchmark dry runs (flash-attn-4 tests skip
#               without fa4); ~5 min with a cold Triton cache
#   benchtests  the benchmark scripts' dry runs on the GPU (each a subprocess compiling its kernels anew)
#   kernels     transfer (with the save-grid sweep), decode attention (fa4 column if installed), score launch sweep
#   step        one decode step, Llama-3-8B shape, B=16, 32K: eager and CUDA graph vs dense
#   generator   the Generator (cuda_graphs=True) vs stock generate: 16 x 16K x 1024 new in closed loop, and the
#               TTFT of one 32K prompt on an idle Generator
#   capacity    the same under a 40 GiB cap: 16 x 32K x 1024 new, stock at the largest batch that fits
#   prefill     peak HBM of one 128K prefill: dense vs chunked vs layer-segmented
#   scoring     the scoring kernel's tests, its launch sweep and decode attention (after a scoring change)
#   lookup      one layer's HBM block-cache lookup: tensor spec vs the claim + install kernels
#   profile     one sparse decode layer, kernel by kernel (B=16, 32K)
#   fp8profile  the captured step's layer kernel by kernel with bf16 KV blocks, then with 8-bit ones (where the
#               8-bit step's time goes, against the bf16 step's)
#   fp8slots    the real-locality step with 8-bit KV blocks in an HBM cache of the bf16 run's slots (half its
#               bytes: the install walks a partition's slots), then with the bf16 run's bytes, then bf16 blocks
#   dropin      model.generate with a SparseServeCache vs stock generate (DynamicCache and the compiled
#               StaticCache), decode ms/step at B=4 x 32K, real locality and random KV: whole_step (a cache
#               built from the model), layer_graphs (from its config), launched; the first call of a new process
#   dropin128k  the same at B=2 x 128K (peak HBM against stock's)
#   multigpu    data parallel on every visible GPU (the nvidia-h200-x2 kind): one Generator vs a
#               GeneratorGroup, 16 x 32K x 1024 new per engine, closed loop (dp2_over_dp1)
#   tp          tensor parallel (nvidia-h200-x2): a Generator decode step at B=16 x 32K, TP=1 then TP=2
#               under torchrun (tp2_step_over_tp1, and its tokens against TP=1's)
#   beside      the lookup beside attention (config.lookup_beside_attention): its kernel and graph tests, then
#               the real-locality step with it (and stock) and without it (--set lookup_beside_attention=False)
#   attention   the sparse decode attention kernel alone at the step's shape under its launch knobs (tile, warps,
#               pipelining stages, split programs per SM), then the captured step per layer (8-layer cut) with the
#               fastest setting against the defaults, twice each
#   reorder     the lookup's eviction-order upkeep in a launch of its own beside the late misses' copy
#               (block_cache.REORDER_BESIDE, on by default): its kernel and graph tests, the captured step per
#               layer (8-layer cut) without and with it, twice each, then the real-locality step (and stock)
#   slots       the batch cache's slots (rows that stay while requests come and go): the append kernel, the
#               captured-step tests (a vacant slot riding along, the Generator's graphs against its uncaptured
#               step), then the real-locality step without stock (fits an H100: graph over floor, bookkeeping)
#   knobs       the captured step per layer (8-layer cut) under kernel launch knobs, one process each:
#               the defaults (twice), the lookup on 8 warps, one split program per SM beside the lookup
#   critical    the layer's critical path (8-layer cut, us per layer): the score kernel's stores after both
#               parts (triton_score.STORES_LAST), the miss copy on 16 and 32 programs against the default 1,024,
#               each against the default in the same call, then attention alone (the lookup first) with 2 and 4
#               split programs per SM
#   selectwarps the selection chain's launch widths: the union kernel on 2 and 8 warps, the rank interleave on 1
#               and 4 warps (captured step per layer, 8-layer cut, each against the default in the same call)
#   twolevel    the two-level selection (ops.triton_two_level, off by default): its kernel tests, then the
#               captured step per layer (8-layer cut) at B=1 x 256K and B=2 x 128K without and with it, and at
#               B=1 x 32K with 256-block chunks, and at B=16 x 32K with 256-block chunks of one warp
#   prefill256k the TTFT of one 256K prompt: stock generate(max_new_tokens=1) against an idle Generator
#   addnorm     the residual adds joined to the norms (fused_norms): the norm and graph tests, then the captured
#               step per layer (8-layer cut, B=16 x 32K) with and without them, twice each
#   dropin256k  the drop-in at B=1 x 256K, real locality (peak HBM and ms/step against stock's)
#   longdoc     8 questions over one 32K document through one Generator, with and without prefix caching
#               (TTFT of the later questions over the first's, DRAM held, tokens equal)
#   metadata    the scoring / selection kernel tests, then the real-locality step twice: the default
#               config and 8-bit metadata (metadata_dtype=float8_e4m3fn; stock static skipped there)
#   fp8kv       8-bit KV (kv_dtype=float8_e4m3fn): the decode kernel and drop-in GPU tests, then the real-locality
#               step with 8-bit blocks and with model-dtype blocks in the same call (fp8_decode_vs_bf16)
#   channels    channel scores (metadata="channels", one pick per KV head by summed estimated mass, with feedback):
#               their kernel, chain, scorer and ladder tests, their kernel alone under its launch knobs (graph
#               replays), then the real-locality step with stock and the default config, and the same step with
#               channel scores and feedback (the kernel's fastest knobs)
#   feedback    channel feedback (`channel_feedback=True`): the per-block log-sum-exp kernel tests and the feedback
#               tests, then the real-locality step with channel scores without and with it (what writing the
#               numbers costs the step); the default config's step first, with stock
#   ahead       decode_ahead (the next step launched before this one is read back): its GPU test and the graph
#               tests, then a Generator iteration's phases (16 x 16K, 25% HBM cache, real locality) without and with
#               it, alternating, twice each
#   aheadload   the same timings with load_budget=4096 (all 16 rows decode), without the tests
#   widelookup  the lookup's entry-wide programs: the lookup, decode and captured-step GPU tests, then the captured
#               step per layer (8-layer cut) with the defaults, with the partition programs' tiles at 1,024 and
#               2,048 lanes (triton_resolve.MAX_TILE) and with 512 entries per program, the defaults and 1,024
#               again; with BASE_SRC=DIR and BASE_COMMIT=SHA (another commit's src/, carried, and its hash) that
#               source's step too, twice, between them; then the real-locality step with stock
#   twolevelwide the two-level selection's kernel tests, then score + top-k + attention at B=32 x 128K (the default
#               config's rows): the default (two levels in FILLED_CHUNK pieces: the rows fill the GPU) and one
#               level (triton_two_level.MIN_TABLE=None), alternating, then 1,024- and 256-block pieces
#   twolevelstep the captured step per layer (8-layer cut, B=16 x 32K: 1,023-block tables, one level by default) with
#               two-level selection there too (triton_two_level.MIN_TABLE=1024) in 512- and 256-block pieces
#   default     the default config's decode step (channel scores): the real-locality step with stock where it
#               fits (a card of more than 100 GB; --skip-dense on an 80 GB one), then the hybrid group union in
#               the same call, without stock; then score + top-k + attention at B=32 x 128K for both
#               (decode_attention --default-only: select_and_attend_speedup_default)
#   ncu         Nsight Compute's full sections (throughput, warp stalls, occupancy, memory, instructions) of the
#               channel-score kernel at its default launch (the kernel bench, 2 launches), then of one captured
#               layer's selection kernels (score, rank interleave, union) in the step at its shape (needs the
#               Firecracker runtime, where ncu reads the counters; clocks left alone)
#   split       where the sparse attention kernel's time goes: one layer kernel by kernel (captured, 8-layer cut)
#               with the lookup beside attention (the default) and without it (the attention then runs alone
#               after the misses' copy), then the captured step per layer both ways, twice each
#   mma         the channel scores on tensor cores (the default where they fit) against the FMA kernel
#               (`--knob triton_channels.MMA=False`): the probe's and the channel tests on the GPU, both kernels
#               as graph replays (channel_kernel settings 0 and 21), then the captured step per layer (8-layer
#               cut) with each, alternating, twice each
# Each part writes its log and JSON under OUT_DIR; commit the JSON as eval/results/<name>.json.
# The GPU machine's .git is not this checkout's: write the local HEAD to .gpu_commit before the call
# (`git rev-parse HEAD > .gpu_commit`, git-ignored: carry it), so the JSON records the right commit.
set -euo pipefail

# `--knob` arguments from a benchmark JSON's list of MODULE.NAME=VALUE strings under KEY
knob_args() { python -c "import json, sys; print(' '.join('--knob ' + k for k in json.load(open(sys.argv[1]))[sys.argv[2]]))" "$1" "$2"; }
# The captured step per layer under each setting in turn ("" = the defaults), twice round: step_knobs lines in FILE
alternating() { local file=$1; shift; for run in 1 2; do for setting in "$@"; do
  python -m eval.bench.step_knobs $setting --out "$file" 2>&1 | tail -1; done; done; }
part=${1:?part}
out=${2:?out dir}
mkdir -p "$out"
[[ -f .gpu_commit ]] && export SPARSESERVE_COMMIT=$(<.gpu_commit)
case $part in
  tests)
    python -m pytest -q -rf -p no:cacheprovider --ignore tests/ops/test_bench_scripts.py tests/ops tests/cache/test_pools.py tests/test_cuda.py \
      tests/test_sync_free_decode.py tests/test_decode_graph.py tests/test_generate_graphs.py \
      tests/test_static_decoder.py tests/test_layer_graphs.py tests/cache/test_ablation_switches.py \
      2>&1 | tee "$out/gpu_pytest.log" | tail -30 ;;
  benchtests)
    python -m pytest -q -rf -p no:cacheprovider tests/ops/test_bench_scripts.py 2>&1 | tee "$out/gpu_pytest_bench.log" | tail -15 ;;
  kernels)
    python -m eval.bench.transfer --out "$out/transfer.json" 2>&1 | tee "$out/transfer.log" | tail -40
    python -m eval.bench.decode_attention --out "$out/decode_attention.json" 2>&1 | tee "$out/decode_attention.log" | tail -40
    python -m eval.bench.score_tuning --out "$out/score_tuning.json" 2>&1 | tee "$out/score_tuning.log" | tail -30 ;;
  step)
    python -m eval.bench.decode_step --graph --out "$out/decode_step.json" 2>&1 | tee "$out/decode_step.log" | tail -40 ;;
  default)
    memory=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    stock=(--no-stock-expandable --stock-windows 2)
    ((memory < 100000)) && stock=(--skip-dense)  # stock's 64 GB of KV beside the weights fits no 80 GB card
    python -m eval.bench.decode_step --graph --locality real --skip-static "${stock[@]}" --out "$out/decode_step.json" \
      2>&1 | tee "$out/decode_step.log" | tail -25
    python -m eval.bench.decode_step --graph --locality real --skip-static --skip-dense --set metadata=hybrid \
      --set selection=group_union --set group_aggregation=max --out "$out/decode_step_hybrid.json" 2>&1 \
      | tee "$out/decode_step_hybrid.log" | tail -12
    python -m eval.bench.decode_attention --default-only --contexts 131072 --batches 32 \
      --out "$out/decode_attention_default.json" 2>&1 | tee "$out/decode_attention_default.log" | tail -8 ;;
  generator)
    python -m eval.bench.generator_vs_generate --points closed_loop,prefill --out "$out/generator_vs_generate.json" 2>&1 \
      | tee "$out/generator.log" | tail -30 ;;
  capacity)
    python -m eval.bench.generator_vs_generate --points capacity --localities real_locality \
      --out "$out/generator_vs_generate.json" 2>&1 | tee "$out/capacity.log" | tail -30 ;;
  scoring)
    python -m pytest -q -p no:cacheprovider tests/ops -k "score" 2>&1 | tee "$out/gpu_pytest_score.log" | tail -5
    python -m eval.bench.score_tuning --out "$out/score_tuning.json" 2>&1 | tee "$out/score_tuning.log" | tail -30
    python -m eval.bench.decode_attention --out "$out/decode_attention.json" 2>&1 | tee "$out/decode_attention.log" | tail -20 ;;
  lookup)
    python eval/bench/lookup_cost.py 2>&1 | tee "$out/lookup_cost.txt" | tail -10 ;;
  multigpu)
    python -m eval.bench.multi_gpu --out "$out/multi_gpu.json" 2>&1 | tee "$out/multi_gpu.log" | tail -10 ;;
  tp)
    python -m eval.bench.tp_step --out "$out/tp_step.json" 2>&1 | tee "$out/tp_step.log" | tail -5
    torchrun --nproc-per-node 2 -m eval.bench.tp_step --out "$out/tp_step.json" 2>&1 | tee -a "$out/tp_step.log" | tail -5 ;;
  dropin)
    python -m eval.bench.dropin --points 32k --static --first-call --out "$out/dropin.json" 2>&1 \
      | tee "$out/dropin.log" | tail -30 ;;
  dropin128k)
    python -m eval.bench.dropin --points 128k --localities real_locality --out "$out/dropin_128k.json" 2>&1 \
      | tee "$out/dropin_128k.log" | tail -30 ;;
  profile)
    python -m eval.bench.profile_step --out "$out/profile_step.md" 2>&1 | tee "$out/profile_step.log" | tail -30 ;;
  metadata)
    python -m pytest -q -p no:cacheprovider tests/ops/test_score.py tests/ops/test_score_sub_blocks.py tests/ops/test_select.py \
      tests/ops/test_rank.py 2>&1 | tee "$out/gpu_pytest_metadata.log" | tail -5
    python -m eval.bench.decode_step --graph --locality real --out "$out/decode_step.json" 2>&1 \
      | tee "$out/decode_step.log" | tail -25
    python -m eval.bench.decode_step --graph --locality real --skip-static --set metadata_dtype=float8_e4m3fn \
      --out "$out/decode_step_fp8_metadata.json" 2>&1 | tee "$out/decode_step_fp8.log" | tail -25 ;;
  fp8profile)
    python -m eval.bench.profile_step --graph --out "$out/profile_graph_bf16_kv.md" 2>&1 | tail -45
    python -m eval.bench.profile_step --graph --set kv_dtype=float8_e4m3fn --out "$out/profile_graph_fp8_kv.md" 2>&1 | tail -45 ;;
  fp8slots)
    for args in "--set kv_dtype=float8_e4m3fn --hbm-cache-fraction 0.125" "--set kv_dtype=float8_e4m3fn" ""; do
      name=$(echo "$args" | tr -c 'a-z0-9.\n' '_')
      python -m eval.bench.decode_step --graph --locality real --skip-static --skip-dense $args \
        --out "$out/decode_step_slots${name}.json" 2>&1 | tail -6
    done ;;
  fp8kv)
    python -m pytest -q -p no:cacheprovider tests/ops/test_decode.py tests/test_cuda.py \
      tests/cache/test_fp8_kv.py 2>&1 | tee "$out/gpu_pytest_fp8kv.log" | tail -5
    python -m eval.bench.decode_step --graph --locality real --skip-static --set kv_dtype=float8_e4m3fn \
      --out "$out/decode_step_fp8_kv.json" 2>&1 | tee "$out/decode_step_fp8_kv.log" | tail -12
    python -m eval.bench.decode_step --graph --locality real --skip-static --skip-dense \
      --out "$out/decode_step_bf16_kv.json" 2>&1 | tee "$out/decode_step_bf16_kv.log" | tail -12 ;;
  beside)
    python -m pytest -q -rf -p no:cacheprovider tests/ops/test_decode.py tests/ops/test_resolve.py tests/ops/test_norm.py \
      tests/test_decode_graph.py tests/test_sync_free_decode.py tests/test_cuda.py \
      tests/test_layer_graphs.py tests/cache/test_ablation_switches.py 2>&1 | tee "$out/gpu_pytest_beside.log" | tail -8
    python -m eval.bench.decode_step --graph --locality real --skip-static --no-stock-expandable --stock-windows 2 \
      --out "$out/decode_step_beside.json" 2>&1 | tee "$out/decode_step_beside.log" | tail -14
    python -m eval.bench.decode_step --graph --locality real --skip-static --skip-dense --set lookup_beside_attention=False \
      --out "$out/decode_step_lookup_first.json" 2>&1 | tee "$out/decode_step_lookup_first.log" | tail -14 ;;
  channels)
    python -m pytest -q -rf -p no:cacheprovider tests/ops/test_channels.py tests/ops/test_triton_ladder.py \
      tests/ops/test_channel_scores.py tests/ops/test_two_level.py tests/test_scorers.py 2>&1 \
      | tee "$out/gpu_pytest_channels.log" | tail -5
    python -m eval.bench.channel_kernel --out "$out/channel_kernel.json" 2>&1 | tee "$out/channel_kernel.log" | tail -12
    fastest=$(knob_args "$out/channel_kernel.json" fastest_knobs)
    python -m eval.bench.decode_step --graph --locality real --skip-static --no-stock-expandable --stock-windows 2 \
      --out "$out/decode_step_default.json" 2>&1 | tee "$out/decode_step_default.log" | tail -14
    python -m eval.bench.decode_step --graph --locality real --skip-static --skip-dense --set metadata=channels \
      --set selection=kv_head --set group_aggregation=sum --set channel_feedback=True $fastest \
      --out "$out/decode_step_channels.json" 2>&1 | tee "$out/decode_step_channels.log" | tail -14 ;;
  feedback)
    python -m pytest -q -rf -p no:cacheprovider tests/ops/test_decode_block_lse.py tests/ops/test_decode.py \
      tests/generation/test_channel_feedback.py 2>&1 | tee "$out/gpu_pytest_feedback.log" | tail -5
    python -m eval.bench.decode_step --graph --locality real --skip-static --no-stock-expandable --stock-windows 2 \
      --out "$out/decode_step_default.json" 2>&1 | tee "$out/decode_step_default.log" | tail -14
    for feedback in False True; do
      python -m eval.bench.decode_step --graph --locality real --skip-static --skip-dense --set metadata=channels \
        --set selection=kv_head --set group_aggregation=sum --set channel_feedback=$feedback \
        --out "$out/decode_step_channels_feedback_$feedback.json" 2>&1 | tail -14
    done ;;
  attention)
    python -m eval.bench.attention_knobs --out "$out/attention_knobs.json" 2>&1 | tee "$out/attention_knobs.log" | tail -60
    best=$(knob_args "$out/attention_knobs.json" best)
    for knob in "" "$best" "" "$best"; do
      python -m eval.bench.step_knobs $knob --out "$out/step_knobs_attention.jsonl" 2>&1 | tail -1
    done ;;
  reorder)
    python -m pytest -q -rf -p no:cacheprovider tests/ops/test_resolve.py tests/test_decode_graph.py \
      tests/test_sync_free_decode.py 2>&1 | tee "$out/gpu_pytest_reorder.log" | tail -5
    for knob in "--knob cache.block_cache.REORDER_BESIDE=False" "" "--knob cache.block_cache.REORDER_BESIDE=False" ""; do
      python -m eval.bench.step_knobs $knob --out "$out/step_knobs_reorder.jsonl" 2>&1 | tail -1
    done
    python -m eval.bench.decode_step --graph --locality real --skip-static --no-stock-expandable --stock-windows 2 \
      --out "$out/decode_step_reorder.json" 2>&1 | tee "$out/decode_step_reorder.log" | tail -14 ;;
  slots)
    python -m pytest -q -rf -p no:cacheprovider tests/ops/test_small_ops.py tests/test_decode_graph.py \
      tests/test_sync_free_decode.py tests/test_generate_graphs.py 2>&1 \
      | tee "$out/gpu_pytest_slots.log" | tail -5
    python -m eval.bench.decode_step --graph --locality real --skip-static --skip-dense \
      --out "$out/decode_step_slots.json" 2>&1 | tee "$out/decode_step_slots.log" | tail -14 ;;
  widelookup)
    python -m pytest -q -rf -p no:cacheprovider tests/ops/test_resolve.py tests/ops/test_decode.py \
      tests/test_decode_graph.py tests/test_sync_free_decode.py tests/test_static_decoder.py 2>&1 \
      | tee "$out/gpu_pytest_widelookup.log" | tail -5
    for knob in "" "--knob triton_resolve.MAX_TILE=1024" "base" "--knob triton_resolve.MAX_TILE=2048" \
      "--knob triton_resolve.ENTRIES_PER_PROGRAM=512" "" "base" "--knob triton_resolve.MAX_TILE=1024"; do
      if [[ $knob == base ]]; then
        [[ -n ${BASE_SRC:-} ]] && PYTHONPATH=$BASE_SRC:. SPARSESERVE_COMMIT=${BASE_COMMIT:?} python -m eval.bench.step_knobs \
          --out "$out/step_knobs_widelookup.jsonl" 2>&1 | tail -1
      else
        python -m eval.bench.step_knobs $knob --out "$out/step_knobs_widelookup.jsonl" 2>&1 | tail -1
      fi
    done
    python -m eval.bench.decode_step --graph --locality real --skip-static --no-stock-expandable --stock-windows 2 \
      --out "$out/decode_step_widelookup.json" 2>&1 | tee "$out/decode_step_widelookup.log" | tail -14 ;;
  twolevelwide)
    python -m pytest -q -p no:cacheprovider tests/ops/test_two_level.py 2>&1 | tail -2
    run=0
    for knob in "" "--knob triton_two_level.MIN_TABLE=None" "" "--knob triton_two_level.MIN_TABLE=None" \
      "--knob triton_two_level.FILLED_CHUNK=1024" "--knob triton_two_level.FILLED_CHUNK=256"; do
      run=$((run + 1))
      timeout 120 python -m eval.bench.decode_attention --contexts 131072 --batches 32 --default-only $knob \
        --out "$out/decode_attention_twolevel_$run.json" 2>&1 | tail -1
    done ;;
  twolevelstep)
    for knob in "" "--knob triton_two_level.MIN_TABLE=1024" \
      "--knob triton_two_level.MIN_TABLE=1024 --knob triton_two_level.FILLED_CHUNK=256" "" \
      "--knob triton_two_level.MIN_TABLE=1024"; do
      python -m eval.bench.step_knobs $knob --out "$out/step_knobs_twolevel_step.jsonl" 2>&1 | tail -1
    done ;;
  knobs)
    for knob in "" "--knob triton_resolve.MAX_WARPS=8" "--knob triton_decode.PROGRAMS_PER_SM_BESIDE_LOOKUP=1" ""; do
      python -m eval.bench.step_knobs $knob --out "$out/step_knobs.jsonl" 2>&1 | tail -1
    done ;;
  critical)
    for knob in "" "--knob triton_score.STORES_LAST=True" "--knob triton_transfer.COUNTED_PROGRAMS=16" \
      "--knob triton_transfer.COUNTED_PROGRAMS=32" "" "--knob triton_score.STORES_LAST=True"; do
      python -m eval.bench.step_knobs $knob --out "$out/step_knobs_critical.jsonl" 2>&1 | tail -1
    done
    for per_sm in 2 4; do
      python -m eval.bench.step_knobs --set lookup_beside_attention=False --knob triton_decode.PROGRAMS_PER_SM=$per_sm \
        --out "$out/step_knobs_critical.jsonl" 2>&1 | tail -1
    done ;;
  selectwarps)
    for knob in "" "--knob triton_select.UNION_WARPS=2" "--knob triton_select.UNION_WARPS=8" \
      "--knob triton_rank.COMBINE_WARPS=1" "--knob triton_rank.COMBINE_WARPS=4" ""; do
      python -m eval.bench.step_knobs $knob --out "$out/step_knobs_select_warps.jsonl" 2>&1 | tail -1
    done ;;
  twolevel)
    python -m pytest -q -rf -p no:cacheprovider tests/ops/test_two_level.py tests/ops/test_select.py tests/ops/test_rank.py \
      2>&1 | tee "$out/gpu_pytest_two_level.log" | tail -5
    for shape in "--batch 1 --context 262016" "--batch 2 --context 130944"; do
      for knob in "" "--knob triton_two_level.MIN_TABLE=2048"; do
        python -m eval.bench.step_knobs $shape $knob --out "$out/step_knobs_two_level.jsonl" 2>&1 | tail -1
      done
    done
    for knob in "" "--knob triton_two_level.MIN_TABLE=512 --knob triton_two_level.CHUNK=256"; do
      python -m eval.bench.step_knobs --batch 1 $knob --out "$out/step_knobs_two_level.jsonl" 2>&1 | tail -1
    done
    for knob in "" "--knob triton_two_level.MIN_TABLE=1024 --knob triton_two_level.CHUNK=256 --knob triton_two_level.CHUNK_WARPS=1"; do
      python -m eval.bench.step_knobs $knob --out "$out/step_knobs_two_level.jsonl" 2>&1 | tail -1
    done ;;
  prefill256k)
    python -m eval.bench.generator_vs_generate --points prefill256k --localities real_locality \
      --out "$out/generator_256k.json" 2>&1 | tee "$out/generator_256k.log" | tail -12 ;;
  addnorm)
    python -m pytest -q -rf -p no:cacheprovider tests/ops/test_norm.py tests/test_decode_graph.py \
      tests/test_static_decoder.py 2>&1 | tee "$out/gpu_pytest_addnorm.log" | tail -5
    for knob in "" "--knob fused_ops.ADD_INTO_NORMS=False" "" "--knob fused_ops.ADD_INTO_NORMS=False"; do
      python -m eval.bench.step_knobs $knob --out "$out/step_knobs_addnorm.jsonl" 2>&1 | tail -1
    done ;;
  dropin256k)
    python -m eval.bench.dropin --points 256k --localities real_locality --out "$out/dropin_256k.json" 2>&1 \
      | tee "$out/dropin_256k.log" | tail -30 ;;
  ahead|aheadload)
    load=$([[ $part == aheadload ]] && echo "--set load_budget=4096" || true)
    if [[ $part == ahead ]]; then
      python -m pytest -q -rf -p no:cacheprovider tests/test_decode_graph.py tests/generation/test_decode_ahead.py \
        2>&1 | tee "$out/gpu_pytest_ahead.log" | tail -5
    fi
    for run in 1 2 3 4; do
      ahead=$([[ $((run % 2)) == 0 ]] && echo True || echo False)
      python -m eval.bench.generator_phases --steps 40 $load --set decode_ahead=$ahead \
        --out "$out/generator_phases_${part}_$run.json" 2>&1 | tail -3
    done ;;
  mma)
    python -m pytest -q -p no:cacheprovider tests/ops/test_channels.py tests/ops/test_bench_scripts.py -k "channels or mma" \
      2>&1 | tee "$out/gpu_pytest_mma.log" | tail -3
    python -m eval.bench.channel_kernel --setting 0 --setting 21 --out "$out/channel_kernel_mma.json" 2>&1 \
      | tee "$out/channel_kernel_mma.log" | tail -4
    alternating "$out/step_knobs_mma.jsonl" "" "--knob triton_channels.MMA=False" ;;
  split)
    for beside in True False; do
      python -m eval.bench.profile_step --graph --layers 8 --steps 3 --set lookup_beside_attention=$beside \
        --out "$out/profile_beside_$beside.md" 2>&1 | tail -40
    done
    alternating "$out/step_knobs_split.jsonl" "" "--set lookup_beside_attention=False" ;;
  ncu)
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    "$ncu_bin" --clock-control none --set full --kernel-name regex:_block_lse --launch-count 2 \
      python -m eval.bench.channel_kernel --setting 0 > "$out/ncu_channels.txt" 2>&1 || true
    grep -E "Duration|Throughput|Stall|Issue|Occupancy|Registers|Warp Cycles|Executed Ipc|L1/TEX Hit" \
      "$out/ncu_channels.txt" | head -60
    "$ncu_bin" --clock-control none --set full \
      --kernel-name regex:"_score_kernel|_combine_kernel|_select_union_kernel|_mark_kernel|_count_kernel|_append_kernel|_install_kernel" \
      --launch-skip 100 --launch-count 10 \
      python -m eval.bench.step_knobs --layers 4 --warmup 20 --steps 5 > "$out/ncu_selection.txt" 2>&1 || true
    grep -E "^  _|Duration|Stall|Issue Slots|Achieved Occupancy|Registers Per|Executed Ipc" \
      "$out/ncu_selection.txt" | head -60 ;;
  longdoc)
    python -m eval.bench.longdoc --out "$out/longdoc.json" 2>&1 | tee "$out/longdoc.log" | tail -10 ;;
  prefill)
    python -m eval.bench.prefill_memory --out "$out/prefill_memory.json" 2>&1 | tee "$out/prefill_memory.log" | tail -20 ;;
  *) echo "unknown part '$part' (tests, default, twolevelwide, twolevelstep, feedback, ahead, aheadload, ncu, slots, attention, reorder, fp8profile, fp8slots, channels, benchtests, kernels, step, generator, capacity, prefill, scoring, lookup, profile, metadata, beside, knobs, twolevel, prefill256k, addnorm, longdoc, dropin, dropin128k, dropin256k, multigpu, tp)" >&2; exit 2 ;;
esac
