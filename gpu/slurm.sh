#!/usr/bin/env bash
#SBATCH --job-name=muajax
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --output=muajax-%j.log
# Multi-node muajax with jax's CUDA backend under SLURM: one process per node, driving all
# of that node's GPUs (see gpu/README.md for why not one per GPU).
#   sbatch --nodes=2 gpu/slurm.sh configs/runs/qwen3-8b-tau2-h100.yaml mesh.fsdp=16 [key=value ...]
# Run it from the repository on a filesystem every node mounts (checkpoints are written
# there by all processes together). PYTHON picks the interpreter (default: python on PATH).
set -euo pipefail
config=${1:?usage: sbatch gpu/slurm.sh CONFIG [key=value ...]}
shift
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
export MUAJAX_COORDINATOR="$head:${MUAJAX_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
export MUAJAX_NUM_PROCESSES="$SLURM_NNODES"
MUAJAX_LOCAL_DEVICE_IDS=$(seq -s, 0 $((gpus - 1)))
export MUAJAX_LOCAL_DEVICE_IDS
export PYTHON=${PYTHON:-python}
# The process id is the task's rank, known only inside each task.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  bash -c 'MUAJAX_PROCESS_ID=$SLURM_PROCID exec "$PYTHON" -m muajax.train "$@"' muajax --config "$config" "$@"
