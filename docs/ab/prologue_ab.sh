#!/bin/bash
# Decides docs/ab/prologue.patch: prologue_ab.py on this tree with the patch applied and on the tree as committed
# (a copy), alternating processes, XLA's fusion autotuner off (so hashes compare); then the per-kernel profile of
# both at T=8192. Applies the patch to this checkout: run it on a throwaway copy (the GPU machine's), from the repo
# root. Logs under $OUT; LIMIT bounds the seconds it runs.
set -u
OUT=${OUT:-/tmp/prologue_ab}; LIMIT=${LIMIT:-480}; mkdir -p "$OUT"
BASE=$(mktemp -d) && cp -r mjax benchmarks docs "$BASE"/
{ git apply docs/ab/prologue.patch 2>/dev/null || patch -p1 -s < docs/ab/prologue.patch; } \
  || { echo "the patch does not apply to this tree" >&2; exit 1; }
export PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_experimental_enable_fusion_autotuner=false
{ nvidia-smi -L; python -c "import jax; print('jax', jax.__version__)"; } > "$OUT/gpu.txt"
ab() {
  for tree in "new:." "base:$BASE"; do
    PYTHONPATH=${tree#*:} timeout 150 python docs/ab/prologue_ab.py "${tree%%:*}$1" 2>&1 \
      | grep "^RESULT\|Error" | tee -a "$OUT/ab.log"
  done
}
ab 1
for tree in "new:." "base:$BASE"; do
  [ "$SECONDS" -lt $((LIMIT - 90)) ] || break
  (cd "${tree#*:}" && timeout 80 python -m benchmarks.profile_attention --seqs=8192) \
    > "$OUT/profile_${tree%%:*}.log" 2>&1  # -m puts the working directory first on the path
done
if [ "$SECONDS" -lt $((LIMIT - 200)) ]; then ab 2; fi
echo "end at $SECONDS s" | tee -a "$OUT/ab.log"
