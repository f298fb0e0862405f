#!/usr/bin/env bash
# Start `python -m muajax.train` on every worker of the slice at once, in the background (it
# survives this ssh session); the output goes to ~/muajax-RUN.log on each worker.
#   BUCKET=my-bucket tpu/launch.sh configs/runs/qwen3-8b-tau2-v5p.yaml [key=value ...]
# RESUME=1 continues from the latest checkpoint. RUN_NAME (default: the config's file name)
# names the run; CKPT_DIR (default gs://$BUCKET/RUN/checkpoints) is where every worker writes
# its shards of each checkpoint. run.out_dir stays local: only worker 0 writes the metrics and
# eval files there, and copies them to gs://$BUCKET/RUN/run when training ends.
source "$(dirname "$0")/common.sh"
need_bucket
config=${1:?usage: tpu/launch.sh CONFIG [key=value ...]}
shift
run=${RUN_NAME:-$(basename "$config" .yaml)}
ckpt=${CKPT_DIR:-gs://$BUCKET/$run/checkpoints}

args="--config $(printf %q "$config") run.out_dir=runs run.name=$run checkpoint.dir=$(printf %q "$ckpt")"
for a in "$@"; do args+=" $(printf %q "$a")"; done
if [[ -n "${RESUME:-}" ]]; then args+=" --resume"; fi

# Every worker must write to the same place: refuse a checkpoint.dir the Checkpointer would
# turn into a per-host local path (muajax before URL support did that to gs:// paths). Making
# the Checkpointer also opens the directory through orbax, so a bucket worker 0 cannot reach
# fails here, before the workers start.
WORKER=0 tpu_ssh "cd ~/$REMOTE_DIR && JAX_PLATFORMS=cpu ~/$VENV/bin/python -c '
import sys
from muajax.runtime.checkpoint import Checkpointer
want = sys.argv[1]
got = str(Checkpointer(want).directory)
if want.startswith(\"gs://\") and not got.startswith(\"gs://\"):
    sys.exit(f\"this muajax Checkpointer turns {want} into the local path {got}: use MOUNT_BUCKET=1 tpu/setup.sh \"
             f\"and CKPT_DIR=/mnt/gcs/BUCKET/..., or a muajax whose Checkpointer keeps URLs\")
' $(printf %q "$ckpt")"

tpu_ssh "cd ~/$REMOTE_DIR
  nohup tpu/worker_run.sh $run $BUCKET $VENV $args > ~/muajax-$run.log 2>&1 < /dev/null &
  echo \$! > ~/muajax-$run.pid
  echo \"\$(hostname): started (pid \$(cat ~/muajax-$run.pid))\""
echo "follow it with: RUN_NAME=$run tpu/logs.sh"
