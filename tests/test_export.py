"""`python -m muajax.export` and `muajax.runtime.policy`: muajax run directories (full and
domain vocabulary) → Hugging Face directories that `transformers` loads with the same
logits (float32, <= 1e-4)."""
import json
import os

import jax
import numpy as np
import pytest

from muajax.models.tokenizer import load_tokenizer
from tests.support.tiny_models import arch_override

DOMAIN_TEXTS = ["<|im_start|>user\nHello! Your order #o113 is cancelled.<|im_end|>\n<|im_start|>assistant\n",
                "<tool_call>\n{\"name\": \"get_order\"}\n</tool_call>"]


def make_run_dir(root, *, domain_vocab: bool, tied: bool = True, steps=(3,), seed: int = 0):
    """A muajax run directory as the trainer leaves it: config.yaml, (vocab.json,) and
    orbax checkpoints of the full TrainState under checkpoints/sft/<step>."""
    import jax.numpy as jnp

    from muajax.runtime.checkpoint import Checkpointer
    from muajax.settings.fields import config_to_dict
    from muajax.settings.loader import dump_yaml
    from muajax.config.schema import load_config
    from muajax.models.qwen3 import init_params
    from muajax.models.vocab import DomainTokenizer, DomainVocab
    from muajax.rl.optim import optimizer_from_config
    from muajax.rl.step import TrainState
    from muajax.runtime.build import model_and_tokenizer

    cfg = load_config(None, [f"run.out_dir={root}", "run.name=run", arch_override(tie_word_embeddings=tied),
                             f"model.vocab={'domain' if domain_vocab else 'full'}", "rollout.max_context=2048",
                             "rollout.max_new_tokens_per_turn=64"])
    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(os.path.join(cfg.run_dir, "config.yaml"), "w") as f:
        f.write(dump_yaml(cfg))
    tokenizer = None
    if domain_vocab:
        vocab = DomainVocab.from_texts(load_tokenizer(), DOMAIN_TEXTS)
        vocab.save(os.path.join(cfg.run_dir, "vocab.json"))
        tokenizer = DomainTokenizer(load_tokenizer(), vocab)
    model_cfg, tokenizer, _ = model_and_tokenizer(cfg, None, cfg.run_dir, tokenizer)
    optimizer = optimizer_from_config(cfg.sft, total_steps=10)
    ckpt = Checkpointer(os.path.join(cfg.checkpoint_dir, "sft"), keep=5)
    params = {}
    for i, step in enumerate(steps):
        params[step] = init_params(model_cfg, jax.random.key(seed + i))
        # the trainer's state layout (optimizer state included), built without compiling a train step
        state = TrainState(jnp.int32(step), params[step], optimizer.init(params[step]), jnp.int32(0))
        ckpt.save(step, state, config=config_to_dict(cfg), force=True)
    ckpt.close()
    return cfg.run_dir, model_cfg, tokenizer, params


def muajax_logits(params, model_cfg, ids):
    from muajax.models.qwen3 import forward

    logits, _ = forward(params, model_cfg, jax.numpy.asarray([ids], jax.numpy.int32))
    return np.asarray(logits[0], np.float32)


