"""`python -m muajax.report RUN_DIR [--out PNG] [--dpi N]`: a run's training-dynamics panel.

Reads `RUN_DIR/metrics.jsonl` (one record per GRPO step, written by
`muajax.train.metrics.MetricsWriter`) and draws, against the GRPO step, the curves the paper
tracks: mean reward, the all-correct and all-wrong query ratios, turns per episode,
response length, calls per tool, KL, entropy and gradient norm. If `RUN_DIR/sft/metrics.jsonl`
exists, the cold-start SFT loss goes in the last panel (against the SFT step). The PNG goes
to `RUN_DIR/training_dynamics.png` unless `--out` says otherwise; its size in pixels is
fixed (15 × 12 inches times `--dpi`) so reports of different runs line up.

Input it tolerates:
- several records for one step: the last one in the file wins. MetricsWriter drops records
  past the checkpoint when a run resumes, so this happens when a run directory was reused
  without `--resume` (or an older writer appended); the report says how many were replaced.
- a metric no record has (an older run, or one the config turned off): its panel says
  "not logged".
- NaN or ±inf values: drawn as gaps; the summary uses the first and last finite value.
- a cut-off last line: skipped with a warning (as `read_metrics` does).
A missing or empty metrics file, or a run directory that does not exist, is an error: it
prints why and exits 2.

Output: one line per curve (first → last value) and, last, one JSON line with the PNG's
path and those figures (non-finite values as null).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from muajax.train.metrics import JSONL_NAME, read_metrics

__all__ = ["Series", "load_series", "summarize", "draw", "main", "PANELS", "DEFAULT_NAME"]

DEFAULT_NAME = "training_dynamics.png"
FIGSIZE = (15.0, 12.0)  # inches; 3 × 3 panels
EXIT_OK, EXIT_BAD_INPUT = 0, 2


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # metric keys drawn in this panel; a trailing '/' means "every key under it"
    ylabel: str = ""
    log_scale_if_wide: bool = False  # grad norm spans orders of magnitude: log y when it does


# The paper's per-step metrics (PAPER.md), by the key names trajectory.rollout_metrics and
# the GRPO step write. Order = reading order of the 3 × 3 grid; the SFT panel comes last.
PANELS: tuple[Panel, ...] = (
    Panel("mean reward", ("reward",), "reward"),
    Panel("all-correct / all-wrong query ratio", ("all_correct_ratio", "all_wrong_ratio"), "share of tasks"),
    Panel("turns per episode", ("turns",), "turns"),
    Panel("response length", ("response_tokens",), "sampled tokens / episode"),
    Panel("calls per tool", ("calls/",), "calls / episode"),
    Panel("KL to reference", ("kl",), "KL"),
    Panel("entropy", ("entropy",), "nats / token"),
    Panel("gradient norm", ("grad_norm",), "‖g‖", log_scale_if_wide=True),
)
SFT_PANEL = Panel("SFT loss (cold start)", ("loss",), "loss")


class ReportError(ValueError):
    """The run directory cannot be reported on."""


@dataclass
class Series:
    """Metric values by step after de-duplication (the last record of a step wins)."""

    steps: list[int]
    values: dict[str, list[float | None]]  # one entry per step; None where that step's record lacks it
    replaced: int = 0  # records overridden by a later record of the same step
    restarts: list[int] = field(default_factory=list)  # file lines (1-based records) where the step went back

    def keys_under(self, key: str) -> list[str]:
        if key.endswith("/"):
            return sorted(k for k in self.values if k.startswith(key))
        return [key] if key in self.values else []


def _number(value: Any) -> float | None:
    """A plottable float (NaN and ±inf included); anything else counts as not logged."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def load_series(directory: str) -> Series:
    """The records of `directory/metrics.jsonl`, one per step, ordered by step."""
    path = os.path.join(directory, JSONL_NAME)
    if not os.path.isfile(path):
        raise ReportError(f"{path}: no such file (is {directory} a muajax run directory?)")
    records = read_metrics(directory)
    if not records:
        raise ReportError(f"{path}: no metric records in it (empty, or no line parses)")
    by_step: dict[int, dict] = {}
    restarts, previous = [], None
    for index, rec in enumerate(records, 1):
        step = rec["step"]
        if previous is not None and step <= previous:
            restarts.append(index)
        previous = step
        by_step[step] = rec  # whole record replaced: a redone step's metrics belong together
    steps = sorted(by_step)
    keys = sorted({k for rec in by_step.values() for k in rec if k not in ("step", "wall_time")})
    values = {k: [_number(by_step[s].get(k)) for s in steps] for k in keys}
    # A key only ever logged as text has nothing to draw: it counts as not logged.
    values = {k: v for k, v in values.items() if any(x is not None for x in v)}
    return Series(steps, values, replaced=len(records) - len(steps), restarts=restarts)


