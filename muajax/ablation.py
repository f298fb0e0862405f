"""`python -m muajax.ablation --seeds 0 1 2 [--config FILE] [--out DIR] [key=value ...]`: the
paper's three arms per seed (RL without cold start, SFT only, SFT then GRPO) on a run
config (default: the embedded CPU default), as a table of mean and spread over the seeds,
a PNG, and one JSON line at the end.

Each arm gives held-out success and the confirm-before-write rate, as mean and spread over seeds.

Each seed is two runs of `python -m muajax.train` (subprocesses, so each starts clean):
`run.stages=[grpo]` (RL without cold start) and `run.stages=[sft, grpo]`, whose evaluation
after SFT is the SFT-only arm: the same computation as a run that stops there.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any


ARMS = ("rl_only", "sft_only", "sft_grpo")
ARM_TITLES = {"rl_only": "RL without cold start", "sft_only": "cold start (SFT) only", "sft_grpo": "SFT then GRPO"}
FIGURES = ("success", "confirm_rate")


@dataclasses.dataclass(frozen=True)
class AblationRequest:
    seeds: tuple[int, ...]
    config: str | None = None  # None: the embedded default
    overrides: tuple[str, ...] = ()
    out_dir: str = "runs/ablation"


def _train(request: AblationRequest, seed: int, stages: str, name: str) -> dict[str, Any]:
    args = [sys.executable, "-m", "muajax.train", *(["--config", request.config] if request.config else []),
            *request.overrides, f"run.seed={seed}", f"run.stages={stages}", f"run.name={name}",
            f"run.out_dir={request.out_dir}", "metrics.progress_bar=false"]
    start = time.time()
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[1:])} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"[ablation] seed {seed} {stages}: {json.dumps({k: v for k, v in figures.items() if k != 'run_dir'})} "
          f"({time.time() - start:.0f}s)", flush=True)
    return figures


def seed_figures(request: AblationRequest, seed: int) -> dict[str, Any]:
    """One seed's three arms (and the never-write floor, when the domain has one)."""
    paper = _train(request, seed, "[sft, grpo]", f"seed{seed}-sft-grpo")
    rl = _train(request, seed, "[grpo]", f"seed{seed}-rl-only")
    return {"seed": seed, "floor_success": paper.get("floor_success"),
            "rl_only": {"success": rl["heldout_success_grpo"], "confirm_rate": rl["confirm_rate_grpo"]},
            "sft_only": {"success": paper["heldout_success_sft"], "confirm_rate": paper["confirm_rate_sft"]},
            "sft_grpo": {"success": paper["heldout_success_grpo"], "confirm_rate": paper["confirm_rate_grpo"]},
            "wall_s": {"sft_grpo": paper["wall_s"], "rl_only": rl["wall_s"]}}


def summarize(per_seed: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per arm and figure: mean, min and max over the seeds (None where a figure was undefined)."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for arm in ARMS:
        out[arm] = {}
        for figure in FIGURES:
            values = [s[arm][figure] for s in per_seed if s[arm][figure] is not None]
            out[arm][figure] = ({"mean": sum(values) / len(values), "min": min(values), "max": max(values),
                                 "n": len(values)} if values else {"mean": None, "min": None, "max": None, "n": 0})
    return out


def table(per_seed: Sequence[dict[str, Any]], stats: dict) -> str:
    def cell(s):
        return "n/a" if s["mean"] is None else f"{s['mean']:.3f} ({s['min']:.2f}–{s['max']:.2f})"

    rows = ["| arm | held-out success, mean (min–max) | confirm-before-write, mean (min–max) |", "|---|---|---|"]
    rows += [f"| {ARM_TITLES[a]} | {cell(stats[a]['success'])} | {cell(stats[a]['confirm_rate'])} |" for a in ARMS]
    floors = [s["floor_success"] for s in per_seed if s["floor_success"] is not None]
    if floors:
        rows.append(f"| never writes (floor) | {sum(floors) / len(floors):.3f} | — |")
    return "\n".join(rows)


def draw(per_seed: Sequence[dict[str, Any]], stats: dict, path: str) -> None:
    # matplotlib is heavy and its backend must be set before pyplot loads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, figure, title in zip(axes, FIGURES, ("held-out success", "confirm-before-write rate")):
        for i, arm in enumerate(ARMS):
            mean = stats[arm][figure]["mean"]
            if mean is not None:
                ax.bar(i, mean, color="#9ab", width=0.6)
            points = [s[arm][figure] for s in per_seed if s[arm][figure] is not None]
            ax.scatter([i] * len(points), points, color="#234", zorder=3, s=14)
        floors = [s["floor_success"] for s in per_seed if s["floor_success"] is not None]
        if figure == "success" and floors:
            ax.axhline(sum(floors) / len(floors), color="#c44", linestyle="--", label="never writes")
            ax.legend(loc="lower right")
        ax.set_xticks(range(len(ARMS)), [ARM_TITLES[a] for a in ARMS], fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_title(f"{title} over seeds {', '.join(str(s['seed']) for s in per_seed)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_ablation(request: AblationRequest) -> dict[str, Any]:
    os.makedirs(request.out_dir, exist_ok=True)
    per_seed = [seed_figures(request, seed) for seed in request.seeds]
    stats = summarize(per_seed)
    png = os.path.join(request.out_dir, "ablation.png")
    draw(per_seed, stats, png)
    result = {"seeds": list(request.seeds), "arms": stats, "per_seed": per_seed, "png": png,
              "table": table(per_seed, stats)}
    with open(os.path.join(request.out_dir, "ablation.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


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
