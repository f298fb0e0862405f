"""τ1 tasks on τ2's retail environment: the field mapping onto τ2's Task, the splits, what
does not map, the gold replay scored by τ2's evaluator, the registry, config and eval CLI."""
from __future__ import annotations

import json
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import pytest  # noqa: E402

from muajax.agent.gold import gold_summary, replay_gold  # noqa: E402
from muajax.config.schema import ConfigError, EnvConfig, load_config  # noqa: E402
from muajax.domains.base import ToolCall  # noqa: E402
from muajax.domains.registry import DomainConfigError, make_environment, make_user  # noqa: E402
from muajax.domains.tau1.environment import Tau1Environment, to_tau2_task, unmapped_actions  # noqa: E402
from muajax.domains.tau1.tasks import load_tau1_tasks  # noqa: E402
from muajax.domains.tau2.environment import tau2_user_guidelines  # noqa: E402
from muajax.domains.user_config import UserConfig  # noqa: E402
from tests.domains.tau1.checkout import write_checkout  # noqa: E402


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return write_checkout(tmp_path_factory.mktemp("tau-bench"))


@pytest.fixture(scope="module")
def env(checkout):
    with pytest.warns(UserWarning):  # the test split's unmapped task (see test_what_does_not_map...)
        environment = Tau1Environment("retail", checkout, tools="tau2")
        environment.splits()
    return environment


def test_a_tau1_task_maps_onto_tau2s_task_fields(checkout):
    cancel = load_tau1_tasks(checkout, "retail", "train")[0]
    t = to_tau2_task(cancel)
    assert t.id == "tau1-train-0"
    assert t.user_scenario.persona is None and t.user_scenario.instructions == cancel.instruction
    c = t.evaluation_criteria
    assert [(a.action_id, a.requestor, a.name, a.arguments) for a in c.actions] == [
        ("tau1-train-0_0", "assistant", "find_user_id_by_name_zip",
         {"first_name": "Fatima", "last_name": "Anderson", "zip": "32100"}),
        ("tau1-train-0_1", "assistant", "cancel_pending_order", {"order_id": "#W2974929", "reason": "no longer needed"})]
    assert c.communicate_info == ["182.03"] and c.nl_assertions is None
    assert [b.value for b in c.reward_basis] == ["DB", "COMMUNICATE"]
    assert "user_id fatima_anderson_2157" in t.description.notes and "annotator 'fixture'" in t.description.notes


def test_the_splits_are_tau1s_and_tau2s_own(env):
    assert env.splits() == {"train": 2, "dev": 1, "test": 1, "tau2-train": 74, "tau2-test": 40, "tau2-base": 114}
    train = env.tasks("train")
    assert [t.task_id for t in train] == ["tau1-train-0", "tau1-train-1"] and {t.domain for t in train} == {"retail"}
    first = train[0]
    assert first.split == "train" and "Cancel order #W2974929" in first.user_scenario
    assert first.metadata["source"] == "tau1" and first.metadata["tau1_unmapped"] == ()
    assert first.metadata["tau1"] == {"split": "train", "index": 0, "user_id": "fatima_anderson_2157",
                                      "annotator": "fixture"}
    assert first.metadata["communicate_info"] == ("182.03",) and first.metadata["reward_basis"] == ("DB", "COMMUNICATE")
    assert [c.name for c in first.gold_actions] == ["find_user_id_by_name_zip", "cancel_pending_order"]
    tau2_test = env.tasks("tau2-test")
    assert len(tau2_test) == 40 and {t.split for t in tau2_test} == {"tau2-test"} and "source" not in tau2_test[0].metadata
    with pytest.raises(ValueError, match="tau1-retail has no split 'validation'; available: train, dev, test, tau2-"):
        env.tasks("validation")


def test_what_does_not_map_is_flagged_at_load(checkout, env):
    (task,) = env.tasks("test")
    assert task.metadata["tau1_unmapped"] == (
        "action 0: τ2's agent has no tool 'refund_everything'", "action 1: cancel_pending_order takes no note",
        "action 2: modify_pending_order_items keeps item 3877188862 as it is, which τ2's tool refuses (the call "
        "fails on τ2, so its gold database is the unmodified one)")
    session = env.reset(task)
    try:
        observation = session.step(task.gold_actions[2])
        assert observation.error and "should be different" in observation.content
    finally:
        session.close()
    with pytest.warns(UserWarning, match=r"τ1 retail test: 1 of 1 tasks have gold actions τ2's tools do not take as "
                                         r"given \(tau1-test-0\)"):
        Tau1Environment("retail", checkout).splits()
    assert unmapped_actions(load_tau1_tasks(checkout, "retail", "train")[0],
                            {"find_user_id_by_name_zip": {"properties": {"first_name": {}}, "required": ["email"]},
                             "cancel_pending_order": {"properties": {"order_id": {}, "reason": {}}}}) == [
        "action 0: find_user_id_by_name_zip takes no last_name, zip", "action 0: find_user_id_by_name_zip needs email"]


