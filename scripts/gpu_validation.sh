#!/usr/bin/env bash
# Multi-GPU validation and scaling on one host: layout correctness against 1 GPU, then tokens/s per GPU for the
# llama3.2-1b and llama3.2-3b presets at 1 GPU and at every GPU (DP, FSDP, ZeRO-1), with compiled HLO for the
# overlap analysis. Run from the repo root on the GPU machine:  OUT=runs/gpu bash scripts/gpu_validation.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
PY=${PY:-python3}
N=$($PY -c "import jax; print(jax.device_count())")
STEPS=${STEPS:-8}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== layouts at $N GPUs vs 1 GPU (fp32, full-precision matmuls)"
timeout 150 $PY scripts/check_layouts.py --steps=4 --json_out="$OUT/layouts.json" 2>&1 | grep -v "^[WI]1" | tail -9
for preset in llama3.2-1b llama3.2-3b; do
  echo "== $preset, 1 GPU"
  timeout 120 $PY scripts/benchmark.py --config=$preset --num_devices=1 --global_batch_size=8 --remat_policy=selective \
    --steps=$STEPS --json_out="$OUT/${preset}_1gpu.json" 2>&1 | grep -v "^[WI]1" | tail -3
  echo "== $preset, $N GPUs: DP and FSDP, global batch $((8 * N))"
  timeout 200 $PY scripts/benchmark.py --config=$preset --global_batch_size=$((8 * N)) --remat_policy=selective \
    --steps=$STEPS --sweep="fsdp=1,$N" $([ $preset = llama3.2-1b ] && echo --hlo_dir="$OUT") --json_out="$OUT/${preset}_${N}gpu.json" 2>&1 \
    | grep -v "^[WI]1" | tail -4
done
echo "== llama3.2-1b, $N GPUs: ZeRO-1"
timeout 120 $PY scripts/benchmark.py --config=llama3.2-1b --global_batch_size=$((8 * N)) --remat_policy=selective \
  --steps=$STEPS --use_distributed_optimizer --json_out="$OUT/llama3.2-1b_${N}gpu_zero1.json" 2>&1 \
  | grep -v "^[WI]1" | tail -3
echo "== attention kernels (1 GPU)"
timeout 170 $PY scripts/check_attention_gpu.py --no_tune 2>&1 | grep -v "^[WI]1" | tail -30
