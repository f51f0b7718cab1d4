#!/usr/bin/env bash
# One-GPU throughput for docs/performance.md and docs/fp8.md, most informative first (each run has its own
# timeout, so a slow compile costs only its own row): the quantization passes against a copy's bandwidth, the 1B
# preset next to the plain-JAX baseline in the same process, the 3B preset in bf16, then in FP8 (tensorwise and
# delayed), every step profiled.
# Run from the repo root on the GPU machine:  OUT=runs/gpu bash scripts/gpu_throughput.sh
# Results: $OUT/*.json; logs and HLO in $OUT/logs.tgz.
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
STEPS=${STEPS:-6}
source "$(dirname "$0")/gpu_bench.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
one() { bench "$@" --num_devices=1 --global_batch_size=8; }  # one GPU, 8 x 4096 tokens
if [ "${QUANT:-1}" = 1 ]; then  # QUANT=0 skips it
  timeout 60 $PY scripts/bench_fp8.py --sections=quant --out="$OUT/quant.json" >"$LOGS/quant.log" 2>&1 || status=1
  grep "quant {" "$LOGS/quant.log"
fi
one 1b ${T1B:-150} --config=llama3.2-1b --profile_steps=2 --baseline
one 3b ${T3B:-90} --config=llama3.2-3b --profile_steps=1
# FP8 with the preset's remat set plus fp8_cast: the quantized operands are kept, so the backward does not redo
# the amaxes and casts.
SET=qkv_proj,attn_core,attn_context,attn_out,mlp_up,mlp_out,fp8_cast
for recipe in tensorwise delayed; do
  one 3b_fp8_$recipe ${TFP8:-170} --config=llama3.2-3b --model.remat_save_names=$SET --fp8_recipe=$recipe \
    --profile_steps=1
done
tar czf "$OUT/logs.tgz" -C "$LOGS" .
exit $status
