"""`python -m muajax.train [--config FILE] [--resume[=auto]] [--allow-config-change] [key=value ...]`:
cold-start SFT, then GRPO.

With no arguments it runs the embedded CPU default (configs/embedded-cpu.yaml): a tiny
Qwen3-architecture model on the built-in shop domain with the scripted user, offline.
It prints held-out success and the confirm-before-write rate after SFT and after GRPO,
and ends with one JSON line of its figures.

Exit codes: 0 done; 2 a problem with the config or the resume, found before any file is
written (a bad key, no checkpoint for --resume, a saved config that differs in the math,
a checkpoint that does not fit, a missing API key); 1 the run stopped (a checkpoint that
cannot be read, too many non-finite steps), with a message; 3 too many of a step's
rollouts failed (`rollout.max_failed_share`: an endpoint or environment down; the run
can be resumed); 75 (`STOPPED_EXIT_CODE`) stopped on request: SIGTERM (tpu/stop.sh,
gpu/stop_nodes.sh, a spot VM's shutdown, a preemption notice) dropped the rollouts in flight
and saved the last finished step, on every process; continue with --resume
(`muajax.runtime.stopping`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

from muajax.settings.loader import dump_yaml
from muajax.config.schema import ConfigError, load_config
from muajax.domains.registry import DomainConfigError
from muajax.agent.rollout import RolloutsStopped
from muajax.runtime import stopping
from muajax.runtime.checkpoint import CheckpointError
from muajax.runtime.distributed import maybe_initialize_distributed
from muajax.train import gpu_memory
from muajax.train.grpo import FailedRolloutsError
from muajax.train.loop import TrainingStopped
from muajax.runtime.resume import ResumeError
from muajax.train.trainer import Trainer

EMBEDDED_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                                "embedded-cpu.yaml")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m muajax.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help=f"YAML run config (default: {os.path.relpath(EMBEDDED_DEFAULT)})")
    parser.add_argument("--resume", nargs="?", const="required", metavar="auto",
                        help="continue from the run's latest checkpoint (it must exist); --resume=auto starts fresh "
                             "when there is none")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume even though the config differs from the checkpoint's in keys that change the math")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.learning_rate=2e-6")
    args = parser.parse_args(argv)
    if args.resume not in (None, "required", "auto"):
        if "=" not in args.resume:
            parser.error(f"--resume takes no value or '=auto', got {args.resume!r}")
        args.overrides.insert(0, args.resume)  # `--resume key=value`: the override was taken as its value
        args.resume = "required"
    args.resume = args.resume or False
    return args


def main(argv: list[str] | None = None) -> int:
    start = time.time()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    path = args.config or EMBEDDED_DEFAULT
    try:
        cfg = load_config(path, args.overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"muajax.train: config error: {exc}", file=sys.stderr)
        return 2
    memory = gpu_memory.apply(cfg.run.gpu_memory_fraction)  # before jax's GPU client starts
    stopping.install()  # from here a SIGTERM stops the run cleanly
    maybe_initialize_distributed()
    stopping.install()  # again: jax's preemption notifier took SIGTERM over; the watcher starts
    try:
        return _run(args, cfg, path, memory, start)
    finally:
        stopping.uninstall()


def _run(args, cfg, path: str, memory, start: float) -> int:
    if jax.process_index() == 0:
        gpu_memory.announce(memory, jax.default_backend())
        print(f"# muajax.train config ({path})\n{dump_yaml(cfg)}", flush=True)
    try:
        trainer = Trainer(cfg, resume=args.resume, allow_config_change=args.allow_config_change, start_time=start)
    except (ConfigError, DomainConfigError) as exc:
        print(f"muajax.train: config error: {exc}", file=sys.stderr)
        return 2
    except ResumeError as exc:  # what only the files can tell: no checkpoint, another config, other shapes
        print(f"muajax.train: cannot resume: {exc}", file=sys.stderr)
        return 2
    try:
        summary = trainer.run()
    except CheckpointError as exc:  # unreadable (not corrupt), or nothing valid left: nothing was moved
        print(f"muajax.train: checkpoint error: {exc}", file=sys.stderr, flush=True)
        return 1
    except TrainingStopped as exc:
        print(f"muajax.train: {exc}", file=sys.stderr, flush=True)
        return 1
    except FailedRolloutsError as exc:  # an endpoint or environment down, not a bug: no traceback
        print(f"muajax.train: error: {exc}", file=sys.stderr, flush=True)
        return 3
    except (stopping.StopRequested, RolloutsStopped) as exc:  # SIGTERM, a preemption notice: nothing is lost
        print(f"muajax.train: {exc}. Continue with --resume (exit {stopping.STOPPED_EXIT_CODE}).", file=sys.stderr,
              flush=True)
        return stopping.STOPPED_EXIT_CODE
    if jax.process_index() == 0:
        print(json.dumps(summary, default=_jsonable), flush=True)
    return 0


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x)}")


if __name__ == "__main__":
    sys.exit(main())
