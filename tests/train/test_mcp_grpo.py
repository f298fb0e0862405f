"""Two GRPO steps of a tiny model on an MCP server, from a config: the server is written here
with the `mcp` package and runs over stdio, named in `env.mcp.servers`, its tasks in a
scenario file; the simulated user is a real OpenAI-compatible endpoint started here."""
from __future__ import annotations

import json
import os
import textwrap

import yaml

from muajax import eval as eval_command
from muajax.config.schema import load_config
from muajax.train.trainer import Trainer
from tests.domains.mcp.test_mcp import _processes_with
from tests.support.openai_server import ScriptedOpenAIServer
from tests.support.tiny_models import TINY_ARCH

SERVER = '''
import os
from mcp.server.mcpserver import MCPServer

server = MCPServer("counter", log_level="WARNING")
count = int(os.environ["COUNTER_START"])


@server.tool()
def increment(by: int) -> str:
    """Add to the counter.

    Args:
        by: How much to add.
    """
    global count
    count += by
    return f"the counter is {count}"


@server.tool()
def read() -> str:
    """The counter's value."""
    return str(count)


server.run("stdio")
'''


def task(task_id: str, split: str, by: int) -> dict:
    return {"id": task_id, "split": split, "first_user_message": f"Please add {by} to my counter.",
            "user_scenario": f"You want your counter increased by {by}.",
            "gold_actions": [{"name": "increment", "arguments": {"by": by}}],
            "evaluation": {"state_checks": [{"call": {"name": "read"}, "equals": str(by)}]}}


def test_two_grpo_steps_on_a_stdio_mcp_server_from_a_config(tmp_path, monkeypatch):
    monkeypatch.setenv("COUNTER_START", "0")
    (tmp_path / "counter_server.py").write_text(textwrap.dedent(SERVER))
    (tmp_path / "counter.yaml").write_text(yaml.safe_dump({
        "name": "counter", "policy": "You manage the user's counter.", "server": "counter",
        "tasks": [task("add-2", "train", 2), task("add-3", "train", 3), task("add-5", "test", 5)]}))
    with ScriptedOpenAIServer(lambda body: "Thanks, that is all. ###STOP###") as user:
        config = {
            "run": {"name": "mcp", "out_dir": str(tmp_path / "runs"), "stages": ["grpo"]},
            "model": {"vocab": "domain", "arch": {**TINY_ARCH, "max_position_embeddings": 1024}},
            "env": {"domain": "mcp", "mcp": {
                "servers": {"counter": {"command": "{python}", "args": ["counter_server.py"], "cwd": str(tmp_path),
                                        "env_vars": ["COUNTER_START"], "call_timeout": 10}},
                "scenarios": ["./counter.yaml"]}},
            "user": {"kind": "openai", "model": "user", "base_url": user.url, "max_retries": 0},
            "rollout": {"n_per_task": 2, "tasks_per_step": 1, "max_turns": 2, "max_new_tokens_per_turn": 8,
                        "max_context": 1024},
            "grpo": {"steps": 2, "learning_rate": 1e-3, "kl_coef": 0.0},
            "eval": {"max_tasks": 1},
            "metrics": {"progress_bar": False, "tensorboard": False},
        }
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
        cfg = load_config(tmp_path / "run.yaml")
        assert cfg.env.mcp.scenarios == (str(tmp_path / "counter.yaml"),)
        summary = Trainer(cfg).run()
        # the evaluation command builds the same domain from the run's config
        assert eval_command.main(["--checkpoint", cfg.run_dir, "--domain", "mcp", "--max-tasks", "1", "--trials", "1",
                                  "--user-model", "user", "--user-base-url", user.url,
                                  "--out", str(tmp_path / "eval.json")]) == 0
        evaluated = json.load(open(tmp_path / "eval.json"))
        assert evaluated["summary"]["tasks"] == 1 and evaluated["tasks"][0]["task_id"] == "add-5"
        asked = len(user.chat_requests)
    records = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    assert len(records) == 2
    for record in records:
        assert record["failed_rollouts"] == 0 and record["num_seqs"] == 2 and record["num_tokens"] > 0
        assert sum(v for k, v in record.items() if k.startswith("termination/")) == 1.0
    assert summary["heldout_success_grpo"] in (0.0, 1.0) and asked > 0
    assert os.path.isdir(os.path.join(cfg.checkpoint_dir, "grpo", "2"))
    assert not _processes_with(str(tmp_path / "counter_server.py")) and not _processes_with("counter_server.py")
