#!/usr/bin/env bash
# Create a TPU VM slice and wait until every worker is READY.
#   PROJECT=my-proj ZONE=europe-west4-b ACCELERATOR_TYPE=v5p-32 tpu/create.sh [--spot]
# Extra arguments go to `gcloud compute tpus tpu-vm create` (e.g. --spot, --network=...).
source "$(dirname "$0")/common.sh"

run gcloud compute tpus tpu-vm create "$TPU_NAME" --project "$PROJECT" --zone "$ZONE" \
  --accelerator-type "$ACCELERATOR_TYPE" --version "$RUNTIME_VERSION" "$@"

for _ in $(seq 60); do
  state=$(ask READY gcloud compute tpus tpu-vm describe "$TPU_NAME" --project "$PROJECT" --zone "$ZONE" --format='value(state)')
  [[ "$state" == READY ]] && break
  echo "waiting for $TPU_NAME ($state)"
  sleep 20
done
workers=$(ask N gcloud compute tpus tpu-vm describe "$TPU_NAME" --project "$PROJECT" --zone "$ZONE" \
  --format='value(networkEndpoints.len())')
echo "$TPU_NAME is $state with $workers workers; next: BUCKET=... tpu/setup.sh"
