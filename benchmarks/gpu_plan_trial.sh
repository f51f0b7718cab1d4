#!/usr/bin/env bash
# The planner's pick against an exhaustive sweep on the GPUs present: `scripts/plan.py --trial=4` for one preset,
# then benchmarks/benchmark.py over the rest of every remat policy x micro-batch of the same global batch (each row
# also reports XLA's compiled memory). Run from the repo root on the GPU machine:
#   OUT=runs/gpu CONFIG=llama3.2-3b bash benchmarks/gpu_plan_trial.sh
set -uo pipefail
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
CONFIG=${CONFIG:-llama3.2-3b}; GBS=${GBS:-8}; MBS=${MBS:-1,2,4,8}; STEPS=${STEPS:-4}
PLAN_LIMIT=${PLAN_LIMIT:-300}; SWEEP_LIMIT=${SWEEP_LIMIT:-400}; SWEEP_REMATS=${SWEEP_REMATS:-none,selective,full}
source "$(dirname "$0")/gpu_bench.sh"
N=$($PY -c "import jax; print(jax.device_count())")
echo "== plan $CONFIG on $N GPUs"
timeout "$PLAN_LIMIT" $PY scripts/plan.py --config="$CONFIG" --num_gpus="$N" --gpu=h200 --global_batch_size="$GBS" \
  --trial=4 --trial_steps="$STEPS" --json_out="$OUT/plan_$CONFIG.json" >"$LOGS/plan_$CONFIG.log" 2>&1
rc=$?; grep -v "^[WI]1" "$LOGS/plan_$CONFIG.log" | tail -40; [ $rc -eq 0 ] || status=1
# The sweep: every remat policy x micro-batch the trial did not run (the trial's rows are its other rows).
for remat in ${SWEEP_REMATS//,/ }; do
  rest=$($PY -c "import json,sys; t={r['layout'] for r in json.load(open(sys.argv[1]))['trials']}
print(','.join(m for m in sys.argv[3].split(',') if not any(f'mbs{m} remat={sys.argv[2]}' in l for l in t)))" \
    "$OUT/plan_$CONFIG.json" "$remat" "$MBS")
  [ -n "$rest" ] || continue
  bench "sweep_${CONFIG}_$remat" "$SWEEP_LIMIT" --config="$CONFIG" --num_devices="$N" --global_batch_size="$GBS" \
    --sweep="remat_policy=$remat;micro_batch_size=$rest"
done
tar czf "$OUT/logs.tgz" -C "$LOGS" .
exit $status
