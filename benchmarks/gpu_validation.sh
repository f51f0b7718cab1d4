#!/usr/bin/env bash
# Multi-GPU validation and scaling on one host: layout correctness against 1 GPU, then tokens/s per GPU for the
# llama3.2-1b and llama3.2-3b presets at 1 GPU and at every GPU (DP, FSDP, ZeRO-1), with a profile of each
# multi-GPU step (how much collective time overlaps compute); FP8=1 adds the 3B FP8 step at every GPU, with XLA's
# casts and with the cast-transpose kernel. Run from the repo root on the GPU machine:
#   OUT=runs/gpu bash benchmarks/gpu_validation.sh     (results: $OUT/*.json; logs in $OUT/logs.tgz)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
STEPS=${STEPS:-8}
source "$(dirname "$0")/gpu_bench.sh"
N=$($PY -c "import jax; print(jax.device_count())")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== layouts at $N GPUs vs 1 GPU (fp32, full-precision matmuls)"
timeout 200 $PY -m benchmarks.check_layouts --steps=4 --json_out="$OUT/layouts.json" 2>&1 | grep -v "^[WI]1" | tail -9
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
for preset in llama3.2-1b llama3.2-3b; do
  bench "${preset}_1gpu" 150 --config=$preset --num_devices=1 --global_batch_size=8
  bench "${preset}_${N}gpu" 240 --config=$preset --global_batch_size=$((8 * N)) --sweep="fsdp=1,$N" --profile_steps=2
done
bench "llama3.2-1b_${N}gpu_zero1" 150 --config=llama3.2-1b --global_batch_size=$((8 * N)) --use_distributed_optimizer
if [ "${FP8:-0}" = 1 ]; then  # FP8 tensorwise at every GPU: XLA's casts, then the cast-transpose kernel per shard
  for impl in xla pallas; do
    bench "llama3.2-3b_${N}gpu_fp8_$impl" 240 --config=llama3.2-3b --global_batch_size=$((8 * N)) \
      --fp8_recipe=tensorwise --quant_impl=$impl --profile_steps=1
  done
fi
tar czf "$OUT/logs.tgz" -C "$LOGS" .
exit $status
