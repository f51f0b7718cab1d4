#!/usr/bin/env bash
# Multi-node training under SLURM: one process per node, each owning that node's GPUs.
#
#   sbatch --nodes=4 --ntasks-per-node=1 --gpus-per-node=8 scripts/launch_slurm.sh \
#       --config=llama3-8b --tp=8 --fsdp=4 --data_path=/data/corpus_text_document --save=/ckpt/llama3-8b
#
# JAX reads the SLURM variables itself (jax.distributed.initialize auto-detects the coordinator, the number of
# processes and this process's id); mjax starts it whenever SLURM_NTASKS > 1. Every process runs the same command
# and feeds only its share of each global batch.
#SBATCH --job-name=mjax
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"

export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
export CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
PY=${MJAX_PY:-.venv/bin/python}

srun --kill-on-bad-exit=1 "$PY" scripts/train.py "$@"
