"""MCP environment against a real stdio server (tests/support/workers/mcp_demo_server.py)."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from muajax.domains.base import Observation, ToolCall
from muajax.domains.mcp.client import McpClient
from muajax.domains.mcp.environment import McpEnvironment
from muajax.domains.mcp.scenario import McpError, McpServerConfig, load_scenario
from tests.support import workers

SERVER = workers.path("mcp_demo_server.py")

SCENARIO = {
    "name": "notes",
    "policy": "You keep the user's notes. Confirm before deleting anything.",
    "server": {"command": "{python}", "args": [str(SERVER)], "call_timeout": 1.5, "startup_timeout": 30},
    "tasks": [
        {
            "id": "groceries",
            "split": "train",
            "first_user_message": "Hi, can you save my grocery list?",
            "user_scenario": "You want a note titled 'groceries' listing milk and eggs.",
            "gold_actions": [{"name": "add_note", "arguments": {"title": "groceries", "body": "milk, eggs"}}],
            "evaluation": {
                "expected_calls": [{"name": "add_note", "arguments": {"title": "groceries"}}],
                "state_checks": [{"call": {"name": "get_note", "arguments": {"title": "groceries"}},
                                  "contains": ["MILK", "eggs"]},
                                 {"call": {"name": "list_notes"}, "json": ["groceries"]}],
                "communicate_info": ["saved"],
            },
        },
        {
            "id": "cleanup",
            "split": "test",
            "first_user_message": "Please delete my old todo note.",
            "user_scenario": "You had a note titled 'todo'; you want it gone.",
            "evaluation": {"state_checks": [{"call": {"name": "get_note", "arguments": {"title": "todo"}},
                                             "error": True}]},
        },
    ],
}


def _write(tmp_path: Path, data: dict, name: str = "scenario.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if name.endswith(".yaml") else json.dumps(data))
    return path


@pytest.fixture()
def env(tmp_path):
    environment = McpEnvironment(_write(tmp_path, SCENARIO))
    yield environment
    environment.close()


def _pid(session) -> int:
    return int(session.step(ToolCall("server_pid", {})).content)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_tools_calls_and_gold_evaluation(env):
    assert [t.task_id for t in env.tasks("train")] == ["groceries"]
    assert [t.task_id for t in env.tasks("test")] == ["cleanup"]
    task = env.tasks("train")[0]
    assert task.gold_actions == (ToolCall("add_note", {"title": "groceries", "body": "milk, eggs"}),)
    session = env.reset(task)
    try:
        tools = {s["function"]["name"]: s for s in session.tools()}
        assert set(tools) == {"add_note", "get_note", "list_notes", "delete_note", "wait", "get_env", "server_pid",
                              "think", "calculate", "transfer_to_human_agents"}
        assert tools["add_note"]["function"]["parameters"]["required"] == ["title", "body"]
        assert "Save a note" in tools["add_note"]["function"]["description"]
        before = session.evaluate([], communicate_info=False)
        assert (before.reward, before.partial) == (0.0, 0.0)
        for call in task.gold_actions:
            assert session.step(call) == Observation("Saved note 'groceries'.")
        assert session.step(ToolCall("get_note", {"title": "groceries"})).content == "milk, eggs"
        assert json.loads(session.step(ToolCall("list_notes", {})).content) == ["groceries"]
        said = [{"role": "user", "content": task.first_user_message},
                {"role": "assistant", "content": "Done: I saved your note."}]
        for flag in (False, True):
            ev = session.evaluate(said, communicate_info=flag)
            assert (ev.reward, ev.partial) == (1.0, 1.0), ev
        unsaid = session.evaluate(said[:1], communicate_info=True)
        assert unsaid.reward == 0.0 and unsaid.partial == pytest.approx(3 / 4)
        assert unsaid.details["communicated"] == [False]
        session.step(ToolCall("add_note", {"title": "groceries", "body": "bread"}))
        ev = session.evaluate(said, communicate_info=False)
        # the expected call ran and the note exists, but it no longer lists milk and eggs
        assert ev.reward == 0.0 and ev.partial == pytest.approx(2 / 3)
        assert ev.details == {"expected_calls_met": [True], "state_checks_met": [False, True]}
    finally:
        session.close()


def test_bad_calls_and_timeouts_are_error_observations(env):
    session = env.reset(env.tasks("train")[0])
    try:
        cases = {
            "unknown tool": ToolCall("rm_rf", {}),
            "missing argument": ToolCall("add_note", {"title": "x"}),
            "undeclared argument": ToolCall("add_note", {"title": "x", "body": "y", "color": "red"}),
            "wrong type": ToolCall("add_note", {"title": 3, "body": "y"}),
            "not an object": ToolCall("add_note", ["x", "y"]),
            "tool error": ToolCall("get_note", {"title": "nothing"}),
            "tool exception": ToolCall("delete_note", {"title": "nothing"}),
            "general tool args": ToolCall("calculate", {"expr": "1"}),
        }
        for what, call in cases.items():
            obs = session.step(call)
            assert obs.error and not obs.done and obs.content.startswith("Error"), (what, obs)
        assert "no note titled 'nothing'" in session.step(cases["tool error"]).content
        # failed calls do not count as the expected call having run
        assert session.evaluate([], communicate_info=False).details["expected_calls_met"] == [False]
        assert session.step(ToolCall("calculate", {"expression": "2 * (3 + 4)"})).content == "14.0"
        assert session.step(ToolCall("think", {"thought": "x"})) == Observation("")
        transfer = session.step(ToolCall("transfer_to_human_agents", {"summary": "needs a human"}))
        assert transfer.done and not transfer.error
        start = time.monotonic()  # the per-call timeout (call_timeout: 1.5 s)
        obs = session.step(ToolCall("wait", {"seconds": 4}))
        assert obs.error and "timed out" in obs.content
        assert time.monotonic() - start < 3.5
        assert not session.step(ToolCall("wait", {"seconds": 0})).error  # the connection survives
    finally:
        session.close()


def test_sessions_are_isolated_and_close_stops_the_server(env):
    task = env.tasks("train")[0]
    a, b = env.reset(task), env.reset(task)
    pid_a, pid_b = _pid(a), _pid(b)
    assert pid_a != pid_b and _alive(pid_a) and _alive(pid_b)
    threads = [threading.Thread(target=s.step, args=(ToolCall("add_note", {"title": name, "body": name}),))
               for s, name in ((a, "from-a"), (b, "from-b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert json.loads(a.step(ToolCall("list_notes", {})).content) == ["from-a"]
    assert json.loads(b.step(ToolCall("list_notes", {})).content) == ["from-b"]
    a.close()
    assert not _alive(pid_a) and _alive(pid_b)
    obs = a.step(ToolCall("list_notes", {}))
    assert obs.error and "closed" in obs.content
    with pytest.raises(RuntimeError, match="before close"):
        a.evaluate([], communicate_info=False)
    a.close()  # idempotent
    b.close()
    assert not _alive(pid_b)
    assert not [t for t in threading.enumerate() if t.name == "muajax-mcp"]


def test_shared_server(tmp_path):
    with McpEnvironment(_write(tmp_path, SCENARIO), shared=True) as shared:
        task = shared.tasks("test")[0]
        a, b = shared.reset(task), shared.reset(task)
        pid = _pid(a)
        assert _pid(b) == pid
        a.step(ToolCall("add_note", {"title": "todo", "body": "old"}))
        assert b.step(ToolCall("get_note", {"title": "todo"})).content == "old"
        assert b.evaluate([], communicate_info=True).reward == 0.0
        b.step(ToolCall("delete_note", {"title": "todo"}))
        assert a.evaluate([], communicate_info=True).reward == 1.0
        a.close()
        assert _alive(pid)  # sessions do not own a shared server
    assert not _alive(pid)


def test_startup_failure_is_reported_with_the_servers_stderr():
    config = McpServerConfig(command=sys.executable,
                             args=("-c", "import sys; sys.stderr.write('cannot open notes db'); sys.exit(3)"),
                             startup_timeout=20)
    with pytest.raises(McpError, match="cannot open notes db"):
        McpClient(config)
    marker = "muajax-hung-server-marker"
    hung = McpServerConfig(command=sys.executable, args=("-c", "import time; time.sleep(60)", marker),
                           startup_timeout=1)
    start = time.monotonic()
    with pytest.raises(McpError, match="timed out"):
        McpClient(hung)
    assert time.monotonic() - start < 12
    assert not _processes_with(marker)
    assert not [t for t in threading.enumerate() if t.name == "muajax-mcp"]


def _processes_with(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_scenario_validation(tmp_path, monkeypatch):
    def broken(mutate) -> str:
        data = json.loads(json.dumps(SCENARIO))
        mutate(data)
        with pytest.raises(McpError) as info:
            load_scenario(_write(tmp_path, data))
        return str(info.value)

    assert "tasks[0]: missing 'first_user_message'" in broken(lambda d: d["tasks"][0].pop("first_user_message"))
    assert "tasks[1].split" in broken(lambda d: d["tasks"][1].update(split="dev"))
    assert "needs at least one" in broken(lambda d: d["tasks"][1].update(evaluation={}))
    assert "duplicate task ids" in broken(lambda d: d["tasks"][1].update(id="groceries"))
    assert "unknown keys ['startswith']" in broken(
        lambda d: d["tasks"][1]["evaluation"]["state_checks"][0].update(startswith="x"))
    assert "server: 'command' or 'url' is required" in broken(lambda d: d["server"].pop("command"))
    assert "'command' conflicts with 'url'" in broken(lambda d: d["server"].update(url="http://127.0.0.1:1/mcp"))
    assert "unknown keys ['comand']" in broken(lambda d: d["server"].update(comand="x"))
    assert "not one of env.mcp.servers (none)" in broken(lambda d: d.update(server="notes-server"))
    assert "call_timeout" in broken(lambda d: d["server"].update(call_timeout=0))
    assert "NOT_SET_ANYWHERE" in broken(lambda d: d["server"].update(env={"TOKEN": "${NOT_SET_ANYWHERE}"}))
    monkeypatch.setenv("MUAJAX_TEST_SECRET", "s3cret")
    data = json.loads(json.dumps(SCENARIO))
    data["server"]["env"] = {"TOKEN": "${MUAJAX_TEST_SECRET}"}
    scenario = load_scenario(_write(tmp_path, data, "scenario.json"))  # JSON works too
    # the config keeps the reference; the value is read when a server starts
    assert scenario.server.env == {"TOKEN": "${MUAJAX_TEST_SECRET}"} and scenario.server.command == sys.executable
    assert scenario.server.resolved_env() == {"TOKEN": "s3cret"}
    assert scenario.tasks[1].task.gold_actions == ()
    with pytest.raises(ValueError, match="not a task of MCP scenario"):
        McpEnvironment(scenario).reset(scenario.tasks[0].task.__class__(
            task_id="other", domain="notes", first_user_message="x", user_scenario="y"))
    with pytest.raises(ValueError, match="unknown split"):
        McpEnvironment(scenario).tasks("dev")


def test_a_scenario_refuses_credentials_in_the_server_command_line(tmp_path, monkeypatch):
    """A secret reaches a server only through `env` as ${NAME}: on its command line it
    would sit in the scenario file, in every process listing and in logs."""
    key = "sk-mcp-5e4d3c2b1a09"

    def refused(mutate):
        data = json.loads(json.dumps(SCENARIO))
        mutate(data["server"])
        with pytest.raises(McpError) as info:
            load_scenario(_write(tmp_path, data))
        assert key not in str(info.value)
        return str(info.value)

    assert "server.args[1] holds a credential (the value of argument '--token'); pass it to the server through " \
           "'env' as \"${NAME}\"" in refused(lambda s: s["args"].append(f"--token={key}"))
    assert "server.args[2] holds a credential (the value of argument '--api-key')" in refused(
        lambda s: s["args"].extend(["--api-key", key]))
    assert "server.args[1] holds a credential (a password in the URL's userinfo" in refused(
        lambda s: s["args"].append(f"--db=postgres://app:{key}@db/notes"))
    assert "server.env.API_TOKEN holds a literal secret; write \"${API_TOKEN}\"" in refused(
        lambda s: s.update(env={"API_TOKEN": key}))
    # the way that works: the secret in muajax's environment, named in `env`; reprs hide it
    monkeypatch.setenv("MUAJAX_MCP_TEST_TOKEN", key)
    data = json.loads(json.dumps(SCENARIO))
    data["server"].update(env={"API_TOKEN": "${MUAJAX_MCP_TEST_TOKEN}"}, args=[*data["server"]["args"], "--port", "0"])
    scenario = load_scenario(_write(tmp_path, data))
    # the value is read when a connection opens, so a loaded scenario never holds it
    assert scenario.server.env == {"API_TOKEN": "${MUAJAX_MCP_TEST_TOKEN}"}
    assert scenario.server.resolved_env() == {"API_TOKEN": key}
    assert key not in repr(scenario.server) and key not in repr(scenario) and "'API_TOKEN': ***" in repr(scenario)
