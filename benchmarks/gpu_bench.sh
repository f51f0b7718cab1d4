# Sourced by the GPU scripts. `bench NAME TIMEOUT FLAGS...` runs benchmarks/benchmark.py once under its own timeout
# (a slow compile costs only its row): JSON to $OUT/NAME.json, log to $LOGS/NAME.log (the device machine returns
# at most 8 files, so the scripts tar $LOGS at the end), the table and collective lines printed; a failed or
# timed-out run sets status=1, which the script exits with.
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-runs/gpu}; LOGS=${LOGS:-/tmp/mjax_gpu_logs}; mkdir -p "$OUT" "$LOGS"
PY=${PY:-python3}
STEPS=${STEPS:-6}  # a sourcing script may set its own
# Rows of one call share XLA's GEMM autotuning results (each row is a fresh process).
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=/tmp/mjax_autotune"
status=0
bench() {
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" $PY -m benchmarks.benchmark --steps="$STEPS" --json_out="$OUT/$name.json" --hlo_dir="$LOGS/hlo/$name" \
    "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?; echo "exit $rc"; [ $rc -eq 0 ] || status=1
  grep -v "^[WI]1" "$LOGS/$name.log" | grep -E "collectives:|^profile of"
  grep -v "^[WI]1" "$LOGS/$name.log" | grep -A12 "matmul ceiling" | tail -12
}
