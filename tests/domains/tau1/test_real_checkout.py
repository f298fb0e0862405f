"""τ1-bench's own task files, from the checkout MUAJAX_TAU1_DIR names
(`git clone https://github.com/sierra-research/tau-bench`); skipped without one."""
from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import pytest  # noqa: E402

from muajax.agent.gold import replay_gold  # noqa: E402
from muajax.domains.tau1.environment import Tau1Environment  # noqa: E402

CHECKOUT = os.environ.get("MUAJAX_TAU1_DIR")
pytestmark = pytest.mark.skipif(not CHECKOUT, reason="MUAJAX_TAU1_DIR names no tau-bench checkout "
                                "(git clone https://github.com/sierra-research/tau-bench)")


def test_every_split_of_the_checkout_loads_onto_tau2():
    retail, airline = Tau1Environment("retail", CHECKOUT), Tau1Environment("airline", CHECKOUT)
    with pytest.warns(UserWarning, match="τ1 retail train: 24 of 500 tasks"):
        assert {k: v for k, v in retail.splits().items() if not k.startswith("tau2-")} == {
            "train": 500, "dev": 20, "test": 115}
    assert airline.splits()["test"] == 50
    train = retail.tasks("train")
    assert train[0].task_id == "tau1-train-0" and all(t.gold_actions for t in train)
    # τ2's retail tools take every τ1 gold call but the 24 that "modify" an item into itself
    flagged = [t for t in train if t.metadata["tau1_unmapped"]]
    assert all("keeps item" in p for t in flagged for p in t.metadata["tau1_unmapped"])


def test_the_first_train_tasks_gold_scores_1_on_tau2():
    env = Tau1Environment("retail", CHECKOUT, tools="tau2")
    replays = replay_gold(env, env.tasks("train")[:10])
    assert [r.reward for r in replays] == [1.0] * 10