def hf_logits(path, qwen_ids):
    import torch
    import transformers

    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([qwen_ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def domain_run(tmp_path_factory):
    """A domain-vocabulary run (a few hundred ids: cheap to save), checkpoints at steps 2 and 3."""
    return make_run_dir(tmp_path_factory.mktemp("domain"), domain_vocab=True, steps=(2, 3))


def test_domain_vocab_run_exports_expanded_and_matches_transformers(tmp_path, domain_run, tokenizer):
    import transformers

    from muajax.export import QWEN3_VOCAB_SIZE, main

    run_dir, model_cfg, tok, params = domain_run
    out = tmp_path / "hf"
    assert main(["--checkpoint", run_dir, "--out", str(out), "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == QWEN3_VOCAB_SIZE and config["torch_dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [151645, 151643]
    info = json.loads((out / "muajax_export.json").read_text())
    assert info["stage"] == "sft" and info["step"] == 3 and "not -inf" in info["note"]

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "<|im_start|>user\nHello! Your order #o113<|im_end|>\n<|im_start|>assistant\n"
    qwen_ids = hf_tok.encode(text, add_special_tokens=False)
    assert qwen_ids == tokenizer.encode(text, add_special_tokens=False)
    assert hf_tok.chat_template and "<|im_start|>" in hf_tok.chat_template
    compact = tok.encode(text)
    assert tok.vocab.to_qwen(compact) == qwen_ids  # every id of the text is in the domain

    ours = muajax_logits(params[3], model_cfg, compact)
    theirs = hf_logits(out, qwen_ids)
    in_domain = np.asarray(tok.vocab.qwen_ids)
    np.testing.assert_allclose(theirs[:, in_domain], ours[:, : len(in_domain)], atol=1e-4, rtol=0)
    outside = np.setdiff1d(np.arange(QWEN3_VOCAB_SIZE), in_domain)
    assert np.all(theirs[:, outside] == 0.0)  # documented: zero rows give logit 0, not -inf


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A full-vocabulary run with an untied head."""
    return make_run_dir(tmp_path_factory.mktemp("full"), domain_vocab=False, tied=False, steps=(5,))


def test_full_vocab_run_exports_float32_and_bfloat16(tmp_path, full_run):
    from muajax.export import export
    from muajax.models.safetensors_io import SafetensorsFile
    from muajax.runtime.policy import load_policy

    run_dir, model_cfg, tok, params = full_run
    result = export(run_dir, str(tmp_path / "f32"))
    assert result["dtype"] == "float32" and not result["domain_vocab_expanded"] and result["source"].endswith("/5")
    ids = tok.encode("<|im_start|>user\nWhere is my order?<|im_end|>\n")
    np.testing.assert_allclose(hf_logits(tmp_path / "f32", ids), muajax_logits(params[5], model_cfg, ids),
                               atol=1e-4, rtol=0)

    export(run_dir, str(tmp_path / "bf16"), dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    stored = SafetensorsFile(str(tmp_path / "bf16" / "model.safetensors"))
    assert {str(stored.dtype(name)) for name in stored.keys()} == {"bfloat16"}  # noqa: SIM118 - not a dict
    again = load_policy(str(tmp_path / "bf16"), dtype="float32")  # the export loads back into muajax
    np.testing.assert_allclose(np.asarray(again.params["lm_head"]), np.asarray(params[5]["lm_head"]),
                               rtol=1e-2, atol=1e-4)


def test_policy_loading_picks_steps_and_explains_failures(tmp_path, domain_run):
    from muajax.export import main
    from muajax.runtime.policy import PolicyLoadError, load_policy

    run_dir, _, _, params = domain_run
    newest = load_policy(run_dir)
    assert (newest.stage, newest.step) == ("sft", 3) and newest.vocab is not None
    np.testing.assert_array_equal(np.asarray(newest.params["embed"]), np.asarray(params[3]["embed"]))
    older = load_policy(os.path.join(run_dir, "checkpoints", "sft", "2"))
    np.testing.assert_array_equal(np.asarray(older.params["embed"]), np.asarray(params[2]["embed"]))
    assert load_policy(os.path.join(run_dir, "checkpoints"), step=2).step == 2
    with pytest.raises(PolicyLoadError, match=r"no step 4 \(steps: \[2, 3\]\)"):
        load_policy(run_dir, step=4)
    with pytest.raises(PolicyLoadError, match="no checkpoint found"):
        load_policy(str(tmp_path))
    with pytest.raises(PolicyLoadError, match="no checkpoint found"):
        load_policy(run_dir, stage="grpo")

    os.makedirs(tmp_path / "busy")
    (tmp_path / "busy" / "x").write_text("")
    assert main(["--checkpoint", run_dir, "--out", str(tmp_path / "busy")]) == 2
    assert main(["--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
