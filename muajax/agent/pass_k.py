"""Policy evaluation: pass^k over tasks, partial score (TCR), confirm-before-write rate, and
the per-task JSON record of every rollout.

pass^k for one task with c successes in n trials is C(c, k) / C(n, k) (τ-bench's
estimator of "all k independent trials succeed"), averaged over tasks. A task is its
(domain, task id): τ2's domains reuse ids ("0" is a retail and an airline task).
Several domains are summarized each on its own (`summarize_domains`), never pooled.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Sequence
from math import comb
from typing import Any

from muajax.agent.rollout import run_rollouts_sync
from muajax.agent.rollout_config import RolloutConfig
from muajax.agent.trajectory import Trajectory, confirm_rate
from muajax.domains.base import Domain, Task


def task_pass_hat_k(successes: int, trials: int, k: int) -> float:
    """C(c, k) / C(n, k): the chance that k of one task's n trials, drawn without
    replacement, all succeeded."""
    if trials < k:
        raise ValueError(f"pass^{k} needs at least {k} trials per task, a task has {trials}")
    return comb(successes, k) / comb(trials, k)


def pass_hat_k(successes_per_task: Sequence[tuple[int, int]], k: int) -> float:
    """Mean over tasks of C(c, k) / C(n, k); tasks with fewer than k trials are an error."""
    values = [task_pass_hat_k(c, n, k) for c, n in successes_per_task]
    return sum(values) / len(values) if values else 0.0


def by_task(trajectories: Sequence[Trajectory]) -> dict[tuple[str, str], list[Trajectory]]:
    """Trajectories grouped by (domain, task id) (first-seen order), each group by rollout index."""
    groups: dict[tuple[str, str], list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        groups[(t.domain, t.task_id)].append(t)
    return {key: sorted(ts, key=lambda t: t.rollout_index) for key, ts in groups.items()}


def summarize(trajectories: Sequence[Trajectory], trials: int) -> dict[str, Any]:
    groups = by_task(trajectories)
    counts = [(sum(1 for t in ts if t.reward >= 1.0), len(ts)) for ts in groups.values()]
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
        tasks=len(groups),
        trials=trials,
        calls_per_tool={name: c / n for name, c in sorted(tool_calls.items())},
        terminations=dict(Counter(t.termination for t in trajectories)),
    )
    return out


def summarize_domains(trajectories: Sequence[Trajectory], trials: int, *,
                      twins: Callable[[str], Collection[str]] | None = None) -> dict[str, dict[str, Any]]:
    """`summarize` per domain (first-seen order). With `twins(domain)` (test task ids that
    have a train twin, `muajax.domains.tau2.twins`), a domain with twins among its tasks
    also gets `dedup`: its task count, pass^k and success without them."""
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        groups[t.domain].append(t)
    out = {}
    for domain, ts in groups.items():
        summary = summarize(ts, trials)
        removed = sorted(set(twins(domain)) & {t.task_id for t in ts}) if twins is not None else []
        if removed:
            kept = summarize([t for t in ts if t.task_id not in removed], trials)
            summary["dedup"] = {"tasks": kept["tasks"], "removed": removed, "success": kept["success"],
                                **{f"pass^{k}": kept[f"pass^{k}"] for k in range(1, trials + 1)}}
        out[domain] = summary
    return out


def rollout_record(t: Trajectory) -> dict[str, Any]:
    """One rollout as JSON: its outcome, counters and the whole conversation."""
    return {"rollout_index": t.rollout_index, "reward": t.reward, "partial": t.partial,
            "termination": t.termination, "error": t.error, "turns": t.turns,
            "assistant_turns": t.assistant_turns, "truncated_turns": t.truncated_turns,
            "malformed_calls": t.malformed_calls, "tool_calls": dict(t.tool_calls), "details": t.details,
            "sampled_tokens": t.num_sampled, "wall_s": round(t.wall_s, 3), "messages": t.messages}


def task_records(trajectories: Sequence[Trajectory], trials: int) -> list[dict[str, Any]]:
    """Per task: successes, pass^k for k up to its trials, mean partial score, and its rollouts."""
    records = []
    for (domain, task_id), ts in by_task(trajectories).items():
        c = sum(t.reward >= 1.0 for t in ts)
        records.append({
            "task_id": task_id, "domain": domain, "successes": c, "trials": len(ts),
            "pass_hat": {str(k): task_pass_hat_k(c, len(ts), k) for k in range(1, min(trials, len(ts)) + 1)},
            "mean_partial": sum(t.partial for t in ts) / len(ts),
            "rollouts": [rollout_record(t) for t in ts],
        })
    return records


def evaluation_summary(trajectories: Sequence[Trajectory], trials: int) -> dict[str, Any]:
    """`summarize` over all, and `by_domain` when the tasks span several domains."""
    summary = summarize(trajectories, trials)
    domains = summarize_domains(trajectories, trials)
    if len(domains) > 1:
        summary["by_domain"] = domains
    return summary


def evaluate_policy(engine, tokenizer, domain: Domain, tasks: Sequence[Task], *, trials: int = 1,
                    temperature: float = 0.0, options: RolloutConfig | None = None, seed: int = 0,
                    communicate_info: bool = True,
                    first_task_index: int = 0) -> tuple[dict[str, Any], list[Trajectory]]:
    """Roll out every task `trials` times and summarize (`evaluation_summary`); the options'
    other settings (turns, context, ...) stay as given. `tasks` may be one process's share
    of an evaluation that starts at task `first_task_index` (the seeds are then the whole
    evaluation's); its summary is of that share."""
    batch = run_rollouts_sync(engine, tokenizer, domain.env, domain.user, list(tasks), options=options, seed=seed,
                              n_per_task=trials, temperature=temperature, communicate_info=communicate_info,
                              first_task_index=first_task_index)
    return evaluation_summary(batch, trials), list(batch)
