#!/usr/bin/env bash
# One-GPU throughput for docs/performance.md and docs/fp8.md: the llama3.2-1b and -3b presets next to the plain-JAX
# baseline in the same run, where each step's device time goes (--profile_steps), and the 3B preset in FP8.
# Run from the repo root on the GPU machine:  OUT=runs/gpu bash scripts/gpu_throughput.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.} XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
STEPS=${STEPS:-6}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
bench() {  # name, timeout, flags...: one benchmark run, its table printed, log and JSON kept
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" $PY scripts/benchmark.py --num_devices=1 --global_batch_size=8 --steps=$STEPS \
    --json_out="$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  echo "exit $?"; grep -v "^[WI]1" "$OUT/$name.log" | grep -A8 "matmul ceiling" | tail -8
}
bench llama3.2-1b ${T1B:-150} --config=llama3.2-1b --profile_steps=2 --baseline
bench llama3.2-3b ${T3B:-150} --config=llama3.2-3b --profile_steps=2
# FP8 needs room for its residuals at 3B: the remat set without the gate/up projections, for both rows.
KEEP=qkv_proj+attn_core+attn_context+attn_out+mlp_out
bench llama3.2-3b_fp8 ${TFP8:-300} --config=llama3.2-3b --model.remat_save_names=$KEEP \
  --sweep="fp8_recipe=none,tensorwise,delayed"
# The same FP8 steps keeping their quantized operands (no amax/cast recompute in the backward).
bench llama3.2-3b_fp8_cast ${TFP8:-300} --config=llama3.2-3b --model.remat_save_names=$KEEP+fp8_cast \
  --sweep="fp8_recipe=tensorwise,delayed"
