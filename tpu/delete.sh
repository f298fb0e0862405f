#!/usr/bin/env bash
# Delete the slice (checkpoints and logs in the bucket stay).
source "$(dirname "$0")/common.sh"
run gcloud compute tpus tpu-vm delete "$TPU_NAME" --project "$PROJECT" --zone "$ZONE" --quiet
