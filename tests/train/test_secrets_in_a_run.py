"""A run never writes or prints a secret: a short training whose simulated user is a real
local OpenAI-compatible server, with the API key in the environment, leaves the key in no
file of the run folder (binary files included) and in none of its output; a config that
carries a credential in a URL or in an MCP server's arguments is refused before anything
is written, without echoing it."""
import os
import subprocess
import sys
import uuid

import pytest

from tests.support.openai_server import ScriptedOpenAIServer
from tests.support.tiny_models import arch_override

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY_ENV = "MUAJAX_SECRETS_TEST_KEY"
RUN = ["run.stages=[grpo]", "run.name=secrets", "model.hf_dir=null", "model.vocab=domain",
       arch_override(), "rollout.n_per_task=2", "rollout.tasks_per_step=1",
       "rollout.max_turns=2", "rollout.max_new_tokens_per_turn=8", "rollout.max_context=1536", "grpo.steps=1",
       "grpo.microbatch_size=null", "checkpoint.every_steps=1", "eval.max_tasks=1", "eval.trials=1",
       "metrics.progress_bar=false", "metrics.tensorboard=true", "user.kind=openai", "user.model=scripted-user",
       f"user.api_key_env={KEY_ENV}"]


def run_train(args, key, timeout=900):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{KEY_ENV: key})
    return subprocess.run([sys.executable, "-m", "muajax.train", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def files_holding(root, needle: bytes) -> list[str]:
    """Every file under root whose bytes contain needle."""
    found = []
    for where, _, files in os.walk(root):
        for name in files:
            path = os.path.join(where, name)
            with open(path, "rb") as f:
                if needle in f.read():
                    found.append(os.path.relpath(path, root))
    return found


def test_the_api_key_reaches_no_file_of_the_run_and_no_output(tmp_path):
    key = f"sk-muajax-{uuid.uuid4().hex}"
    out = tmp_path / "runs"
    # the first request fails (500): the retry is logged, with the error, to stderr
    with ScriptedOpenAIServer(lambda request: "Thanks, that is all. ###STOP###", fail_first=1) as server:
        result = run_train([*RUN, f"run.out_dir={out}", f"user.base_url={server.url}"], key)
        sent = {r.headers.get("authorization") for r in server.chat_requests}
    assert result.returncode == 0, result.stderr[-3000:]
    assert sent == {f"Bearer {key}"}  # the key was really used
    assert "retrying" in result.stderr and '"heldout_success_grpo"' in result.stdout
    files = [os.path.join(w, n) for w, _, names in os.walk(out) for n in names]
    kinds = {os.path.basename(f).split(".")[0] for f in files}
    assert {"config", "vocab", "metrics", "eval_grpo", "events"} <= kinds, sorted(kinds)  # events: TensorBoard
    assert any("checkpoints/grpo/1/state" in f for f in files)
    assert files_holding(out, key.encode()) == []
    assert key not in result.stdout and key not in result.stderr
    assert KEY_ENV in (out / "secrets" / "config.yaml").read_text()  # the variable's name is what is kept
    # the search can fail: a planted key is found, in a binary file too
    (out / "secrets" / "planted.bin").write_bytes(b"\x00\xff" + key.encode() + b"\x00")
    assert files_holding(out, key.encode()) == [os.path.join("secrets", "planted.bin")]


@pytest.mark.parametrize("override, key_name", [
    ("user.base_url=http://me:{key}@127.0.0.1:9/v1", "user.base_url"),
    ("user.base_url=http://127.0.0.1:9/v1?api_key={key}", "user.base_url"),
    ("env.mcp.servers.notes.args=[notes_server.py, --api-key, '{key}']", "env.mcp.servers.notes.args[2]"),
    ("env.mcp.servers.notes.args=[notes_server.py, '--token={key}']", "env.mcp.servers.notes.args[1]"),
])
def test_a_credential_in_a_url_or_an_mcp_argument_is_refused_before_anything_is_written(tmp_path, override,
                                                                                      key_name):
    key = f"sk-muajax-{uuid.uuid4().hex}"
    extra = ["env.domain=mcp", "env.mcp.scenarios=[notes.yaml]", "env.mcp.servers.notes.command=python"] \
        if override.startswith("env.mcp") else []
    result = run_train([*RUN, *extra, f"run.out_dir={tmp_path}", override.format(key=key)], key, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"muajax.train: config error: '{key_name}' holds a credential" in result.stderr
    assert key not in result.stdout and key not in result.stderr and "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == []
