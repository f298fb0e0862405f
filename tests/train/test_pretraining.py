"""The warm-ups before SFT: copy and domain windows; seeded, and off when not asked for."""
import re

import pytest

from muajax.agent.chat import render_messages_ids
from muajax.config.schema import ConfigError, load_config
from muajax.domains.base import Domain
from muajax.models.vocab import DomainTokenizer, DomainVocab
from muajax.runtime import build
from muajax.train.context import build_context
from muajax.train.trainer import params_fingerprint
from muajax.train.pretraining import copy_warmup, domain_warmup
from tests.support.tiny_models import arch_override
from tests.support.toy_domain import SayYesEnvironment, StopUser


def test_copy_warmup_teaches_copying_and_is_seeded(tmp_path, capsys, tokenizer):
    tok = DomainTokenizer(tokenizer, DomainVocab(range(1000, 1200)))
    overrides = [f"run.out_dir={tmp_path}", "model.vocab=domain",
                 arch_override(hidden_size=64, intermediate_size=128, num_layers=2, head_dim=64,
                               max_position_embeddings=256),
                 "sft.copy_warmup_steps=120", "sft.copy_warmup_length=64", "sft.batch_size=8",
                 "sft.learning_rate=3e-3", "sft.warmup_ratio=0.1", "rollout.max_context=256", "rollout.max_new_tokens_per_turn=16",
                 "metrics.progress_bar=false"]
    ctx = build_context(load_config(None, overrides), domain=Domain(SayYesEnvironment(), StopUser()), tokenizer=tok)
    params = build.initial_params(ctx.model_cfg, None, ctx.mesh, 0)
    warmed = copy_warmup(ctx, params)
    nll = ctx.summary["copy_warmup_nll"]
    assert nll < 2.5, nll  # uniform would be ln(200) = 5.3: the repeated span is being copied
    assert "copy warm-up: 120 steps" in capsys.readouterr().out
    again = build_context(load_config(None, overrides), domain=Domain(SayYesEnvironment(), StopUser()), tokenizer=tok)
    assert params_fingerprint(copy_warmup(again, params)) == params_fingerprint(warmed)
    off = build_context(load_config(None, [o for o in overrides if not o.startswith("sft.copy_warmup_steps")]), domain=Domain(SayYesEnvironment(), StopUser()), tokenizer=tok)
    assert copy_warmup(off, params) is params


def test_domain_warmup_learns_its_windows_is_seeded_and_needs_the_builtin_domain(tmp_path, capsys):
    overrides = [f"run.out_dir={tmp_path}", "run.stages=[sft]", "model.vocab=domain",
                 arch_override(num_layers=2),
                 "env.builtin_users=12", "env.builtin_test_users=2", "env.builtin_train_tasks=20",
                 "env.builtin_test_tasks=4", "sft.domain_warmup_steps=30", "sft.domain_warmup_shops=1",
                 "sft.domain_warmup_batch_size=16", "sft.learning_rate=1e-2", "sft.warmup_ratio=0.1",
                 "rollout.max_context=1024", "rollout.max_new_tokens_per_turn=16", "metrics.progress_bar=false"]
    ctx = build_context(load_config(None, overrides))
    # the run's vocabulary covers the other shops' windows: no id of theirs maps to UNK
    unk = ctx.tok.vocab.unk_id
    windows = build.warmup_windows(ctx.cfg)
    assert len(windows) > 100
    assert all(unk not in render_messages_ids(ctx.tok, None, None, w)[0] for w in windows)
    params = build.initial_params(ctx.model_cfg, None, ctx.mesh, 0)
    warmed = domain_warmup(ctx, params)
    first, last = map(float, re.search(r"assistant nll ([\d.]+) -> ([\d.]+)", capsys.readouterr().out).groups())
    # means of the first and last 15 steps: from ~ln(vocab) to the calls' fixed format and beyond
    assert last < 0.65 * first, (first, last)
    again = build_context(load_config(None, overrides), tokenizer=ctx.tok)
    assert params_fingerprint(domain_warmup(again, params)) == params_fingerprint(warmed)
    off = build_context(load_config(None, [o for o in overrides if not o.startswith("sft.domain_warmup_steps")]),
                        tokenizer=ctx.tok)
    assert domain_warmup(off, params) is params
    with pytest.raises(ConfigError, match="sft.domain_warmup_steps"):
        load_config(None, ["env.domain=retail", "sft.data=x.jsonl", "sft.domain_warmup_steps=10"])


# --------------------------------------------------------------------------- kill -9, then resume
