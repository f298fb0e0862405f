"""`python -m muajax.eval --protocol tau2`: a tiny checkpoint served by muajax, τ2's own runner,
orchestrator and evaluator, and a real HTTP user endpoint started here (the evaluation
user a run config names, not its training user).

The command runs in a subprocess, as a user runs it: τ2's runner reconfigures process-wide
logging (loguru, litellm), which must not leak into the test process."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

from muajax.config.schema import UserConfig
from tests.serving.test_serve import chain_model
from tests.support.openai_server import ScriptedOpenAIServer

OPENING = "Hi, I need help with my reservation."
SECRET = "sk-test-not-a-real-key-7f3a"
# the command runs this checkout's muajax, installed or not
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHONPATH = os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH"))))
STOPPER = "Amelia Sanchez"  # airline 26's user: she stops at once, and her task needs no change


def user_script(request: dict) -> str:
    """τ2's user LLM: airline 26's user stops at once; the others ask for help, and the
    served model (which only ever calls `calculate`) runs into τ2's step limit."""
    return "Never mind, bye. ###STOP###" if STOPPER in request["messages"][0]["content"] else OPENING


def test_tau2_protocol_on_airline_tasks_with_an_http_user(tmp_path_factory, tmp_path):
    checkpoint = chain_model(tmp_path_factory)  # greedy, it answers every message with a `calculate` call
    with ScriptedOpenAIServer(user_script, model="eval-user") as user:
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump({
            "env": {"domains": ["retail", "airline"]},
            "user": {"kind": "openai", "model": "train-user", "base_url": "http://127.0.0.1:9/v1"},
            "eval": {"user": {"kind": "openai", "model": "eval-user", "base_url": user.url,
                              "api_key_env": "MUAJAX_TEST_USER_KEY"}}}))
        # airline 26 changes nothing (her stop scores 1); 16 must change a flight, and is a split twin
        command = [sys.executable, "-m", "muajax.eval", "--protocol", "tau2", "--checkpoint", checkpoint,
                   "--domain", "airline", "--task-ids", "26", "16", "--trials", "2", "--config", str(config),
                   "--max-context", "8192", "--max-new-tokens", "64", "--max-steps", "6", "--slots", "2",
                   "--out", str(tmp_path / "airline.json")]
        env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", JAX_PLATFORMS="cpu", MUAJAX_TEST_USER_KEY=SECRET,
                   PYTHONPATH=PYTHONPATH)
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL, check=False)
        stdout = proc.stdout
        assert proc.returncode == 0, stdout[-3000:] + proc.stderr[-3000:]
        requests = user.chat_requests
    result = json.loads(stdout.strip().splitlines()[-1])
    assert (result["protocol"], result["split"], result["trials"]) == ("tau2", "test", 2)
    figures = result["domains"]["airline"]
    assert figures["tasks"] == 2 and figures["simulations"] == 4 and figures["skipped"] == 0
    assert figures["terminations"] == {"user_stop": 2, "max_steps": 2}
    assert figures["pass^1"] == figures["pass^2"] == 0.5 and figures["avg_reward"] == 0.5
    assert figures["dedup"] == {"tasks": 1, "avg_reward": 1.0, "pass^1": 1.0, "pass^2": 1.0, "removed": ["16"]}
    assert "without the split twins (16)" in stdout
    # the config's evaluation user answered (once per simulation), not its training user
    assert len(requests) == 4 and {r.body["model"] for r in requests} == {"eval-user"}
    assert {r.headers["authorization"] for r in requests} == {f"Bearer {SECRET}"}  # its key, from its variable
    text = (tmp_path / "airline.json").read_text()
    assert SECRET not in text and SECRET not in stdout  # τ2 records its LLM arguments: the key is removed
    saved = json.loads(text)
    assert saved["figures"]["pass^1"] == 0.5
    for simulation in saved["results"]["simulations"]:
        messages = simulation["messages"]
        # τ2's orchestrator: the agent greets, then the user LLM writes
        assert (messages[0]["role"], messages[0]["content"]) == ("assistant", "Hi! How can I help you today?")
        assert messages[1]["role"] == "user"
        if simulation["task_id"] == "16":  # the served agent's calls, run by τ2's environment
            assert simulation["termination_reason"] == "max_steps" and simulation["reward_info"]["reward"] == 0.0
            assert messages[2]["tool_calls"][0]["name"] == "calculate" and messages[3]["content"] == "5.0"
        else:
            assert simulation["termination_reason"] == "user_stop" and simulation["reward_info"]["reward"] == 1.0


