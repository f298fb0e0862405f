"""ACEBench's users: the model user under ACEBench's prompt, ended by "finish conversation"
from either side (over real HTTP to the scripted server), and the multi-step items' absent
user."""
from __future__ import annotations

import asyncio

import pytest

from muajax.config.schema import EnvConfig, UserConfig
from muajax.domains.acebench.environment import AceBenchEnvironment
from muajax.domains.acebench.user import FINISH, AceBenchUserSimulator, NoUserSession
from muajax.domains.base import STOP
from muajax.domains.registry import DomainConfigError, make_user
from tests.domains.acebench.fixture import USER_TEMPLATE, write_checkout
from tests.support.openai_server import ScriptedOpenAIServer


@pytest.fixture
def env(tmp_path):
    return AceBenchEnvironment(str(write_checkout(tmp_path / "ACEBench")))


def _task(env, task_id):
    return next(t for t in env.tasks("test") if t.task_id == task_id)


def test_the_user_plays_the_item_under_acebench_s_prompt_and_ends_with_finish_conversation(env):
    replies = iter(["I want a note: buy milk.", "Thanks, that is all.\nfinish conversation"])
    task = _task(env, "agent_multi_turn_0")
    with ScriptedOpenAIServer(lambda req: next(replies)) as server:
        user = make_user(UserConfig(kind="openai", model="user-model", base_url=server.url),
                         EnvConfig(domain="acebench", acebench_dir=str(env.checkout.root)))
        assert isinstance(user, AceBenchUserSimulator)
        session = user.start(task, env.reset(task))

        async def dialogue():
            return [await session.reply("How can I help?"), await session.reply("Done: note added.")]

        first, second = asyncio.run(dialogue())
        # an agent message with the phrase ends the dialogue without asking the model
        assert asyncio.run(session.reply("All done. finish conversation")) == type(first)(FINISH, end=STOP)
        requests = [r.body for r in server.chat_requests]
    assert (first.text, first.end) == ("I want a note: buy milk.", None)
    assert second.end == STOP and FINISH in second.text
    assert len(requests) == 2
    system = requests[0]["messages"][0]
    assert system == {"role": "system", "content": USER_TEMPLATE.replace("{instruction}", task.user_scenario)}
    assert requests[0]["messages"][1] == {"role": "assistant", "content": task.first_user_message}


def test_multi_step_items_have_no_user_only_a_reminder_until_the_agent_finishes(env):
    task = _task(env, "agent_multi_step_0")
    user = AceBenchUserSimulator(model="never-asked", base_url="http://127.0.0.1:9/v1")
    session = user.start(task, env.reset(task))
    assert isinstance(session, NoUserSession)
    nudge = asyncio.run(session.reply("Which note should I delete?"))
    assert nudge.end is None and "no user" in nudge.text.lower() and FINISH in nudge.text
    assert asyncio.run(session.reply("The note is added. finish conversation")).end == STOP


def test_acebench_needs_a_model_user(env):
    with pytest.raises(DomainConfigError, match="user.kind"):
        make_user(UserConfig(kind="scripted"), EnvConfig(domain="acebench", acebench_dir=str(env.checkout.root)))


def test_a_run_config_builds_the_domain_through_the_registry(env):
    from muajax.config.schema import load_config
    from muajax.domains.registry import make_domain
    from muajax.settings.fields import ConfigError

    root = str(env.checkout.root)
    cfg = load_config(None, ["env.domain=acebench", f"env.acebench_dir={root}", "env.train_split=multi_turn",
                             "user.kind=openai", "user.model=m", "user.base_url=http://127.0.0.1:9/v1"])
    domain = make_domain(cfg.env, cfg.user)
    assert isinstance(domain.user, AceBenchUserSimulator)
    assert [t.task_id for t in domain.env.tasks(cfg.env.train_split)] == ["agent_multi_turn_0", "agent_multi_turn_1"]
    with pytest.raises(ValueError, match="ACEBench has no train split"):
        domain.env.tasks("train")
    with pytest.raises(ConfigError, match="env.acebench_dir"):
        load_config(None, ["env.domain=acebench"])
