#!/usr/bin/env bash
# Stop a run on every worker: SIGTERM to its Python (the child of the tpu/worker_run.sh that
# launch.sh recorded), which drops the rollouts in flight, saves the last finished step and
# exits 75 on every worker (muajax.runtime.stopping); then the wrapper copies the run
# directory to the bucket as after any run. Waits up to STOP_TIMEOUT seconds (default 300)
# for Python to exit, then SIGKILLs it with a message (its last finished checkpoint stays
# resumable). Continue later with RESUME=1 tpu/launch.sh ...
source "$(dirname "$0")/common.sh"
run=${RUN_NAME:?set RUN_NAME}
timeout=${STOP_TIMEOUT:-300}
tpu_ssh "pidfile=~/muajax-$run.pid
if [ -f \$pidfile ]; then
  wrapper=\$(cat \$pidfile)
  pids=\$(pgrep -P \$wrapper -f muajax.train)
  if [ -n \"\$pids\" ]; then
    kill -TERM \$pids
    waited=0
    while kill -0 \$pids 2>/dev/null && [ \$waited -lt $timeout ]; do sleep 1; waited=\$((waited + 1)); done
    if kill -0 \$pids 2>/dev/null; then
      echo \"\$(hostname): muajax.train (pid \$pids) still running ${timeout}s after SIGTERM: SIGKILL; resume from its last finished checkpoint\"
      kill -KILL \$pids
    else
      echo \"\$(hostname): muajax.train stopped \${waited}s after SIGTERM: \$(tail -n 1 ~/muajax-$run.log)\"
    fi
  fi
  waited=0
  while kill -0 \$wrapper 2>/dev/null && [ \$waited -lt 120 ]; do sleep 1; waited=\$((waited + 1)); done
  rm -f \$pidfile
fi"
