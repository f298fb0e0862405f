"""The paper's main path end to end on τ2, with a tiny model, against a real HTTP endpoint
started here that plays the simulated user (and, for synth, the agent replaying gold
actions): synth on τ2 retail → SFT on that file → two GRPO steps on retail + airline →
`python -m muajax.eval --protocol tau2` on 2 tasks. The training part is `configs/smoke-tau2.yaml`, run as the README
says (`python -m muajax.train --config configs/smoke-tau2.yaml user.base_url=URL user.model=M`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from muajax import synth
from muajax.domains.tau2.environment import Tau2Environment
from tests.support.gold_script import GoldScript
from tests.support.openai_server import ScriptedOpenAIServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "smoke-tau2.yaml")


def command(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def last_json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_synth_sft_grpo_and_eval_on_tau2(tmp_path):
    envs = {d: Tau2Environment(d) for d in ("retail", "airline")}
    tasks = [t for env in envs.values() for split in ("train", "test") for t in env.tasks(split)]
    data = tmp_path / "cold-start.jsonl"
    with ScriptedOpenAIServer(GoldScript(tasks)) as server:
        endpoint = ["--agent", "openai", "--agent-model", "M", "--agent-base-url", server.url,
                    "--user", "openai", "--user-model", "M", "--user-base-url", server.url]
        assert synth.main(["--out", str(data), "--domain", "retail", "--max-tasks", "2", "--concurrency", "1",
                           *endpoint]) == 0
        # the SFT file shipped beside the smoke config is exactly what this command writes
        assert data.read_text() == open(os.path.join(ROOT, "configs", "smoke-tau2-sft.jsonl")).read()

        before = len(server.chat_requests)
        train = command("muajax.train", "--config", CONFIG, f"user.base_url={server.url}", "user.model=M",
                        f"sft.data={data}", f"run.out_dir={tmp_path}")
        summary = last_json(train)
        run_dir = summary["run_dir"]
        assert {"heldout_success_sft", "heldout_success_grpo", "params_sha256"} <= set(summary)
        sft = [json.loads(line) for line in open(os.path.join(run_dir, "sft", "metrics.jsonl"))]
        grpo = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        assert len(sft) == 1 and sft[0]["loss"] > 0 and len(grpo) == 2
        assert all(r["failed_rollouts"] == 0 and r["num_seqs"] == 4 for r in grpo)
        # GRPO's users were those of the first retail and the first airline train task
        users = [r.body["messages"][0]["content"] for r in server.chat_requests[before:] if not r.body.get("tools")]
        for domain in ("retail", "airline"):
            assert any(envs[domain].tasks("train")[0].user_scenario.strip() in u for u in users), domain

        # τ2's own runner, orchestrator and evaluator against the trained checkpoint served by muajax
        before = len(server.chat_requests)
        evaluation = last_json(command("muajax.eval", "--protocol", "tau2", "--checkpoint", run_dir, "--domain",
                                       "retail", "--max-tasks", "2", "--trials", "1", "--user-model", "M",
                                       "--user-base-url", server.url, "--max-steps", "6", "--max-new-tokens", "32",
                                       "--slots", "2", "--out", str(tmp_path / "eval.json")))
        eval_users = [r for r in server.chat_requests[before:] if not r.body.get("tools")]
    retail = evaluation["domains"]["retail"]
    assert (evaluation["protocol"], evaluation["trials"]) == ("tau2", 1)
    # a two-step policy may write replies τ2 refuses (an empty message): those simulations are
    # scored 0 and counted as skipped, the evaluation goes on
    assert retail["tasks"] == 2 and retail["simulations"] == 2 and 0 <= retail["skipped"] <= 2
    assert 0.0 <= retail["pass^1"] <= 1.0 and len(eval_users) >= 2  # τ2's user LLM is the endpoint
