# Shared settings for the tpu/*.sh scripts (sourced, not run). Override any of them in the
# environment, e.g. `TPU_NAME=rl-32 ZONE=us-east5-a tpu/create.sh`. Every script takes
# --dry-run: it prints the commands it would run (scripts/dry_run.sh) and exits 0.
set -euo pipefail
# shellcheck source=../scripts/dry_run.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/dry_run.sh"

: "${PROJECT:=$(ask PROJECT gcloud config get-value project 2>/dev/null)}"
: "${TPU_NAME:=muajax}"
: "${ZONE:=europe-west4-b}"
: "${ACCELERATOR_TYPE:=v5p-32}"          # 16 chips on 4 hosts (configs/runs/qwen3-8b-tau2-v5p.yaml)
: "${RUNTIME_VERSION:=v2-alpha-tpuv5}"  # v6e: v2-alpha-tpuv6e; v4: tpu-ubuntu2204-base
: "${BUCKET:=}"                         # gs://BUCKET without the prefix: checkpoints, model, run logs
: "${REMOTE_DIR:=muajax}"               # the repository's copy on every worker, under $HOME
: "${VENV:=muajax-venv}"                # Python 3.11 virtualenv on every worker, under $HOME

if [[ -z "$PROJECT" ]]; then
  echo "set PROJECT (or run: gcloud config set project ID)" >&2
  exit 2
fi

# Run a shell command on every worker of the slice at once (or WORKER=N for one).
tpu_ssh() {
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project "$PROJECT" --zone "$ZONE" \
    --worker="${WORKER:-all}" --command "$1"
}

# Copy local files to $HOME on every worker.
tpu_scp() {
  run gcloud compute tpus tpu-vm scp "$@" "$TPU_NAME": --project "$PROJECT" --zone "$ZONE" --worker=all
}

need_bucket() {
  if [[ -z "$BUCKET" ]]; then
    echo "set BUCKET to a GCS bucket name in the slice's region (checkpoints and logs go there)" >&2
    exit 2
  fi
}
