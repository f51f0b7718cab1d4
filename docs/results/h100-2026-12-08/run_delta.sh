#!/usr/bin/env bash
# delta inside the dq kernel: the A/B against a baseline tree (each in its own process, two rounds alternating),
# then the Mosaic GPU tests of this checkout (the reference cases and the dq block configurations). From the
# repository root, on the GPU, with BASE a tree of the commit before the change:
#   git archive <commit> mjax benchmarks | tar -x -C BASE; bash <this directory>/run_delta.sh BASE
# Logs under $OUT (or ./ab_delta_out).
base=${1:?usage: run_delta.sh BASELINE_TREE}
out=${OUT:-ab_delta_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_experimental_enable_fusion_autotuner=false
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
for run in new#1 base#1 new#2 base#2; do
  if [ "${run%#*}" = new ]; then pp=.; else pp=$base:.; fi
  check=$([ "$run" = new#1 ] && echo check)
  log="$out/delta_${run/\#/_}.log"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$pp timeout 95 python "$(dirname "$0")/delta_ab.py" "$run" $check \
    > "$log" 2>&1
  echo "rc $?"; grep -E "RESULT|RATIO|ERROR" "$log" | cut -c1-200
done
JAX_PLATFORMS=cuda PYTHONPATH=. timeout 120 python -m pytest -q -m gpu tests/gpu/test_attention_kernels.py -n 4 \
  -k "mosaic_kernels_match or dq-" > "$out/gpu_tests.log" 2>&1
echo "tests rc $?"; tail -3 "$out/gpu_tests.log"
