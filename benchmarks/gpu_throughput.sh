#!/usr/bin/env bash
# One-GPU throughput for docs/performance.md and docs/fp8.md, most informative first (each run has its own
# timeout, so a slow compile costs only its own row): the quantization passes against a copy's bandwidth, the 1B
# preset next to the plain-JAX baseline in the same process, the 3B preset in bf16, then in FP8 (tensorwise and
# delayed), every step profiled; HEAD=1, XLA_CASTS=1 and GEMM=1 add the rows described at the end; QUANT=0 and DEFAULT=0
# skip the pass benchmark and the default rows (e.g. DEFAULT=0 QUANT=0 GEMM=1 for the GEMM table alone).
# Run from the repo root on the GPU machine:  OUT=runs/gpu bash benchmarks/gpu_throughput.sh
# Results: $OUT/*.json; logs and HLO in $OUT/logs.tgz.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
source "$(dirname "$0")/gpu_bench.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
one() { bench "$@" --num_devices=1 --global_batch_size=8; }  # one GPU, 8 x 4096 tokens
if [ "${QUANT:-1}" = 1 ]; then  # QUANT=0 skips it
  timeout 60 $PY -m benchmarks.bench_fp8 --sections=quant --out="$OUT/quant.json" >"$LOGS/quant.log" 2>&1 || status=1
  grep "quant {" "$LOGS/quant.log"
fi
# FP8 rows keep their quantized operands for the backward (remat name fp8_cast, --fp8_keep_casts by default).
if [ "${DEFAULT:-1}" = 1 ]; then  # DEFAULT=0 skips the default rows
  one 1b ${T1B:-150} --config=llama3.2-1b --profile_steps=2 --baseline
  one 3b ${T3B:-90} --config=llama3.2-3b --profile_steps=1
  for recipe in tensorwise delayed; do
    one 3b_fp8_$recipe ${TFP8:-170} --config=llama3.2-3b --fp8_recipe=$recipe --profile_steps=1
  done
fi
# Opt-in rows (the default set above takes ~8 of a call's 10 minutes): the FP8 step with its output layer quantized
# too, inside the fused loss (HEAD=1: with whole logits that step did not fit), with XLA's casts and transposes
# instead of the cast-transpose kernel (XLA_CASTS=1), the other recipes end to end (RECIPES=1: blockwise FP8,
# NVFP4, MXFP4 with the Hadamard transform, under the preset's remat set), the fused QKV gradient assembled by
# autodiff's concatenate instead of the Pallas kernel (QKV=1: the pass against autodiff's and a copy's, then the 3B
# step in bf16 and FP8 without the kernel), every recipe's GEMM and linear-layer throughput next to bf16's (GEMM=1),
# and every recipe's loss curve against bf16's on the installed Python source, next to a second bf16 run from
# another seed (CONVERGE=1: a ~30M-parameter Llama, 800 steps of 16 x 1024 tokens, ~5 minutes).
if [ "${HEAD:-0}" = 1 ]; then
  one 3b_fp8_tensorwise_head ${TFP8:-170} --config=llama3.2-3b --fp8_recipe=tensorwise --quantize_output_layer \
    --cross_entropy_impl=fused --profile_steps=1
fi
if [ "${XLA_CASTS:-0}" = 1 ]; then  # the FP8 step with XLA making its FP8 copies
  one 3b_fp8_tensorwise_xla_casts ${TFP8:-170} --config=llama3.2-3b --fp8_recipe=tensorwise --quant_impl=xla \
    --profile_steps=1
fi
if [ "${RECIPES:-0}" = 1 ]; then
  one 3b_fp8_blockwise ${TFP8:-170} --config=llama3.2-3b --fp8_recipe=blockwise --profile_steps=1
  one 3b_nvfp4 ${TFP8:-170} --config=llama3.2-3b --fp4_recipe=nvfp4 --profile_steps=1
  one 3b_mxfp4_rht ${TFP8:-170} --config=llama3.2-3b --fp4_recipe=mxfp4 --fp4_hadamard --profile_steps=1
fi
if [ "${QKV:-0}" = 1 ]; then
  timeout 60 $PY -m benchmarks.bench_qkv_grad --out="$OUT/qkv_grad.json" >"$LOGS/qkv_grad.log" 2>&1 || status=1
  grep -A4 "^case" "$LOGS/qkv_grad.log"
  one 3b_qkv_xla ${T3B:-90} --config=llama3.2-3b --qkv_grad_impl=xla --profile_steps=1
  one 3b_fp8_tensorwise_qkv_xla ${TFP8:-170} --config=llama3.2-3b --fp8_recipe=tensorwise \
    --qkv_grad_impl=xla --profile_steps=1
fi
if [ "${GEMM:-0}" = 1 ]; then
  timeout 420 $PY -m benchmarks.bench_fp8 --sections=gemm --gemm_deadline_s=400 --budget_s=420 \
    --out="$OUT/gemm.json" >"$LOGS/gemm.log" 2>&1 || status=1
  grep "gemm {" "$LOGS/gemm.log"
fi
if [ "${CONVERGE:-0}" = 1 ]; then  # the 0.35M-token sample corpus would be memorized within a few hundred steps
  $PY -m tools.source_corpus --out=/tmp/code.jsonl >"$LOGS/corpus.log" 2>&1 &&
    $PY scripts/preprocess_data.py --input=/tmp/code.jsonl --output_prefix=/tmp/code --append_eod --workers=8 \
      --progress=false >>"$LOGS/corpus.log" 2>&1 || status=1
  tail -2 "$LOGS/corpus.log"
  timeout 540 $PY -m benchmarks.convergence --config=tiny --model.hidden_size=512 --model.num_layers=8 \
    --model.num_attention_heads=8 --model.num_query_groups=8 --model.ffn_hidden_size=1536 --seq_length=1024 \
    --global_batch_size=16 --bf16 --train_iters=${CONVERGE_STEPS:-800} --window=100 \
    --data_path=/tmp/code_text_document \
    --recipes=bf16,bf16_seed,tensorwise,tensorwise_head,delayed,blockwise,nvfp4,nvfp4_sr,mxfp4_rht \
    --out="$OUT/convergence.json" >"$LOGS/convergence.log" 2>&1 || status=1
  grep -A10 "^mean loss" "$LOGS/convergence.log"
fi
tar czf "$OUT/logs.tgz" -C "$LOGS" .
exit $status
