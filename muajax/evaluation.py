"""Policy evaluation: pass^k over tasks, partial score (TCR), confirm-before-write rate.

pass^k for one task with c successes in n trials is C(c, k) / C(n, k) (τ-bench's
estimator of "all k independent trials succeed"), averaged over tasks.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from math import comb
from typing import Any

from muajax.envs.base import Environment, Task
from muajax.rollout import RolloutOptions, run_rollouts_sync
from muajax.trajectory import Trajectory


def pass_hat_k(successes_per_task: Sequence[tuple[int, int]], k: int) -> float:
    """Mean over tasks of C(c, k) / C(n, k); tasks with fewer than k trials are an error."""
    values = []
    for c, n in successes_per_task:
        if n < k:
            raise ValueError(f"pass^{k} needs at least {k} trials per task, a task has {n}")
        values.append(comb(c, k) / comb(n, k))
    return sum(values) / len(values) if values else 0.0


def confirm_rate(trajectories: Sequence[Trajectory]) -> float | None:
    """Share of rollouts with at least one write whose writes were all confirmed first."""
    flags = [t.details.get("writes_confirmed") for t in trajectories]
    judged = [all(f) for f in flags if f]
    return sum(judged) / len(judged) if judged else None


def summarize(trajectories: Sequence[Trajectory], trials: int) -> dict[str, Any]:
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_task[t.task_id].append(t)
    counts = [(sum(1 for t in ts if t.reward >= 1.0), len(ts)) for ts in by_task.values()]
    tool_calls: Counter = Counter()
    for t in trajectories:
        tool_calls.update(t.tool_calls)
    n = max(len(trajectories), 1)
    out = {f"pass^{k}": pass_hat_k(counts, k) for k in range(1, trials + 1)}
    out.update(
        success=sum(t.reward >= 1.0 for t in trajectories) / n,
        partial=sum(t.partial for t in trajectories) / n,
        turns=sum(t.turns for t in trajectories) / n,
        confirm_rate=confirm_rate(trajectories),
        tasks=len(by_task),
        trials=trials,
        calls_per_tool={name: c / n for name, c in sorted(tool_calls.items())},
        terminations=dict(Counter(t.termination for t in trajectories)),
    )
    return out


def evaluate_policy(engine, tokenizer, env: Environment, user, tasks: Sequence[Task], *, trials: int = 1,
                    temperature: float = 0.0, options: RolloutOptions | None = None, seed: int = 0,
                    communicate_info: bool = True) -> tuple[dict[str, Any], list[Trajectory]]:
    opts = options or RolloutOptions()
    batch = run_rollouts_sync(engine, tokenizer, env, user, list(tasks), options=opts, seed=seed, n=trials,
                              temperature=temperature, communicate_info=communicate_info)
    return summarize(batch, trials), list(batch)