def run_tau2_eval(checkpoint: str, user_url: str, out, *, tasks: tuple[str, ...]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "muajax.eval", "--protocol", "tau2", "--checkpoint", checkpoint,
               "--domain", "airline", "--task-ids", *tasks, "--trials", "1", "--user-model", "eval-user",
               "--user-base-url", user_url, "--max-context", "8192", "--max-new-tokens", "16", "--max-steps", "6",
               "--slots", "2", "--out", str(out)]
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", JAX_PLATFORMS="cpu", PYTHONPATH=PYTHONPATH)
    return subprocess.run(command, cwd=out.parent, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, check=False)


def test_an_agent_whose_replies_tau2_refuses_scores_zero_and_a_dead_user_stops(tmp_path_factory, tmp_path):
    """An agent that answers with an empty message (τ2's orchestrator raises on it) gets 0 on
    every task, the evaluation finishing; a user endpoint that does not answer stops it."""
    silent = chain_model(tmp_path_factory, text="")  # greedy, it ends every reply at once
    with ScriptedOpenAIServer(user_script, model="eval-user") as user:
        # airline 16's user asks for a change: the agent's empty reply follows (26's user would stop first)
        proc = run_tau2_eval(silent, user.url, tmp_path / "silent.json", tasks=("16",))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert len(user.chat_requests) >= 1  # the probe (and any user turns) reached it
    figures = json.loads(proc.stdout.strip().splitlines()[-1])["domains"]["airline"]
    assert figures["simulations"] == figures["skipped"] == 1 and figures["pass^1"] == 0.0
    assert figures["dedup"] == {"tasks": 0, "removed": ["16"]}  # 16 is a split twin: nothing left to score
    assert "the agent's replies are at fault" in proc.stdout
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    proc = run_tau2_eval(silent, dead, tmp_path / "dead.json", tasks=("26",))
    assert proc.returncode != 0 and "does not answer" in proc.stdout + proc.stderr


def test_the_user_tau2_plays(monkeypatch):
    from muajax.serving.tau2_protocol import user_llm

    monkeypatch.setenv("MY_USER_KEY", "sk-test-secret")
    model, args = user_llm(UserConfig(kind="openai", model="gpt-4.1", api_key_env="MY_USER_KEY"))
    assert model == "gpt-4.1" and args["api_key"] == "sk-test-secret" and "base_url" not in args
    model, args = user_llm(UserConfig(kind="openai", model="m", base_url="http://x/v1", api_key_env=None))
    assert model == "openai/m" and args["base_url"] == "http://x/v1" and args["api_key"] == "unused"
    from muajax.settings.fields import ConfigError

    with pytest.raises(ConfigError, match="OpenAI-compatible user"):
        user_llm(UserConfig())


def test_tau2_protocol_refuses_what_it_cannot_run(tmp_path, capsys):
    from muajax.eval import main

    for argv, message in ((["--domain", "builtin"], "--domain must be among"),
                          (["--domain", "retail", "--policy", "gold"], "give --checkpoint DIR, or --policy gold")):
        with pytest.raises(SystemExit):
            main(["--protocol", "tau2", "--checkpoint", str(tmp_path), *argv])
        assert message in capsys.readouterr().err