def summarize(series: Series, key: str) -> dict[str, Any]:
    """{first, last, first_step, last_step, points, nonfinite} of one key's finite values.

    `points` counts finite values, `nonfinite` the NaN/±inf ones; steps whose record lacks
    the key count as neither. first/last are None when no value is finite.
    """
    vals = series.values[key]
    good = [(s, v) for s, v in zip(series.steps, vals) if v is not None and math.isfinite(v)]
    return {
        "first": good[0][1] if good else None,
        "last": good[-1][1] if good else None,
        "first_step": good[0][0] if good else None,
        "last_step": good[-1][0] if good else None,
        "points": len(good),
        "nonfinite": sum(1 for v in vals if v is not None and not math.isfinite(v)),
    }


def _fmt(x: float | None) -> str:
    if x is None:
        return "n/a"
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
        return f"{x:.3e}"
    return f"{x:.4g}"


def _draw_panel(ax, panel: Panel, series: Series | None, xlabel: str, missing_note: str) -> list[str]:
    """Draw one panel; returns the keys it drew (empty: the panel says why not)."""
    ax.set_title(panel.title, fontsize=11)
    keys = [k for want in panel.keys for k in (series.keys_under(want) if series else [])]
    if not keys:
        ax.text(0.5, 0.5, missing_note, ha="center", va="center", transform=ax.transAxes,
                fontsize=12, color="0.4")
        ax.set_xticks([])
        ax.set_yticks([])
        return []
    from matplotlib.ticker import MaxNLocator

    positive_span, bad_steps = [], set()
    for key in keys:
        # ±inf would stretch the axis to nothing; NaN leaves a gap where matplotlib meets it.
        ys = [v if v is not None and math.isfinite(v) else math.nan for v in series.values[key]]
        bad_steps.update(s for s, v in zip(series.steps, series.values[key]) if v is not None and not math.isfinite(v))
        label = key.split("/", 1)[1] if panel.keys[0].endswith("/") else key
        ax.plot(series.steps, ys, marker="o" if len(series.steps) <= 30 else None, markersize=3,
                linewidth=1.4, label=label)
        positive_span += [v for v in ys if math.isfinite(v)]
    # The whole step range even where a curve ends in NaN, so the panels line up.
    pad = max(0.5, 0.02 * (series.steps[-1] - series.steps[0]))
    ax.set_xlim(series.steps[0] - pad, series.steps[-1] + pad)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if bad_steps:  # a gap alone is easy to miss
        shown = sorted(bad_steps)
        listing = ", ".join(map(str, shown[:6])) + (", ..." if len(shown) > 6 else "")
        ax.text(0.01, 0.01, f"NaN/inf at step {listing}", transform=ax.transAxes, fontsize=8,
                color="tab:red", ha="left", va="bottom")
    if panel.log_scale_if_wide and positive_span and min(positive_span) > 0 \
            and max(positive_span) / min(positive_span) > 100:
        ax.set_yscale("log")
    if len(keys) > 1:
        ax.legend(fontsize=8, loc="best")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(panel.ylabel)
    ax.grid(True, alpha=0.3)
    return keys


