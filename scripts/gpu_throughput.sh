#!/usr/bin/env bash
# One-GPU throughput study for docs/performance.md: the llama3.2-1b and -3b presets under the loss and remat
# choices that matter, the plain-JAX baseline, and where each step's device time goes (--profile_steps).
# Run from the repo root on the GPU machine:  OUT=runs/gpu bash scripts/gpu_throughput.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.} XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
STEPS=${STEPS:-6}
SAVE_DEFAULT=qkv_proj+attn_context+attn_out+mlp_out
SAVE_GATE_UP=qkv_proj+attn_context+attn_out+mlp_gate+mlp_up+mlp_out
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
bench() {  # name, timeout, flags...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" $PY scripts/benchmark.py --num_devices=1 --global_batch_size=8 --steps=$STEPS \
    --json_out="$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  echo "exit $?"; grep -v "^[WI]1" "$OUT/$name.log" | grep -A12 "matmul ceiling" | tail -12
}
bench llama3.2-1b ${T1B:-330} --config=llama3.2-1b --remat_policy=selective --profile_steps=2 --baseline \
  --sweep="cross_entropy_impl=reference,fused;remat_save_names=$SAVE_DEFAULT,$SAVE_GATE_UP" ${EXTRA_1B:-}
bench llama3.2-3b ${T3B:-230} --config=llama3.2-3b --remat_policy=selective --cross_entropy_impl=fused \
  --profile_steps=2 --sweep="remat_save_names=$SAVE_DEFAULT,$SAVE_GATE_UP" ${EXTRA_3B:-}
bench llama3.2-1b_noremat ${T1BN:-150} --config=llama3.2-1b --remat_policy=none --cross_entropy_impl=fused \
  --profile_steps=2