def test_the_gold_actions_replayed_on_tau2s_retail_environment_score_1(env):
    replays = replay_gold(env, env.tasks("train"))
    assert [(r.task_id, r.reward, r.calls, r.errors) for r in replays] == [
        ("tau1-train-0", 1.0, 2, 0), ("tau1-train-1", 1.0, 1, 0)]
    assert gold_summary(replays)["reward_mean"] == 1.0


def test_a_gold_action_that_fails_on_tau2s_database_shows_in_the_replay(env):
    (replay,) = replay_gold(env, env.tasks("dev"))
    assert replay.errors == 1 and replay.calls == 1  # τ2 has no order #W0000000


def test_a_replay_changes_only_its_own_copy_of_tau2s_database(env):
    task = env.tasks("train")[0]
    replay_gold(env, [task])  # cancels #W2974929 in its session's copy
    session = env.reset(task)
    try:
        assert json.loads(session.step(ToolCall("get_order_details", {"order_id": "#W2974929"})).content)[
            "status"] == "pending"
    finally:
        session.close()


def test_the_registry_builds_it_from_the_env_section_and_the_user_gets_tau2s_guidelines(checkout, monkeypatch):
    cfg = EnvConfig(domain="tau1-retail", tau1_dir=checkout)
    environment = make_environment(cfg)
    assert isinstance(environment, Tau1Environment) and len(environment.tasks("train")) == 2
    monkeypatch.setenv("MUAJAX_TAU1_TEST_KEY", "k")
    user = make_user(UserConfig(kind="openai", model="m", api_key_env="MUAJAX_TAU1_TEST_KEY"), cfg)
    assert user.guidelines == tau2_user_guidelines("retail")
    with pytest.raises(DomainConfigError, match=r"env\.tau1_dir \(--tau1-dir\).*tau1-airline"):
        make_environment(EnvConfig(domain="tau1-airline"))


def test_a_config_on_tau1_must_name_the_checkout(checkout):
    with pytest.raises(ConfigError, match=r"env\.tau1_dir.*must name a checkout of sierra-research/tau-bench"):
        load_config(None, ["env.domain=tau1-retail"])
    cfg = load_config(None, ["env.domain=tau1-retail", f"env.tau1_dir={checkout}"])
    assert cfg.env.tau1_dir == checkout


def test_the_eval_command_replays_the_gold_of_a_tau1_split(checkout, tmp_path, capsys):
    from muajax.eval import main

    out = str(tmp_path / "gold.json")
    assert main(["--policy", "gold", "--domain", "tau1-retail", "--split", "train", "--tau1-dir", checkout,
                 "--out", out]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["domain"], summary["split"], summary["n"], summary["reward_mean"]) == ("tau1-retail", "train", 2, 1.0)
    assert [t["task_id"] for t in json.load(open(out))["tasks"]] == ["tau1-train-0", "tau1-train-1"]
    assert main(["--policy", "gold", "--domain", "tau1-retail", "--split", "train", "--out", out]) == 2
    assert "env.tau1_dir (--tau1-dir)" in capsys.readouterr().err


def test_the_shipped_tau1_run_trains_on_tau1s_train_split_and_evaluates_on_tau2s_test_split(checkout):
    from muajax.runtime import run_tasks

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    cfg = load_config(os.path.join(root, "configs", "runs", "qwen3-8b-tau1.yaml"), [f"env.tau1_dir={checkout}"])
    environment = make_environment(cfg.env)
    train, held_out = run_tasks.train_tasks(cfg, environment), run_tasks.eval_tasks(cfg, environment)
    assert [t.task_id for t in train] == ["tau1-train-0", "tau1-train-1"]
    assert len(held_out) == 40 and {t.domain for t in held_out} == {"retail"}
    assert all(not t.task_id.startswith("tau1-") for t in held_out)
