"""A run small enough to train in seconds: the say-yes toy domain, a one-layer model on a
domain vocabulary of a dozen ids, a user that stops at once."""
from __future__ import annotations

from muajax.config.schema import load_config
from muajax.domains.base import Domain
from muajax.models.tokenizer import load_tokenizer
from muajax.models.vocab import DomainTokenizer, DomainVocab
from muajax.train.trainer import Trainer
from tests.support.tiny_models import arch_override
from tests.support.toy_domain import SayYesEnvironment, StopUser

TOY = ["run.stages=[grpo]", "model.vocab=domain",
       arch_override(max_position_embeddings=256),
       "rollout.n_per_task=2", "rollout.tasks_per_step=2", "rollout.max_new_tokens_per_turn=4",
       "rollout.max_context=128", "rollout.max_turns=2", "grpo.steps=2", "grpo.learning_rate=1e-2",
       "grpo.kl_coef=0", "metrics.progress_bar=false", "metrics.tensorboard=false", "checkpoint.every_steps=1",
       "eval.max_tasks=2", "eval.trials=1"]


def toy_tokenizer() -> DomainTokenizer:
    base = load_tokenizer()
    words = base.encode("yes no maybe", add_special_tokens=False)
    prompt = base.encode("<|im_start|>system\nAnswer.<|im_end|>\n<|im_start|>user\nSay yes or no.<|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    return DomainTokenizer(base, DomainVocab(words + prompt))


def toy_config(out_dir, *overrides):
    return load_config(None, [*TOY, f"run.out_dir={out_dir}", *overrides])


def toy_trainer(cfg, **kwargs) -> Trainer:
    return Trainer(cfg, domain=Domain(SayYesEnvironment(), StopUser()), tokenizer=toy_tokenizer(), **kwargs)
