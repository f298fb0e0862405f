#!/usr/bin/env bash
# Runs on every TPU worker, started there by tpu/launch.sh: training, then worker 0 (the only
# one that writes run files) copies the run directory to the bucket.
#   tpu/worker_run.sh RUN BUCKET VENV [python -m muajax.train arguments ...]
cd "$(dirname "$0")/.."
# shellcheck source=../scripts/dry_run.sh
source scripts/dry_run.sh  # --dry-run: print the commands instead
run=$1 bucket=$2 venv=$3
shift 3
# shellcheck disable=SC1090
[[ -f ~/.muajax_env ]] && source ~/.muajax_env
export MUAJAX_DISTRIBUTED=auto
worker=$(ask 0 curl -s -H Metadata-Flavor:Google \
  http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number)
python=("$HOME/$venv/bin/python" -m muajax.train "$@")
if [[ -n "$DRY_RUN" ]]; then
  run "${python[@]}"
  status=$?
else
  # Python runs as this script's child, so that tpu/stop.sh can signal it (pgrep -P) and this
  # script can pass a SIGTERM of its own (a VM's shutdown) on to it. Either way Python drops
  # its rollouts, saves the last finished step and exits 75 (muajax.runtime.stopping); this
  # script waits for that exit, then copies the run directory as after any other.
  "${python[@]}" &
  child=$!
  trap 'kill -TERM "$child" 2>/dev/null' TERM INT
  wait "$child"
  status=$?
  while kill -0 "$child" 2>/dev/null; do  # a trapped signal ended `wait` early: wait for the exit
    wait "$child"
    status=$?
  done
  trap - TERM INT
fi
if [[ "$worker" == 0 && ( -d "runs/$run" || -n "$DRY_RUN" ) ]]; then
  run gcloud storage rsync -r "runs/$run" "gs://$bucket/$run/run"
fi
exit $status
