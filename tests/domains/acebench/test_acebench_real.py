"""ACEBench's own checkout, when MUAJAX_ACEBENCH_DIR names one (git clone
https://github.com/ACEBench/ACEBench): every English Agent item loads, builds its sandbox from
ACEBench's classes, and its milestones replayed reach the ground truth, except the items
whose own data disagree (each listed below with ACEBench's reason; checked at its head of
2026-11, commit e6db74b)."""
from __future__ import annotations

import os

import pytest

from muajax.agent.gold import replay_gold
from muajax.domains.acebench.environment import AceBenchEnvironment

ROOT = os.environ.get("MUAJAX_ACEBENCH_DIR")
pytestmark = pytest.mark.skipif(not ROOT, reason="MUAJAX_ACEBENCH_DIR does not name an ACEBench checkout "
                                                 "(git clone https://github.com/ACEBench/ACEBench)")

# The milestones of these items do not lead to their ground truth, by ACEBench's own data:
DATA_DISAGREES = {
    "agent_multi_turn_6": "the device starts logged out and the milestones never call login_device",
    "agent_multi_step_0": "the milestone orders 'Super Supreme', the menu and ground truth 'Super Supreme Pizza'",
    "agent_multi_step_1": "the milestone orders 'Super Supreme', the menu and ground truth 'Super Supreme Pizza'",
    "agent_multi_step_12": "the milestones never call login_food_platform before ordering",
    "agent_multi_step_13": "the milestones never call login_food_platform before ordering",
    "agent_multi_step_14": "the milestones delete the earliest message and end the text with '.', the ground truth "
                           "keeps it (the instruction says: delete the most recent) and has no '.'",
    "agent_multi_step_15": "as agent_multi_step_14",
    "agent_multi_step_16": "the device starts logged out and the milestones never call login_device",
    "agent_multi_step_17": "as agent_multi_step_14",
}


def test_the_english_agent_items_replay_to_their_ground_truth():
    env = AceBenchEnvironment(ROOT, "en")
    assert (len(env.tasks("multi_turn")), len(env.tasks("multi_step"))) == (30, 20)
    replays = replay_gold(env, env.tasks("test"))
    missed = {r.task_id for r in replays if r.reward < 1.0}
    assert missed <= set(DATA_DISAGREES), sorted(missed - set(DATA_DISAGREES))
    assert sum(r.reward for r in replays) >= 50 - len(DATA_DISAGREES)
    assert all(r.errors == 0 for r in replays)
