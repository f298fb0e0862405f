"""The GRPO stage's mini-batch updates: `grpo.ppo_epochs` passes over the step's batch in
mini-batches of `grpo.minibatch_size`, as verl does; the default is the paper's one
update on the whole batch."""
import json
import os

import jax
import numpy as np
import pytest

from muajax.config.schema import ConfigError, load_config
from muajax.domains.base import Domain
from muajax.models.tokenizer import load_tokenizer
from muajax.models.vocab import DomainTokenizer, DomainVocab
from muajax.runtime import build
from muajax.train.context import build_context
from muajax.train.grpo import run_grpo
from tests.support.tiny_models import arch_override
from tests.support.toy_domain import SayYesEnvironment, StopUser

BASE = ["run.stages=[grpo]", "model.vocab=domain",
        arch_override(max_position_embeddings=256),
        "rollout.n_per_task=2", "rollout.tasks_per_step=2", "rollout.max_new_tokens_per_turn=4",
        "rollout.max_context=128", "rollout.max_turns=2", "grpo.steps=1", "grpo.learning_rate=1e-2",
        "grpo.kl_coef=0", "metrics.progress_bar=false", "metrics.tensorboard=false", "checkpoint.every_steps=100"]


def one_step(tmp_path, name, *overrides):
    base = load_tokenizer()
    words = base.encode("yes no maybe", add_special_tokens=False)
    prompt = base.encode("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    tok = DomainTokenizer(base, DomainVocab(words + prompt))
    cfg = load_config(None, [*BASE, f"run.out_dir={tmp_path}", f"run.name={name}", *overrides])
    ctx = build_context(cfg, domain=Domain(SayYesEnvironment(), StopUser()), tokenizer=tok)
    params = build.initial_params(ctx.model_cfg, None, ctx.mesh, 0)
    trained = run_grpo(ctx, params)
    record = json.loads(open(os.path.join(cfg.run_dir, "metrics.jsonl")).readline())
    return params, trained, record


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def paper_step(tmp_path_factory):
    return one_step(tmp_path_factory.mktemp("grpo"), "paper")


def test_ppo_epochs_make_several_updates_per_step(tmp_path, paper_step):
    start, paper, rec_paper = paper_step
    _, verl, rec_verl = one_step(tmp_path, "verl", "grpo.minibatch_size=2", "grpo.ppo_epochs=2")
    assert rec_paper["updates"] == 1 and rec_verl["updates"] == 4  # 2 epochs x (4 rows / 2)
    moved_paper = sum(float(np.abs(a - b).sum()) for a, b in zip(leaves(paper), leaves(start)))
    moved_verl = sum(float(np.abs(a - b).sum()) for a, b in zip(leaves(verl), leaves(start)))
    assert moved_paper > 0 and moved_verl > 1.5 * moved_paper


def test_one_mini_batch_of_the_whole_batch_is_the_paper_s_update(tmp_path, paper_step):
    _, paper, _ = paper_step
    _, whole, record = one_step(tmp_path, "whole", "grpo.minibatch_size=4")
    assert record["updates"] == 1
    for a, b in zip(leaves(paper), leaves(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_ppo_epochs_need_a_mini_batch_size_that_divides_the_batch():
    with pytest.raises(ConfigError, match="'grpo.ppo_epochs' .*needs grpo.minibatch_size"):
        load_config(None, ["grpo.ppo_epochs=2"])
    with pytest.raises(ConfigError, match="'grpo.minibatch_size' \\(3\\) must divide the rollout batch"):
        load_config(None, ["grpo.minibatch_size=3", "rollout.n_per_task=2", "rollout.tasks_per_step=2"])


def test_a_run_whose_steps_keep_going_non_finite_stops_after_saving(tmp_path):
    """lr=inf: the first update makes the params non-finite, every later step's loss is NaN
    and its update is skipped; past grpo.max_consecutive_skips the run stops, saved."""
    from muajax.runtime.checkpoint import finished_steps
    from muajax.train.loop import TrainingStopped
    from tests.support.toy_run import toy_config, toy_trainer

    cfg = toy_config(tmp_path, "grpo.learning_rate=inf", "grpo.steps=10", "grpo.max_consecutive_skips=2",
                     "checkpoint.every_steps=100")
    trainer = toy_trainer(cfg)
    with pytest.raises(TrainingStopped, match=r"stopped at step 4: 3 steps in a row \(steps 2-4\) had a non-finite "
                                              r"loss or gradient .*grpo.max_consecutive_skips=2"):
        trainer.run()
    records = [json.loads(line) for line in open(os.path.join(cfg.run_dir, "metrics.jsonl"))]
    assert [r["skipped"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert finished_steps(os.path.join(cfg.checkpoint_dir, "grpo")) == [4]  # the schedule saves at 100 only
    assert not os.path.exists(os.path.join(cfg.run_dir, "eval_grpo.json"))  # a stopped run is not evaluated


def test_recomputed_old_logprobs_in_the_grpo_stage(tmp_path):
    # one update per step: the update's own forward gives the old logprobs, ratio exactly 1
    _, _, record = one_step(tmp_path, "recompute", "grpo.recompute_old_logprobs=true")
    assert record["ratio_mean"] == 1.0 and record["ppo_kl"] == 0.0 and record["clip_frac"] == 0.0
    # mini-batches: one forward before the first update (here one mini-batch of the whole batch)
    _, _, record = one_step(tmp_path, "recompute-mini", "grpo.recompute_old_logprobs=true", "grpo.minibatch_size=4")
    assert record["updates"] == 1 and abs(record["ratio_mean"] - 1.0) < 1e-5 and abs(record["ppo_kl"]) < 1e-5
