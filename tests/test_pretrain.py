"""`python -m muajax.pretrain`: a base model in HF format with its domain vocabulary, which a
run loads by `model.hf_dir` and which refuses the shops it was trained on."""
import contextlib
import io
import json
import os

import numpy as np
import pytest

from muajax import pretrain

from muajax.domains.builtin.base_record import BASE_META_FILE
from muajax.domains.registry import make_environment
from muajax.runtime import build
from muajax.config.schema import ConfigError, load_config
from muajax.models.vocab import DOMAIN_VOCAB_FILE, DomainTokenizer
from muajax.runtime.policy import load_policy
from tests.support.tiny_models import arch_override

SMALL = [arch_override(num_layers=2),
         "env.builtin_users=12", "env.builtin_test_users=2", "env.builtin_train_tasks=20", "env.builtin_test_tasks=4",
         "sft.domain_warmup_steps=6", "sft.domain_warmup_shops=1", "sft.domain_warmup_batch_size=8",
         "sft.learning_rate=1e-2", "metrics.progress_bar=false"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrain")
    out, printed, log = root / "base", io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(log):
        assert pretrain.main(["--out", str(out), "--save-every", "2", f"run.out_dir={root / 'runs'}", *SMALL]) == 0
    return out, json.loads(printed.getvalue().strip().splitlines()[-1]), log.getvalue()


def test_pretrain_writes_an_hf_base_with_its_vocabulary_and_record(base):
    base, figures, log = base
    assert "[warm-up] step 6/6, nll " in log  # without a terminal (no bar) the log still shows progress
    assert figures["steps"] == 6 and figures["nll"] < figures["nll_first"]
    for name in ("config.json", "model.safetensors", DOMAIN_VOCAB_FILE, BASE_META_FILE):
        assert (base / name).is_file(), name
    assert sorted(p.name for p in base.glob("step-*")) == ["step-2", "step-4"]  # snapshots; the end is DIR itself
    meta = json.loads((base / BASE_META_FILE).read_text())
    assert meta["shop_seeds"] == [1000, 1001]  # the vocabulary's shop and the one warm-up shop
    assert meta["command"].startswith("python -m muajax.pretrain --out")
    policy = load_policy(str(base))
    assert isinstance(policy.tokenizer, DomainTokenizer)
    assert policy.model_cfg.vocab_size == policy.tokenizer.vocab.padded_size()
    ids = policy.tokenizer.encode("Hi. Please cancel my order #o123.")
    assert policy.tokenizer.vocab.unk_id not in ids and policy.tokenizer.decode(ids) == "Hi. Please cancel my order #o123."


def test_a_run_loads_the_base_and_refuses_what_does_not_fit(base, tmp_path, capsys, tiny_hf_dir):
    base, _, _ = base
    run = ["model.arch=null", f"model.hf_dir={base}", "model.vocab=domain", f"run.out_dir={tmp_path}",
           *[o for o in SMALL if not o.startswith("model.arch")]]
    cfg = load_config(None, run)
    model_cfg, tok, hf_dir = build.model_and_tokenizer(cfg, make_environment(cfg.env), cfg.run_dir)
    assert hf_dir == str(base) and isinstance(tok, DomainTokenizer)
    assert np.array_equal(tok.vocab.qwen_ids, load_policy(str(base)).tokenizer.vocab.qwen_ids)
    assert os.path.isfile(os.path.join(cfg.run_dir, "vocab.json"))  # where evaluation looks for it
    on_its_shop = load_config(None, [*run, "env.builtin_seed=1001"])
    with pytest.raises(ConfigError, match="env.builtin_seed: shop 1001 is one the base model .* was pretrained on"):
        build.model_and_tokenizer(on_its_shop, None, on_its_shop.run_dir)
    full = load_config(None, [*run, "model.vocab=full"])
    with pytest.raises(ConfigError, match="model.vocab: .* holds a domain vocabulary"):
        build.model_and_tokenizer(full, None, full.run_dir)
    from muajax.train import __main__ as train

    assert train.main([*run, "model.vocab=full"]) == 2  # the CLI says so and stops, before anything compiles
    assert "config error: model.vocab:" in capsys.readouterr().err
    plain = load_config(None, [*run, f"model.hf_dir={tiny_hf_dir}"])
    with pytest.raises(ConfigError, match="model.vocab: .* has no domain_vocab.json"):
        build.model_and_tokenizer(plain, None, plain.run_dir)


def test_pretrain_refuses_what_it_cannot_train(tmp_path, capsys):
    assert pretrain.main(["--out", str(tmp_path / "x"), "env.domain=retail", "sft.data=x.jsonl", *SMALL]) == 2
    assert "needs env.domain 'builtin'" in capsys.readouterr().err
    assert pretrain.main(["--out", str(tmp_path / "x"), *SMALL, "sft.domain_warmup_steps=0"]) == 2
    assert "sft.domain_warmup_steps" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_pretrain_continues_from_a_base_with_the_system_prompt(base, tmp_path):
    base, _, _ = base
    out, printed = tmp_path / "phase2", io.StringIO()
    args = ["--out", str(out), f"run.out_dir={tmp_path / 'runs'}", "model.arch=null", f"model.hf_dir={base}",
            "env.builtin_seed=1100", "sft.domain_warmup_system_prompt=true", "sft.domain_warmup_steps=4",
            *[o for o in SMALL if not o.startswith(("model.arch", "sft.domain_warmup_steps"))]]
    with contextlib.redirect_stdout(printed):
        assert pretrain.main(args) == 0
    figures = json.loads(printed.getvalue().strip().splitlines()[-1])
    assert figures["nll"] < figures["nll_first"]
    meta = json.loads((out / BASE_META_FILE).read_text())
    assert meta["system_prompt"] is True and meta["init"]["steps"] == 6
    assert meta["shop_seeds"] == [1000, 1001, 1100, 1101]  # what the earlier base saw counts too
    # the same vocabulary, carried over from the base
    assert (out / DOMAIN_VOCAB_FILE).read_text() == (base / DOMAIN_VOCAB_FILE).read_text()
