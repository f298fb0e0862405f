"""MCP from a run config (`env.mcp`): named stdio servers, variables passed by name, several
scenario files, and a real streamable-HTTP server with a header read from the environment."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from muajax.config.schema import load_config
from muajax.domains.base import ToolCall
from muajax.domains.combined import CombinedEnvironment
from muajax.domains.mcp.config import McpError
from muajax.domains.mcp.environment import McpEnvironment
from muajax.domains.registry import make_environment
from tests.support import workers
from tests.support.mcp_http_server import NotesHttpServer

SERVER = workers.path("mcp_demo_server.py")


def scenario(name: str, server, split: str = "train") -> dict:
    data = {"name": name, "policy": "You keep the user's notes.", "tasks": [{
        "id": "groceries", "split": split, "first_user_message": "Save my grocery list, please.",
        "user_scenario": "You want a note titled 'groceries' listing milk.",
        "evaluation": {"state_checks": [{"call": {"name": "get_note", "arguments": {"title": "groceries"}},
                                         "contains": ["milk"]}]}}]}
    if server is not None:
        data["server"] = server
    return data


def write(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def solve(env, task) -> float:
    session = env.reset(task)
    try:
        assert session.step(ToolCall("add_note", {"title": "groceries", "body": "milk"})).content.startswith("Saved")
        return session.evaluate([], communicate_info=False).reward
    finally:
        session.close()


def test_named_stdio_server_with_variables_passed_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("MUAJAX_NOTES_OWNER", "ada")
    monkeypatch.setenv("MUAJAX_NOTES_REGION", "eu")
    named = write(tmp_path / "named.yaml", scenario("notes", "notes-server"))
    default = write(tmp_path / "default.yaml", scenario("more-notes", None, split="test"))
    cfg = load_config(None, [
        "env.domain=mcp", f"env.mcp.scenarios=[{named}, {default}]",
        "env.mcp.servers.notes-server.command='{python}'", f"env.mcp.servers.notes-server.args=[{SERVER}]",
        "env.mcp.servers.notes-server.env_vars=[MUAJAX_NOTES_OWNER, OWNER_REGION=MUAJAX_NOTES_REGION]"])
    env = make_environment(cfg.env)
    try:
        assert isinstance(env, CombinedEnvironment)
        assert [t.domain for t in env.tasks("train")] == ["notes"] and [t.domain for t in env.tasks("test")] == [
            "more-notes"]
        for task in env.tasks("train") + env.tasks("test"):
            assert solve(env, task) == 1.0
        session = env.reset(env.tasks("train")[0])
        try:
            get = lambda name: session.step(ToolCall("get_env", {"name": name})).content
            assert (get("MUAJAX_NOTES_OWNER"), get("OWNER_REGION"), get("MUAJAX_NOTES_REGION")) == ("ada", "eu", "")
        finally:
            session.close()
    finally:
        env.close()
    # a config dump keeps the names only
    assert "ada" not in json.dumps(cfg.env.mcp.servers["notes-server"].__dict__, default=str)

    monkeypatch.delenv("MUAJAX_NOTES_REGION")
    with pytest.raises(McpError, match="MUAJAX_NOTES_REGION .*not set"):
        make_environment(cfg.env)
    with pytest.raises(McpError, match=r"server 'nope' is not one of env.mcp.servers \(notes-server\)"):
        McpEnvironment(write(tmp_path / "bad.yaml", scenario("x", "nope")), servers=cfg.env.mcp)


def test_streamable_http_server_with_a_header_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MUAJAX_NOTES_KEY", "k-123")
    with NotesHttpServer(api_key="k-123") as server:
        path = write(tmp_path / "http.yaml", scenario("web-notes", "web"))
        cfg = load_config(None, ["env.domain=mcp", f"env.mcp.scenarios=[{path}]",
                                 f"env.mcp.servers.web.url={server.url}",
                                 "env.mcp.servers.web.headers_env={X-Api-Key: MUAJAX_NOTES_KEY}",
                                 "env.mcp.servers.web.startup_timeout=10"])
        env = make_environment(cfg.env)
        task = env.tasks("train")[0]
        session = env.reset(task)
        try:
            assert "add_note" in {s["function"]["name"] for s in session.tools()}
            assert session.evaluate([], communicate_info=False).reward == 0.0
            assert session.step(ToolCall("add_note", {"title": "groceries", "body": "milk, eggs"})).content == (
                "Saved note 'groceries'.")
            assert session.step(ToolCall("get_note", {"title": "groceries"})).content == "milk, eggs"
            assert session.step(ToolCall("get_note", {"title": "none"})).error
            assert session.evaluate([], communicate_info=False).reward == 1.0
        finally:
            session.close()
        assert server.app.rejected == 0

        monkeypatch.setenv("MUAJAX_NOTES_KEY", "wrong")
        with pytest.raises(McpError, match=f"MCP server '{server.url}' could not be reached"):
            env.reset(task)
        assert server.app.rejected >= 1

