#!/usr/bin/env bash
# Stop a run started by gpu/launch_nodes.sh (SIGTERM to the recorded process on every host).
#   HOSTS="gpu-node-1 gpu-node-2" gpu/stop_nodes.sh
set -euo pipefail
# shellcheck source=../scripts/dry_run.sh
source "$(dirname "$0")/../scripts/dry_run.sh"  # --dry-run: print the ssh commands instead
read -r -a hosts <<< "${HOSTS:?set HOSTS as for launch_nodes.sh}"
repo=$(cd "$(dirname "$0")/.." && pwd)
for rank in "${!hosts[@]}"; do
  run ssh "${hosts[$rank]}" "cd $(printf %q "$repo") && if [ -f muajax-$rank.pid ]; then kill \$(cat muajax-$rank.pid); rm muajax-$rank.pid; fi"
done
