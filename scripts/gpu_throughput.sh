#!/usr/bin/env bash
# One-GPU throughput for docs/performance.md and docs/fp8.md, most informative first (each run has its own
# timeout, so a slow compile costs only its own row): the quantization passes against a copy's bandwidth, the 1B
# preset next to the plain-JAX baseline in the same process, the 3B preset in FP8 (profiled, its HLO kept),
# the 3B preset in bf16, FP8 with the preset's remat set, the 3B bf16 step with the FP8 rows' remat set.
# Run from the repo root on the GPU machine:  OUT=runs/gpu bash scripts/gpu_throughput.sh
# Results: $OUT/*.json; logs and HLO in $OUT/logs.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-.} XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-runs/gpu}; LOGS=${LOGS:-/tmp/mjax_gpu_logs}; mkdir -p "$OUT" "$LOGS"
PY=${PY:-python3}
STEPS=${STEPS:-6}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
status=0
bench() {  # name, timeout, flags...: one benchmark run, its table printed, log in $LOGS, JSON in $OUT
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" $PY scripts/benchmark.py --num_devices=1 --global_batch_size=8 --steps=$STEPS \
    --json_out="$OUT/$name.json" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?; echo "exit $rc"; [ $rc -eq 0 ] || status=1
  grep -v "^[WI]1" "$LOGS/$name.log" | grep -A12 "matmul ceiling" | tail -12
}
if [ "${QUANT:-1}" = 1 ]; then  # QUANT=0 skips it
  timeout 60 $PY scripts/bench_fp8.py --sections=quant --out="$OUT/quant.json" >"$LOGS/quant.log" 2>&1 || status=1
  grep "quant {" "$LOGS/quant.log"
fi
# FP8 needs room for its residuals at 3B: the remat set without the gate/up projection; fp8_cast keeps the
# quantized operands so the backward does not redo the amaxes and casts.
KEEP=qkv_proj,attn_core,attn_context,attn_out,mlp_out
bench 1b ${T1B:-150} --config=llama3.2-1b --profile_steps=2 --baseline
bench 3b_fp8_tensorwise ${TFP8:-170} --config=llama3.2-3b --model.remat_save_names=$KEEP,fp8_cast \
  --fp8_recipe=tensorwise --profile_steps=1 --hlo_dir="$LOGS/hlo"
bench 3b ${T3B:-90} --config=llama3.2-3b --profile_steps=1
# The preset's own remat set (the fused gate/up output kept too), if it fits next to the FP8 residuals.
bench 3b_fp8_tensorwise_default_set ${TFP8:-170} --config=llama3.2-3b \
  --model.remat_save_names=$KEEP,mlp_up,fp8_cast --fp8_recipe=tensorwise --profile_steps=1
bench 3b_bf16_keep ${T3B:-90} --config=llama3.2-3b --model.remat_save_names=$KEEP --profile_steps=1
tar czf "$OUT/logs.tgz" -C "$LOGS" .
exit $status
