#!/usr/bin/env bash
# Stop a run started by gpu/launch_nodes.sh: SIGTERM to the recorded Python on every host (at
# once), which drops the rollouts in flight, saves the last finished step and exits 75 on
# every process (muajax.runtime.stopping). Waits up to STOP_TIMEOUT seconds (default 300) for
# each to exit, then SIGKILLs it with a message (its last finished checkpoint stays resumable).
#   HOSTS="gpu-node-1 gpu-node-2" gpu/stop_nodes.sh
set -euo pipefail
# shellcheck source=../scripts/dry_run.sh
source "$(dirname "$0")/../scripts/dry_run.sh"  # --dry-run: print the ssh commands instead
read -r -a hosts <<< "${HOSTS:?set HOSTS as for launch_nodes.sh}"
repo=$(cd "$(dirname "$0")/.." && pwd)
timeout=${STOP_TIMEOUT:-300}
stoppers=()
for rank in "${!hosts[@]}"; do
  run ssh "${hosts[$rank]}" "cd $(printf %q "$repo") && if [ -f muajax-$rank.pid ]; then
  pid=\$(cat muajax-$rank.pid)
  kill -TERM \$pid 2>/dev/null
  waited=0
  while kill -0 \$pid 2>/dev/null && [ \$waited -lt $timeout ]; do sleep 1; waited=\$((waited + 1)); done
  if kill -0 \$pid 2>/dev/null; then
    echo \"\$(hostname): rank $rank (pid \$pid) still running ${timeout}s after SIGTERM: SIGKILL; resume from its last finished checkpoint\"
    kill -KILL \$pid
  else
    echo \"\$(hostname): rank $rank stopped \${waited}s after SIGTERM: \$(tail -n 1 muajax-$rank.log)\"
  fi
  rm muajax-$rank.pid
fi" &
  stoppers+=($!)
done
status=0
for pid in "${stoppers[@]}"; do wait "$pid" || status=$?; done
exit $status
