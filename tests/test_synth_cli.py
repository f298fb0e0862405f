"""`python -m muajax.synth` against a real OpenAI-compatible endpoint started in the test,
which plays both the agent (replaying gold actions) and the simulated user: on τ2 retail,
on an MCP scenario and on the built-in domain; and the failures that must not be kept."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from muajax import synth
from muajax.domains.tau2.environment import Tau2Environment
from tests.domains.mcp.test_mcp import SCENARIO
from tests.support.gold_script import GoldScript
from tests.support.openai_server import ScriptedOpenAIServer


def run(argv, capsys) -> tuple[int, dict]:
    code = synth.main(argv)
    out = capsys.readouterr()
    return code, json.loads(out.out.strip().splitlines()[-1]) if code == 0 else out.err


def records(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def retail_tasks():
    return Tau2Environment("retail").tasks("train")[:2]


def endpoint_args(url: str) -> list[str]:
    return ["--agent", "openai", "--agent-model", "agent", "--agent-base-url", url,
            "--user", "openai", "--user-model", "user", "--user-base-url", url]


def test_synth_on_tau2_retail_with_an_llm_user(tmp_path, capsys, retail_tasks):
    out = tmp_path / "sft.jsonl"
    with ScriptedOpenAIServer(GoldScript(retail_tasks)) as server:
        code, summary = run(["--out", str(out), "--domain", "retail", "--max-tasks", "2",
                             *endpoint_args(server.url)], capsys)
        requests = server.chat_requests
    assert code == 0, summary
    assert summary["generated"] == 2 and summary["kept"] == 2 and summary["failed"] == 0
    kept = records(out)
    assert [r["task_id"] for r in kept] == [t.task_id for t in retail_tasks] and all(r["reward"] == 1.0 for r in kept)
    for record, task in zip(kept, retail_tasks):
        calls = [c["function"] for m in record["messages"] for c in m.get("tool_calls", [])]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [(a.name, a.arguments)
                                                                             for a in task.gold_actions]
        assert record["messages"][0] == {"role": "user", "content": task.first_user_message}
        assert record["system"] == Tau2Environment("retail").policy() and record["tools"]
    agent = [r.body for r in requests if r.body.get("tools")]
    user = [r.body for r in requests if not r.body.get("tools")]
    assert agent and all(b["model"] == "agent" and b["messages"][0]["content"] == kept[0]["system"] for b in agent)
    # the user is τ2's simulated user: its guidelines and the task's scenario, the agent's text only
    assert user and all(b["model"] == "user" and "<scenario>" in b["messages"][0]["content"] for b in user)
    assert not any(m.get("tool_calls") or m["role"] == "tool" for b in user for m in b["messages"])


def test_failed_conversations_are_never_kept(tmp_path, capsys, retail_tasks):
    script = GoldScript(retail_tasks)
    with ScriptedOpenAIServer(lambda body: script(body) if body.get("tools") else 1 / 0) as server:  # users fail
        code, summary = run(["--out", str(tmp_path / "sft.jsonl"), "--domain", "retail", "--max-tasks", "2",
                             "--keep-all", *endpoint_args(server.url)], capsys)
    assert code == 0 and summary["failed"] == 2 and summary["kept"] == 0
    assert "the user could not answer" in summary["first_failure"]
    code, err = run(["--out", str(tmp_path / "x.jsonl"), "--domain", "retail", "--agent", "openai",
                     "--agent-model", "m", "--agent-base-url", "http://127.0.0.1:9/v1"], capsys)
    assert code == 2 and "the scripted user exists only for the built-in domain" in err


def test_synth_on_an_mcp_scenario(tmp_path, capsys):
    path = tmp_path / "notes.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    from muajax.domains.mcp.environment import McpEnvironment

    with McpEnvironment(path) as env:
        tasks = env.tasks("train")
    out = tmp_path / "sft.jsonl"
    with ScriptedOpenAIServer(GoldScript(tasks)) as server:
        code, summary = run(["--out", str(out), "--mcp-scenario", str(path), *endpoint_args(server.url)], capsys)
    assert code == 0 and summary["kept"] == 1, summary
    (record,) = records(out)
    assert record["task_id"] == "groceries" and "add_note" in {t["function"]["name"] for t in record["tools"]}


def test_synth_on_the_builtin_domain_with_its_expert(tmp_path, capsys):
    code, summary = run(["--out", str(tmp_path / "sft.jsonl"), "--max-tasks", "4", "--careless", "0"], capsys)
    assert code == 0 and summary["generated"] == 4 and summary["kept"] >= 3
    assert len(records(tmp_path / "sft.jsonl")) == summary["kept"]
