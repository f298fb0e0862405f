#!/usr/bin/env bash
# Multi-node muajax without a scheduler: start one process per host over ssh, the first host
# being the coordinator. Every host needs this repository at the same path (a shared
# filesystem, which the checkpoints also need) and the same Python environment.
#   HOSTS="gpu-node-1 gpu-node-2" gpu/launch_nodes.sh configs/runs/qwen3-8b-tau2-h100.yaml mesh.fsdp=16
# Each host logs to muajax-RANK.log in the repository; stop a run with gpu/stop_nodes.sh.
# PORT (default 29431) must be free on the first host; PYTHON defaults to python on PATH;
# SECRETS="OPENAI_API_KEY" forwards those variables through ssh's standard input, never a command line.
# --dry-run prints the ssh commands and what each reads (the secrets' values left out).
set -euo pipefail
# shellcheck source=../scripts/dry_run.sh
source "$(dirname "$0")/../scripts/dry_run.sh"
config=${1:?usage: HOSTS="h1 h2" gpu/launch_nodes.sh CONFIG [key=value ...]}
shift
read -r -a hosts <<< "${HOSTS:?set HOSTS to the nodes, the coordinator first}"
repo=$(cd "$(dirname "$0")/.." && pwd)
coordinator="${hosts[0]}:${PORT:-29431}"
args=$(printf ' %q' --config "$config" "$@")
secrets=""
for name in ${SECRETS:-}; do
  value=${!name:?SECRETS names $name, which is not set here}
  if [[ -n "$DRY_RUN" ]]; then value=...; fi  # never printed
  secrets+="export $name=$(printf %q "$value")"$'\n'
done
for rank in "${!hosts[@]}"; do
  # the remote shell reads the secrets, then the command, from standard input
  run_with_input "$secrets""cd $(printf %q "$repo") || exit 1
MUAJAX_COORDINATOR=$coordinator MUAJAX_NUM_PROCESSES=${#hosts[@]} MUAJAX_PROCESS_ID=$rank \
  nohup ${PYTHON:-python} -m muajax.train$args > muajax-$rank.log 2>&1 < /dev/null &
echo \$! > muajax-$rank.pid
" ssh "${hosts[$rank]}" bash -s
  [[ -n "$DRY_RUN" ]] || echo "${hosts[$rank]}: rank $rank started"
done
echo "process 0 prints the metrics: tail -f $repo/muajax-0.log"
