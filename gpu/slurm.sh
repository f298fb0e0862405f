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
# `bash gpu/slurm.sh --dry-run CONFIG ...` with SLURM_JOB_ID, SLURM_JOB_NODELIST and
# SLURM_NNODES set prints the srun command and its environment.
set -euo pipefail
# sbatch runs a copy of this file (elsewhere): the repository is where the job was submitted from
repo=$(dirname "$0")/..
[[ -f "$repo/scripts/dry_run.sh" ]] || repo=${SLURM_SUBMIT_DIR:-.}
# shellcheck source=../scripts/dry_run.sh
source "$repo/scripts/dry_run.sh"
config=${1:?usage: sbatch gpu/slurm.sh CONFIG [key=value ...]}
shift
: "${SLURM_JOB_ID:?not in a SLURM job: submit with sbatch (--dry-run: set SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_NNODES)}"
head=$(ask HEAD_NODE scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
export MUAJAX_COORDINATOR="$head:${MUAJAX_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
export MUAJAX_NUM_PROCESSES="$SLURM_NNODES"
MUAJAX_LOCAL_DEVICE_IDS=$(seq -s, 0 $((gpus - 1)))
export MUAJAX_LOCAL_DEVICE_IDS
export PYTHON=${PYTHON:-python}
if [[ -n "$DRY_RUN" ]]; then
  echo "# environment: MUAJAX_COORDINATOR=$MUAJAX_COORDINATOR MUAJAX_NUM_PROCESSES=$MUAJAX_NUM_PROCESSES" \
    "MUAJAX_LOCAL_DEVICE_IDS=$MUAJAX_LOCAL_DEVICE_IDS PYTHON=$PYTHON"
fi
# The process id is the task's rank, known only inside each task.
run srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  bash -c 'MUAJAX_PROCESS_ID=$SLURM_PROCID exec "$PYTHON" -m muajax.train "$@"' muajax --config "$config" "$@"
