"""`python -m muajax.ablation --seeds 0 1 2 [--config FILE] [--out DIR] [key=value ...]`: the
paper's three arms per seed (RL without cold start, SFT only, SFT then GRPO) on a run
config (default: the embedded CPU default), as a table of mean and spread over the seeds,
a PNG, and one JSON line at the end.
"""
from __future__ import annotations

import argparse
import json
import sys

from muajax.train.ablation import AblationRequest, run_ablation


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m muajax.ablation", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run.seed values (default 0 1 2)")
    p.add_argument("--config", help="a run config (default: the embedded CPU default)")
    p.add_argument("--out", default="runs/ablation", help="where the runs, ablation.json and ablation.png go")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. grpo.steps=4")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        p.error("--seeds must be distinct non-negative integers")
    try:
        result = run_ablation(AblationRequest(tuple(args.seeds), args.config, tuple(args.overrides), args.out))
    except RuntimeError as e:
        print(f"muajax.ablation: {e}", file=sys.stderr, flush=True)
        return 1
    print(result["table"], flush=True)
    print(f"chart: {result['png']}", flush=True)
    print(json.dumps({k: v for k, v in result.items() if k != "table"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
