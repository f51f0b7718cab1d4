#!/usr/bin/env bash
# The planner's pick against an exhaustive sweep on the GPUs present: `scripts/plan.py --validate --trial` for one
# preset, then benchmarks/benchmark.py over every remat policy x micro-batch of the same global batch. Run from the
# repo root on the GPU machine:   OUT=runs/gpu CONFIG=llama3.2-3b bash benchmarks/gpu_plan_trial.sh
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
CONFIG=${CONFIG:-llama3.2-3b}; GBS=${GBS:-8}; MBS=${MBS:-1,2,4,8}; STEPS=${STEPS:-4}
source "$(dirname "$0")/gpu_bench.sh"
N=$($PY -c "import jax; print(jax.device_count())")
echo "== plan $CONFIG on $N GPUs"
timeout 300 $PY scripts/plan.py --config="$CONFIG" --num_gpus="$N" --gpu=h200 --global_batch_size="$GBS" --validate=4 \
  --trial=4 --json_out="$OUT/plan_$CONFIG.json" >"$LOGS/plan_$CONFIG.log" 2>&1
rc=$?; grep -v "^[WI]1" "$LOGS/plan_$CONFIG.log" | tail -40; [ $rc -eq 0 ] || status=1
bench "sweep_$CONFIG" 400 --config="$CONFIG" --num_devices="$N" --global_batch_size="$GBS" \
  --sweep="remat_policy=none,selective,full;micro_batch_size=$MBS"
tar czf "$OUT/logs.tgz" -C "$LOGS" .
exit $status
