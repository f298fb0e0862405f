#!/usr/bin/env bash
# Show a run's log on one worker (default worker 0, the one that prints metrics and the summary).
#   RUN_NAME=qwen3-8b-tau2-v5p tpu/logs.sh            # the last 50 lines
#   RUN_NAME=... FOLLOW=1 WORKER=2 tpu/logs.sh        # follow worker 2's log
source "$(dirname "$0")/common.sh"
run=${RUN_NAME:?set RUN_NAME (the config file name without .yaml, unless launch.sh was given another)}
WORKER=${WORKER:-0} tpu_ssh "tail -n ${LINES:-50} ${FOLLOW:+-f} ~/muajax-$run.log"
