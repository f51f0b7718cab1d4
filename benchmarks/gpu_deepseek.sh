#!/usr/bin/env bash
# DeepSeek-V3 on one GPU for docs/deepseek.md: the blockwise FP8 grouped kernels' GPU tests, their benchmark at MoE
# shapes beside the dense blockwise and bf16 GEMMs, then a V3-shaped model cut to fit one GPU (2 layers: the dense
# first layer and one MoE layer of 64 experts) in bf16 and FP8 blockwise, each step profiled (the blockwise GEMMs'
# share of the step); V3_FLAGS adds flags to those rows (e.g. --global_batch_size=4 --profile_steps=0), TESTS=0
# and GMM=0 skip the first two parts. Run from the repo root on the GPU machine:
#   OUT=runs/gpu bash benchmarks/gpu_deepseek.sh
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
STEPS=${STEPS:-6}
source "$(dirname "$0")/gpu_bench.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests of the blockwise grouped kernels"
  JAX_PLATFORMS=cuda timeout 200 $PY -m pytest -q -rs -m gpu tests/gpu/test_grouped_matmul_fp8_gpu.py -k blockwise -p no:cacheprovider \
    >"$LOGS/tests.log" 2>&1 || status=1
  tail -15 "$LOGS/tests.log"
fi
if [ "${GMM:-1}" = 1 ]; then
  echo "== blockwise grouped GEMM"
  timeout 150 $PY -m benchmarks.bench_grouped_matmul --fp8 --fp8_blockwise --fp8_format=e4m3 --noragged_dot --check \
    --dists=balanced,skewed --shapes="${GMM_SHAPES:-8x4096x768x2048,128x512x768x2048,64x1024x2048x7168,64x1024x7168x2048}" \
    --json_out="$OUT/gmm_fp8_blockwise.json" >"$LOGS/gmm.log" 2>&1 || status=1
  grep -v "^[WI]1" "$LOGS/gmm.log" | tail -30
fi
V3="--config=deepseek-v3 --model.num_layers=2 --model.moe_first_dense_layers=1 --model.num_experts=64
    --global_batch_size=1 --num_devices=1 --profile_steps=1"
for recipe in ${RECIPES:-none blockwise}; do
  fmt=""; [ "$recipe" = none ] || fmt="--fp8_format=e4m3"  # DeepSeek-V3's FP8: e4m3 everywhere
  bench "deepseek_v3_2l_$recipe" "${TV3:-200}" $V3 --fp8_recipe=$recipe $fmt ${V3_FLAGS:-}
  grep -v "^[WI]1" "$LOGS/deepseek_v3_2l_$recipe.log" | grep -B2 -A30 "^profile of" | head -45
  grep -v "^[WI]1" "$LOGS/deepseek_v3_2l_$recipe.log" | grep -A6 "matmul ceiling" | tail -6
done
tar czf "$OUT/logs.tgz" -C "$LOGS" .
exit $status
