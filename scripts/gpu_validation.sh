#!/usr/bin/env bash
# Multi-GPU validation and scaling on one host: layout correctness against 1 GPU, then tokens/s per GPU for the
# llama3.2-1b and llama3.2-3b presets at 1 GPU and at every GPU (DP, FSDP, ZeRO-1), with a profile of each
# multi-GPU step (how much collective time overlaps compute). Run from the repo root on the GPU machine:
#   OUT=runs/gpu bash scripts/gpu_validation.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
N=$($PY -c "import jax; print(jax.device_count())")
STEPS=${STEPS:-8}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench() {  # name, timeout, flags...: one benchmark run, its table printed, log and JSON kept
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" $PY scripts/benchmark.py --steps=$STEPS --json_out="$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
  echo "exit $?"; grep -v "^[WI]1" "$OUT/$name.log" | grep -E "collectives:|^profile of" ; \
    grep -v "^[WI]1" "$OUT/$name.log" | grep -A8 "matmul ceiling" | tail -8
}
echo "== layouts at $N GPUs vs 1 GPU (fp32, full-precision matmuls)"
timeout 200 $PY scripts/check_layouts.py --steps=4 --json_out="$OUT/layouts.json" 2>&1 | grep -v "^[WI]1" | tail -9
for preset in llama3.2-1b llama3.2-3b; do
  bench "${preset}_1gpu" 150 --config=$preset --num_devices=1 --global_batch_size=8
  bench "${preset}_${N}gpu" 240 --config=$preset --global_batch_size=$((8 * N)) --sweep="fsdp=1,$N" --profile_steps=2
done
bench "llama3.2-1b_${N}gpu_zero1" 150 --config=llama3.2-1b --global_batch_size=$((8 * N)) --use_distributed_optimizer
