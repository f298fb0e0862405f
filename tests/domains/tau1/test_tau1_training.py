"""Two GRPO steps on τ1 tasks (the fixture checkout's retail train split) with the simulated
user at a local endpoint, evaluated on τ2's retail test split: `configs/smoke-tau2.yaml` with
`env.domain=tau1-retail`, through `python -m muajax.train` as a user runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from muajax.domains.tau1.environment import Tau1Environment
from tests.domains.tau1.checkout import CANCEL, RETURN, write_checkout
from tests.support.gold_script import GoldScript
from tests.support.openai_server import ScriptedOpenAIServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_grpo_trains_on_tau1_tasks_and_evaluates_on_tau2(tmp_path):
    checkout = write_checkout(tmp_path / "tau-bench", train=(CANCEL, RETURN), test=())
    env = Tau1Environment("retail", checkout)
    train = env.tasks("train")
    with ScriptedOpenAIServer(GoldScript(train + env.tasks("tau2-test"))) as server:
        result = subprocess.run(
            [sys.executable, "-m", "muajax.train", "--config", os.path.join(ROOT, "configs", "smoke-tau2.yaml"),
             f"user.base_url={server.url}", "user.model=M", "env.domain=tau1-retail", "env.domains=[]",
             f"env.tau1_dir={checkout}", "env.eval_split=tau2-test", "env.max_train_tasks=2", "run.stages=[grpo]",
             f"run.out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=900,
            env=dict(os.environ, JAX_PLATFORMS="cpu"))
        users = [r.body["messages"][0]["content"] for r in server.chat_requests if not r.body.get("tools")]
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    steps = [json.loads(line) for line in open(os.path.join(summary["run_dir"], "metrics.jsonl"))]
    assert len(steps) == 2 and all(s["failed_rollouts"] == 0 and s["num_seqs"] == 4 for s in steps)
    assert "heldout_success_grpo" in summary
    # the users of the GRPO steps played τ1's instructions, those of the evaluation τ2's scenarios
    for task in train:
        assert any(task.user_scenario.strip() in u for u in users), task.task_id
    assert any(t.user_scenario.strip() in u for t in env.tasks("tau2-test")[:2] for u in users)
