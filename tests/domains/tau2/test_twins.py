"""τ2's split twins: the list issue 19 found by hand, and a check on muajax's conversion of
τ2's tasks (the gold actions a rollout is scored against) that nothing else is a twin."""
from __future__ import annotations

import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import pytest  # noqa: E402

from muajax.domains.tau2.environment import DOMAINS, Tau2Environment  # noqa: E402
from muajax.domains.tau2.twins import split_twins, twin_ids  # noqa: E402

# The twins issue 19 found by hand: test task -> its train twin.
ISSUE_TWINS = {"retail": {"42": ("41",), "71": ("72",), "97": ("96",)},
               "airline": {"16": ("15",), "22": ("17",), "48": ("49",)},
               "telecom": {}}


def gold(task) -> str:
    """A muajax task's gold actions, with who acts, as muajax's rollouts are scored on them."""
    return json.dumps([[who, a.name, a.arguments] for who, a in
                       zip(task.metadata["gold_action_requestors"], task.gold_actions)], sort_keys=True)


@pytest.mark.parametrize("domain", DOMAINS)
def test_the_twins_are_the_test_tasks_whose_gold_a_train_task_has(domain):
    found = split_twins(domain)
    assert found == ISSUE_TWINS[domain]
    assert twin_ids(domain) == frozenset(found)
    env = Tau2Environment(domain)
    train_gold: dict[str, list[str]] = {}
    for task in env.tasks("train"):
        train_gold.setdefault(gold(task), []).append(task.task_id)
    for task in env.tasks("test"):
        same = train_gold.get(gold(task), [])
        if task.task_id in found:  # every twin really has a train task with the same gold actions
            assert sorted(found[task.task_id]) == sorted(same) and "DB" in task.metadata["reward_basis"]
            assert task.gold_actions
        else:  # and nothing is missed but empty golds (no case to recall) and tasks not scored on the DB
            assert not same or not task.gold_actions or "DB" not in task.metadata["reward_basis"], task.task_id
    assert twin_ids("bfcl") == frozenset()
    with pytest.raises(ValueError, match="unknown τ2 domain"):
        split_twins("bfcl")
