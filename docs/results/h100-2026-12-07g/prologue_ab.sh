#!/bin/bash
# Decides prologue.patch (beside this script): prologue_ab.py on this tree with the patch applied and on the tree
# as committed (a copy), alternating processes, XLA's fusion autotuner off (so hashes compare); then the per-kernel
# profile of both at T=8192. Applies the patch to this checkout: run it on a disposable copy, from the repo root.
# Logs under $OUT; each step starts only where LIMIT (seconds) leaves it its time.
set -u
HERE=docs/results/h100-2026-12-07g; OUT=${OUT:-/tmp/prologue_ab}; LIMIT=${LIMIT:-480}; mkdir -p "$OUT"
BASE=$(mktemp -d) && cp -r mjax benchmarks "$BASE"/ && trap 'rm -rf "$BASE"' EXIT
git apply "$HERE/prologue.patch" || { echo "the patch does not apply to this tree" >&2; exit 1; }
export PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_experimental_enable_fusion_autotuner=false
{ nvidia-smi -L; python -c "import jax; print('jax', jax.__version__)"; } > "$OUT/gpu.txt"
ab() {  # $1: round; $2 $3: the trees in the order they run
  for tree in "$2" "$3"; do
    [ "$SECONDS" -lt $((LIMIT - 150)) ] || { echo "round $1 ${tree%%:*}: no time left" | tee -a "$OUT/ab.log"; return; }
    log="$OUT/ab_${tree%%:*}$1.log"
    PYTHONPATH=${tree#*:} timeout 150 python "$HERE/prologue_ab.py" "${tree%%:*}$1" > "$log" 2>&1
    echo "round $1 ${tree%%:*}: rc $?" | tee -a "$OUT/ab.log"; grep "^RESULT" "$log" | tee -a "$OUT/ab.log"
  done
}
ab 1 "new:." "base:$BASE"
for tree in "base:$BASE" "new:."; do
  [ "$SECONDS" -lt $((LIMIT - 80)) ] || break
  (cd "${tree#*:}" && timeout 80 python -m benchmarks.profile_attention --seqs=8192) \
    > "$OUT/profile_${tree%%:*}.log" 2>&1  # -m puts the working directory first on the path
done
ab 2 "base:$BASE" "new:."
echo "end at $SECONDS s" | tee -a "$OUT/ab.log"
