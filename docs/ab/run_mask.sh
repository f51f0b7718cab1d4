#!/usr/bin/env bash
# The masked-block A/B (`ab`) against a baseline tree, each tree in its own process, alternating new, base, new, base;
# `tests`: the Mosaic attention GPU tests of this checkout. The new tree is this checkout with one of the patches
# beside this script applied (lean_mask.diff, or mask_cond.diff: the same and a branch to the segment compare alone);
# `profile`: each tree's kernels one by one (profile_attention at T=8192, causal and packed).
# From the repository root, before running on the GPU machine:
#   mkdir -p ab_base && git archive HEAD mjax benchmarks | tar -x -C ab_base; git apply docs/ab/mask_cond.diff
# and on the GPU:  bash docs/ab/run_mask.sh ab_base [ab] [profile] [tests]   (logs under $OUT, or ./ab_mask_out)
# Steps named run in that order; none named: the A/B alone. The A/B takes up to 4 x 180 s, the profiles 2 x 100 s,
# the tests 300 s: where one command has less time, run them apart.
base=${1:?usage: run_mask.sh BASELINE_TREE [ab] [profile] [tests]}
steps=" ${*:2} "; [ "$steps" = "  " ] && steps=" ab "
out=${OUT:-ab_mask_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_experimental_enable_fusion_autotuner=false
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
[[ $steps == *" ab "* ]] && for run in new#1 base#1 new#2 base#2; do
  if [ "${run%#*}" = new ]; then pp=.; else pp=$base:.; fi
  check=$([ "${run#*#}" = 1 ] && echo check)
  log="$out/mask_${run/\#/_}.log"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONPATH=$pp timeout 180 python "$(dirname "$0")/mask_ab.py" "$run" $check \
    > "$log" 2>&1
  echo "rc $?"; grep -E "RESULT|RATIO|ERROR|HASH" "$log" | cut -c1-220
done
if [[ $steps == *" profile "* ]]; then
  for tree in new:. base:$base; do  # -m puts the working directory first on the path: each tree from its folder
    (cd "${tree#*:}" && XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 100 python -m benchmarks.profile_attention \
      --seqs=8192) > "$out/profile_${tree%%:*}.log" 2>&1
    echo "profile ${tree%%:*} rc $?"; grep -E "step span|kernel_mosaic" "$out/profile_${tree%%:*}.log"
  done
fi
if [[ $steps == *" tests "* ]]; then
  JAX_PLATFORMS=cuda PYTHONPATH=. timeout 300 python -m pytest -q -m gpu tests/gpu/test_attention_kernels.py -n 4 \
    -k mosaic > "$out/gpu_tests.log" 2>&1
  echo "tests rc $?"; tail -3 "$out/gpu_tests.log"
fi