def draw(grpo: Series, sft: Series | None, out: str, *, title: str, dpi: int = 100) -> dict[str, list[str]]:
    """Write the 3 × 3 panel PNG to `out`; returns {"drawn": keys, "not_logged": keys}."""
    # The Figure API with no pyplot: no global backend switch or figure registry, so this
    # is safe to call from a process that has set up matplotlib otherwise.
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=dpi)
    axes = fig.subplots(3, 3).ravel()
    drawn, not_logged = [], []
    for ax, panel in zip(axes, PANELS):
        keys = _draw_panel(ax, panel, grpo, "GRPO step", "not logged")
        drawn += keys
        if not keys:
            not_logged += [k + "*" if k.endswith("/") else k for k in panel.keys]
    sft_keys = _draw_panel(axes[-1], SFT_PANEL, sft, "SFT step",
                           "not logged" if sft is not None else "no SFT stage\n(sft/metrics.jsonl absent)")
    drawn += [f"sft/{k}" for k in sft_keys]
    if sft is not None and not sft_keys:
        not_logged.append("sft/loss")
    fig.suptitle(title, fontsize=13)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    # Fixed figure size and no bbox_inches='tight': the PNG is always FIGSIZE × dpi pixels.
    fig.savefig(out, format="png", dpi=dpi)
    return {"drawn": drawn, "not_logged": not_logged}


def report(run_dir: str, out: str | None = None, *, dpi: int = 100) -> dict[str, Any]:
    """Draw the panel, print the per-curve summary lines; returns the JSON-line payload."""
    if not os.path.isdir(run_dir):
        raise ReportError(f"{run_dir}: no such run directory")
    if not isinstance(dpi, int) or not 20 <= dpi <= 600:
        raise ReportError(f"--dpi must be an int in [20, 600], got {dpi!r}")
    out = out or os.path.join(run_dir, DEFAULT_NAME)
    if not out.lower().endswith(".png"):
        raise ReportError(f"--out {out}: the report is a PNG, so the file name must end in .png")
    grpo = load_series(run_dir)
    sft_dir = os.path.join(run_dir, "sft")
    sft = None
    if os.path.isfile(os.path.join(sft_dir, JSONL_NAME)):
        try:
            sft = load_series(sft_dir)
        except ReportError as e:  # the GRPO curves are still worth drawing
            warnings.warn(f"SFT curve left out: {e}", RuntimeWarning, stacklevel=2)
    if grpo.replaced:
        print(f"note: {grpo.replaced} record(s) of an already-logged step replaced by a later one "
              f"(the step count went back at record(s) {', '.join(map(str, grpo.restarts[:5]))})")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    title = (f"{os.path.basename(os.path.abspath(run_dir))}: GRPO steps {grpo.steps[0]}–{grpo.steps[-1]}"
             + (f", SFT steps {sft.steps[0]}–{sft.steps[-1]}" if sft else ""))
    panels = draw(grpo, sft, out, title=title, dpi=dpi)
    figures: dict[str, Any] = {}
    for key in panels["drawn"]:
        source, name = (sft, key[4:]) if key.startswith("sft/") else (grpo, key)
        figures[key] = s = summarize(source, name)
        extra = f", {s['nonfinite']} non-finite" if s["nonfinite"] else ""
        print(f"{key}: {_fmt(s['first'])} → {_fmt(s['last'])} "
              f"(steps {s['first_step']}–{s['last_step']}, {s['points']} points{extra})")
    for key in panels["not_logged"]:
        print(f"{key}: not logged")
    return {"png": os.path.abspath(out), "grpo_steps": len(grpo.steps), "sft_steps": len(sft.steps) if sft else 0,
            "replaced_records": grpo.replaced, "not_logged": panels["not_logged"], "figures": figures}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m muajax.report", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a muajax run directory (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help=f"PNG to write (default: RUN_DIR/{DEFAULT_NAME})")
    parser.add_argument("--dpi", type=int, default=100, help="pixels per inch; the figure is 15 × 12 inches")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = report(args.run_dir, args.out, dpi=args.dpi)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        print(json.dumps({"png": None, "error": str(e)}), flush=True)
        return EXIT_BAD_INPUT
    print(json.dumps(result, allow_nan=False), flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
