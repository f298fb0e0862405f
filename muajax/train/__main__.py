"""`python -m muajax.train [--config FILE] [--resume] [key=value ...]`: cold-start SFT, then GRPO.

With no arguments it runs the embedded CPU default (configs/embedded-cpu.yaml): a tiny
Qwen3-architecture model on the built-in shop domain with the scripted user, offline.
It prints held-out success and the confirm-before-write rate after SFT and after GRPO,
and ends with one JSON line of its figures. Exit codes: 2 for a config error, 3 when too
many of a step's rollouts failed (`rollout.max_failed_share`; the run can be resumed).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

from muajax.config.loader import dump_yaml
from muajax.config.schema import ConfigError, load_config
from muajax.domains.registry import DomainConfigError
from muajax.train.distributed import maybe_initialize_distributed
from muajax.train.grpo import FailedRolloutsError
from muajax.train.trainer import Trainer

EMBEDDED_DEFAULT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                                "embedded-cpu.yaml")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m muajax.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help=f"YAML run config (default: {os.path.relpath(EMBEDDED_DEFAULT)})")
    parser.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.learning_rate=2e-6")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    start = time.time()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    path = args.config or EMBEDDED_DEFAULT
    try:
        cfg = load_config(path, args.overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"muajax.train: config error: {exc}", file=sys.stderr)
        return 2
    maybe_initialize_distributed()
    if jax.process_index() == 0:
        print(f"# muajax.train config ({path})\n{dump_yaml(cfg)}", flush=True)
    try:
        trainer = Trainer(cfg, resume=args.resume, start_time=start)
    except (ConfigError, DomainConfigError) as exc:  # what only the files can tell: a checkpoint that does not fit the run
        print(f"muajax.train: config error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = trainer.run()
    except FailedRolloutsError as exc:  # an endpoint or environment down, not a bug: no traceback
        print(f"muajax.train: error: {exc}", file=sys.stderr, flush=True)
        return 3
    if jax.process_index() == 0:
        print(json.dumps(summary, default=_jsonable), flush=True)
    return 0


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x)}")


if __name__ == "__main__":
    sys.exit(main())
