"""Which simulated user evaluates (`eval.user` in the trainer and in `python -m muajax.eval`),
and the env section an evaluation builds its domain from."""
from __future__ import annotations

import pytest

from muajax.settings.fields import ConfigError
from muajax.config.schema import UserConfig, load_config
from muajax.domains.builtin.user import ScriptedUser
from muajax.domains.openai_user import OpenAIUserSimulator
from muajax.domains.registry import DomainConfigError
from muajax.train.context import RunContext
from muajax.evaluation.saved_policy import EvalRequest, domain_env_config, eval_user_config

TRAIN_USER = ["user.kind=openai", "user.model=train-user", "user.base_url=http://127.0.0.1:1/v1"]
EVAL_USER = ["eval.user.kind=openai", "eval.user.model=eval-user", "eval.user.base_url=http://127.0.0.1:2/v1"]
UNSET = {"kind": None, "model": None, "base_url": None, "api_key_env": None, "temperature": None}


def test_the_evaluation_user_is_eval_user_else_the_training_user_and_flags_override_fields():
    both = load_config(overrides=["env.domain=retail", "run.stages=[grpo]", *TRAIN_USER, *EVAL_USER])
    training_only = load_config(overrides=["env.domain=retail", "run.stages=[grpo]", *TRAIN_USER])
    assert both.eval_user.model == "eval-user" and training_only.eval_user.model == "train-user"

    user = eval_user_config(UNSET, both, "retail")
    assert (user.kind, user.model, user.base_url) == ("openai", "eval-user", "http://127.0.0.1:2/v1")
    assert eval_user_config(UNSET, training_only, "airline").model == "train-user"
    # a flag replaces one field, the others stay the run's
    user = eval_user_config({**UNSET, "base_url": "http://flag:3/v1"}, both, "retail")
    assert (user.model, user.base_url) == ("eval-user", "http://flag:3/v1")
    user = eval_user_config({**UNSET, "model": "flag-user", "temperature": 0.5}, both, "telecom")
    assert (user.model, user.base_url, user.temperature) == ("flag-user", "http://127.0.0.1:2/v1", 0.5)

    # no run config (an HF checkpoint): the flags alone, with a clear error when they are not enough
    assert eval_user_config({**UNSET, "model": "m"}, None, "retail").model == "m"
    with pytest.raises(ConfigError, match="give --user-model"):
        eval_user_config(UNSET, None, "retail")
    # the built-in domain and BFCL default to their scripted users; BFCL's is never the run's
    assert eval_user_config(UNSET, None, "builtin").kind == "scripted"
    assert eval_user_config(UNSET, both, "builtin").model == "eval-user"  # an endpoint user suits builtin too
    assert eval_user_config(UNSET, both, "bfcl").kind == "scripted"
    # a run whose user is the scripted one cannot play τ2: the defaults apply, and want a model
    scripted = load_config(overrides=["env.domain=builtin"])
    with pytest.raises(ConfigError, match="give --user-model"):
        eval_user_config(UNSET, scripted, "retail")
    # another kind than the run's: none of the run's settings carry over
    assert eval_user_config({**UNSET, "kind": "scripted"}, both, "builtin") == UserConfig(kind="scripted")


def test_the_trainers_evaluation_talks_to_eval_user():
    from muajax.domains.registry import make_domain

    cfg = load_config(overrides=["env.domain=builtin", *EVAL_USER])
    domain = make_domain(cfg.env, cfg.user)
    ctx = RunContext(cfg, mesh=None, domain=domain, model_cfg=None, tok=None, hf_dir=None)
    assert isinstance(ctx.domain.user, ScriptedUser)  # training: the run's user
    evaluation = ctx.eval_domain()
    assert evaluation.env is domain.env and ctx.eval_domain() is evaluation
    assert isinstance(evaluation.user, OpenAIUserSimulator)
    assert (evaluation.user.model, evaluation.user.base_url) == ("eval-user", "http://127.0.0.1:2/v1")
    plain = RunContext(load_config(), mesh=None, domain=domain, model_cfg=None, tok=None, hf_dir=None)
    assert plain.eval_domain() is domain  # no eval.user: the training user evaluates


def test_the_paper_configs_train_with_gpt_4o_and_evaluate_with_gpt_4_1():
    cfg = load_config("configs/runs/qwen3-8b-tau2.yaml")
    assert cfg.user.model == "gpt-4o-2024-11-20" and cfg.eval_user.model == "gpt-4.1"
    assert cfg.eval.user.kind == "openai" and cfg.eval.user.api_key_env == "OPENAI_API_KEY"
    # a run pointed at another endpoint moves both users with two overrides each
    moved = load_config("configs/runs/qwen3-8b-tau2.yaml", ["user.base_url=http://u/v1", "eval.user.base_url=http://e/v1"])
    assert (moved.user.base_url, moved.eval_user.base_url) == ("http://u/v1", "http://e/v1")


def test_the_env_section_of_an_evaluation():
    run = load_config(overrides=["env.domains=[retail, airline]", "run.stages=[grpo]", *TRAIN_USER])
    request = EvalRequest(checkpoint="x", domains=("airline",))
    env = domain_env_config(request, run, "airline")
    assert (env.domain, env.domains, env.tau2_tools) == ("airline", (), "tau2")  # τ2's own tools: no think
    bfcl = domain_env_config(EvalRequest(checkpoint="x", domains=("bfcl",), bfcl_category="multi_turn_miss_func"),
                             None, "bfcl")
    assert bfcl.bfcl_category == "multi_turn_miss_func"
    builtin = load_config(overrides=["env.builtin_users=30", "env.builtin_terse_tools=true"])
    env = domain_env_config(EvalRequest(checkpoint="x", domains=("builtin",)), builtin, "builtin")
    assert env.builtin_users == 30 and env.builtin_terse_tools  # as the run was trained
    with pytest.raises(DomainConfigError, match="--domain mcp needs its servers"):
        domain_env_config(EvalRequest(checkpoint="x", domains=("mcp",)), None, "mcp")
