#!/bin/bash
# Decides segment_ids_in_ring.patch (beside this script) on one GPU: deal_ab.py on this tree and on it patched,
# alternating processes, XLA's fusion autotuner off (so output hashes compare), then the packed Mosaic GPU tests on
# the patched tree. Applies the patch to this checkout: run it on a throwaway copy, from the repo root. Logs under
# $OUT; LIMIT bounds the seconds it runs (a second A/B round only where time is left).
set -u
OUT=${OUT:-/tmp/segment_ids_ab}; LIMIT=${LIMIT:-420}; mkdir -p "$OUT"
PATCH=$(cd "$(dirname "$0")" && pwd)/segment_ids_in_ring.patch  # beside this script
BASE=$(mktemp -d) && cp -r mjax benchmarks "$BASE"/
{ git apply "$PATCH" 2>/dev/null || patch -p1 -s < "$PATCH"; } \
  || { echo "the patch does not apply to this tree" >&2; exit 1; }
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; python -c "import jax; print('jax', jax.__version__)"; } > "$OUT/gpu.txt"
ab() {  # one process per tree; RESULT lines name the tree and the round
  for tree in "seg:." "main:$BASE"; do
    XLA_FLAGS=--xla_gpu_experimental_enable_fusion_autotuner=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 \
      PYTHONPATH=${tree#*:} \
      timeout 120 python docs/ab/deal_ab.py "${tree%%:*}$1" 2>&1 | grep "^RESULT\|Error" | tee -a "$OUT/ab.log"
  done
}
ab 1
echo "round 1 done at $SECONDS s" | tee -a "$OUT/ab.log"
RESERVE=$(( LIMIT >= 400 ? 130 : 15 ))  # a second round only where the limit has room for one
JAX_PLATFORMS=cuda timeout $((LIMIT - RESERVE - SECONDS)) python -m pytest -q -m gpu tests/gpu/test_attention_kernels.py \
  -k "mosaic and packed" -n 4 -rA 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
echo "tests done at $SECONDS s" | tee -a "$OUT/ab.log"
if [ "$SECONDS" -lt $((LIMIT - 110)) ]; then ab 2; fi
echo "end at $SECONDS s" | tee -a "$OUT/ab.log"
