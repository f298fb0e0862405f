"""A run's tasks and how many conversations its engine holds at once, from its config and
its domain's environment: the trainer's `RunContext` and the planner both ask here.

The engine holds this process's share of a GRPO step's conversations at once, or without
`rollout.num_slots` the larger of that and its share of the evaluation's (trials x its
held-out tasks: `muajax.runtime.distributed.evaluation_share` gives a process at most
ceil(tasks / processes)). With `rollout.num_slots` set, that is the cap: the
conversations beyond it, the evaluation's included, queue for a slot (`muajax.agent.rollout`)."""
from __future__ import annotations

import collections


def train_tasks(cfg, env) -> list:
    """The train split; with `env.max_train_tasks`, the first N tasks of each domain."""
    tasks, cap = env.tasks(cfg.env.train_split), cfg.env.max_train_tasks
    if cap is None:
        return tasks
    kept, per_domain = [], collections.Counter()
    for task in tasks:
        if per_domain[task.domain] < cap:
            per_domain[task.domain] += 1
            kept.append(task)
    return kept


def eval_tasks(cfg, env) -> list:
    tasks = env.tasks(cfg.env.eval_split)
    return tasks[: cfg.eval.max_tasks] if cfg.eval.max_tasks else tasks


def eval_trials(cfg) -> int:
    return 1 if cfg.eval.temperature == 0 else cfg.eval.trials


def rollout_slots(cfg, processes: int) -> int:
    """One process's share of a GRPO step's conversations open at once."""
    r = cfg.rollout
    return -(-(r.num_slots or r.n_per_task * r.tasks_per_step) // processes)


def engine_slots(cfg, env, processes: int) -> int:
    """Slots for one process's share of a GRPO step and, unless `rollout.num_slots` caps
    them, for its share of the evaluation."""
    if cfg.rollout.num_slots is not None:
        return rollout_slots(cfg, processes)
    return max(rollout_slots(cfg, processes), eval_conversations(cfg, env, processes))


def eval_conversations(cfg, env, processes: int = 1) -> int:
    """The evaluation's conversations on the process with the largest share (all of them
    with one process)."""
    return eval_trials(cfg) * -(-len(eval_tasks(cfg, env)) // processes)
