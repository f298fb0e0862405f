"""The task, key and simulator settings shared by the OpenAIUserSimulator tests
(test_openai_user*.py), which run over real HTTP against the scripted server."""
from __future__ import annotations

from muajax.domains.base import Task
from muajax.domains.openai_user import OpenAIUserSimulator
from tests.support.openai_server import ScriptedOpenAIServer

KEY_ENV = "MUAJAX_TEST_USER_KEY"
SECRET_KEY = "sk-test-5e3f9a1c0d7b42e8a6c4d2f0b9e7a5c3"


TASK = Task(
    task_id="retail_7", domain="retail", first_user_message="Hi, I want to exchange a lamp.",
    user_scenario="You are Ana Ruiz (zip 94110). You want to exchange order #W42's lamp for a blue one.",
)
FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "seed": 0}


def make_sim(server: ScriptedOpenAIServer, **kw) -> OpenAIUserSimulator:
    kw = {"timeout_s": 5.0, "max_retries": 3, "api_key_env": KEY_ENV, **FAST, **kw}
    return OpenAIUserSimulator(model="sim-model", base_url=server.url, **kw)


def last_user_text(request: dict) -> str:
    return request["messages"][-1]["content"]


def echo(request: dict) -> str:
    return f"echo[{len(request['messages'])}]: {last_user_text(request)}"
