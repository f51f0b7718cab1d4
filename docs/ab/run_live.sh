#!/usr/bin/env bash
# The row kernels' deal of their live visits: A/B against a baseline tree (each in its own process, two rounds
# alternating), then the Mosaic grouped-matmul GPU tests of this checkout. From the repository root, on the GPU,
# with BASE a tree of the commit before the deal:
#   git archive c0795f9 mjax benchmarks | tar -x -C BASE; bash docs/ab/run_live.sh BASE
# Logs under $OUT (or ./ab_live_out).
base=${1:?usage: run_live.sh BASELINE_TREE}
out=${OUT:-ab_live_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_experimental_enable_fusion_autotuner=false
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
for run in base#1 new#1 base#2 new#2; do
  if [ "${run%#*}" = new ]; then pp=.; else pp=$base:.; fi
  log="$out/live_${run/\#/_}.log"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$pp timeout 150 python docs/ab/ab_live.py "$run" > "$log" 2>&1
  echo "rc $?"; grep RESULT "$log" | cut -c8-
done
JAX_PLATFORMS=cuda PYTHONPATH=. timeout 300 python -m pytest -q -m gpu tests/gpu/test_grouped_matmul_mosaic.py -n 4 \
  > "$out/gpu_tests_gmm.log" 2>&1
echo "tests rc $?"; tail -3 "$out/gpu_tests_gmm.log"
