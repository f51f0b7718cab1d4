#!/usr/bin/env bash
# Context parallelism on one GPU: the GPU kernel tests (traced offsets, the blockwise backward), the ring-step
# benchmark (benchmarks/bench_context_parallel.py), and llama3.2-1b trained at 64k and 128k tokens per sequence
# with full recompute. Run from the repo root on the GPU machine; PART=tests|ring|long runs one part:
#   OUT=runs/gpu bash benchmarks/gpu_context_parallel.sh     (results: $OUT/*.json; logs in $OUT/logs.tgz)
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
STEPS=${STEPS:-3}
PART=${PART:-all}
source "$(dirname "$0")/gpu_bench.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  echo "== GPU tests"
  JAX_PLATFORMS=cuda timeout 300 $PY -m pytest -m gpu tests/gpu -q -rs -x -p no:cacheprovider >"$LOGS/gpu_tests.log" 2>&1
  rc=$?; tail -5 "$LOGS/gpu_tests.log"; [ $rc -eq 0 ] || status=1
fi
if [ "$PART" = all ] || [ "$PART" = ring ]; then
  echo "== ring steps vs one kernel"
  timeout 240 $PY -m benchmarks.bench_context_parallel --json_out="$OUT/cp_ring.json" 2>&1 | grep -v "^[WI]1"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$PART" = all ] || [ "$PART" = long ]; then
  for seq in 65536 131072; do
    bench "llama3.2-1b_seq${seq}" 280 --config=llama3.2-1b --num_devices=1 --seq_length=$seq --global_batch_size=1 \
      --micro_batch_size=1 --remat_policy=full
  done
fi
tar czf "$OUT/logs.tgz" -C "$LOGS" .
exit $status
