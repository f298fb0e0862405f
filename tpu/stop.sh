#!/usr/bin/env bash
# Stop a run on every worker (SIGTERM to the process launch.sh recorded; orbax's preemption
# policy saves a checkpoint when it can). Continue later with RESUME=1 tpu/launch.sh ...
source "$(dirname "$0")/common.sh"
run=${RUN_NAME:?set RUN_NAME}
tpu_ssh "if [ -f ~/muajax-$run.pid ]; then pkill -TERM -P \$(cat ~/muajax-$run.pid); kill \$(cat ~/muajax-$run.pid); rm ~/muajax-$run.pid; fi"
