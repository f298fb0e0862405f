"""Build what a run needs from its config: the mesh, the model config, the tokenizer (with
a domain vocabulary for tiny models) and the initial params. The domain (environment and
user) comes from `muajax.domains.registry`.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax

from muajax import parallel
from muajax.agent.chat import format_tool_error, render_messages_ids, system_prompt_ids
from muajax.config.schema import ConfigError, TrainConfig
from muajax.domains.base import Environment
from muajax.domains.builtin import BuiltinEnvironment
from muajax.domains.builtin.base_record import seen_shops
from muajax.domains.builtin.expert import expert_conversation
from muajax.domains.builtin.copy_windows import warmup_windows as builtin_warmup_windows
from muajax.models.hf import load_config, load_params
from muajax.models.presets import preset_config
from muajax.models.qwen3 import Qwen3Config, init_params
from muajax.models.sharding import param_shardings
from muajax.models.tokenizer import load_tokenizer
from muajax.models.vocab import DOMAIN_VOCAB_FILE, DomainTokenizer, DomainVocab, checkpoint_tokenizer


def make_mesh(cfg: TrainConfig):
    return parallel.make_mesh(*cfg.mesh.resolve(jax.device_count()))


def _vocabulary_conversations(env: Environment, task) -> list[list[dict]]:
    """Conversations whose token streams hold the ids the domain uses: the built-in expert's
    (careful and careless), else the task's opening and its gold calls as the agent would
    write them (the results of the calls are not run: a tiny model sees those as text)."""
    if isinstance(env, BuiltinEnvironment):
        return [expert_conversation(env, task, careless=careless, seed=0, evaluate=False)[0]
                for careless in (0.0, 1.0)]
    messages = [{"role": "user", "content": task.first_user_message}]
    for i, call in enumerate(task.gold_actions):
        function = {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}
        messages.append({"role": "assistant", "content": "",
                         "tool_calls": [{"id": f"c{i}", "type": "function", "function": function}]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "ok"})
    return [messages]


def domain_ids(env: Environment, tokenizer, splits: tuple[str, ...] = ("train", "test")) -> set[int]:
    """Every Qwen3 id the domain can put in a conversation, taken from the token streams
    exactly as rendered (system turn, tool-call blocks, tool responses, chat markers) of
    `_vocabulary_conversations` on all tasks of `splits` — a vocabulary, not outcomes.
    Encoding bare message texts instead misses the ids BPE forms across the format's seams
    (`"}}\n`, ` "#`), which would then map to UNK in every tool call."""
    ids: set[int] = set(tokenizer.encode(format_tool_error("tool call is not valid JSON"), add_special_tokens=False))
    prompts: dict[str, tuple] = {}  # one system prompt per domain (an MCP session starts a server)
    for split in dict.fromkeys(splits):
        for task in env.tasks(split):
            if task.domain not in prompts:
                session = env.reset(task)
                try:
                    prompts[task.domain] = (env.policy_for(task), session.tools())
                finally:
                    session.close()
                ids.update(system_prompt_ids(tokenizer, *prompts[task.domain]))
            system, tools = prompts[task.domain]
            for messages in _vocabulary_conversations(env, task):
                ids.update(render_messages_ids(tokenizer, system, tools, messages)[0])
    return ids


def warmup_windows(cfg: TrainConfig) -> tuple[list[dict], ...]:
    """The built-in domain's warm-up windows for this run (`sft.domain_warmup_*`)."""
    return builtin_warmup_windows(cfg.env.builtin_seed, shops=cfg.sft.domain_warmup_shops)


def model_and_tokenizer(cfg: TrainConfig, env: Environment, run_dir: str, tokenizer=None):
    """(Qwen3Config, tokenizer, hf_dir or None). A domain vocabulary is built once and
    saved in the run directory, so a resumed run reads back the same ids."""
    m = cfg.model
    dtypes = dict(param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat, attention=m.attention,
                  logits_fp32=m.logits_fp32)
    if m.hf_dir:
        tokenizer = checkpoint_tokenizer(m.hf_dir)
        _check_checkpoint_fits_run(cfg, tokenizer)
        vocab_path = os.path.join(run_dir, "vocab.json")  # where evaluation and serving look for it
        if isinstance(tokenizer, DomainTokenizer) and jax.process_index() == 0 and not os.path.isfile(vocab_path):
            os.makedirs(run_dir, exist_ok=True)
            tokenizer.vocab.save(vocab_path)
        return load_config(m.hf_dir, **dtypes), tokenizer, m.hf_dir
    if tokenizer is not None:  # given by the caller (tests, custom domains)
        arch = dataclasses.asdict(m.arch) if m.arch else None
        if arch is not None and m.vocab == "domain":
            arch["vocab_size"] = tokenizer.vocab.padded_size()
        return (Qwen3Config(**arch, **dtypes) if arch else None), tokenizer, None
    tokenizer = load_tokenizer()
    if m.preset:
        return preset_config(m.preset, **dtypes), tokenizer, None
    arch = dataclasses.asdict(m.arch)
    if m.vocab == "domain":
        path = os.path.join(run_dir, "vocab.json")
        if os.path.isfile(path):
            vocab = DomainVocab.load(path)
        else:
            ids = domain_ids(env, tokenizer, (cfg.env.train_split, cfg.env.eval_split))
            if cfg.sft.domain_warmup_steps and "sft" in cfg.run.stages:
                for window in warmup_windows(cfg):
                    ids.update(render_messages_ids(tokenizer, None, None, window)[0])
            vocab = DomainVocab.from_texts(tokenizer, (), extra_ids=ids)
            if jax.process_index() == 0:
                os.makedirs(run_dir, exist_ok=True)
                vocab.save(path)
        tokenizer = DomainTokenizer(tokenizer, vocab)
        arch["vocab_size"] = vocab.padded_size()
    return Qwen3Config(**arch, **dtypes), tokenizer, None


def _check_checkpoint_fits_run(cfg: TrainConfig, tokenizer) -> None:
    """An `hf_dir` whose vocabulary or pretraining data does not fit the run stops it here,
    before anything compiles."""
    m = cfg.model
    domain = isinstance(tokenizer, DomainTokenizer)
    if domain != (m.vocab == "domain"):
        raise ConfigError(f"model.vocab: {m.hf_dir} " + (
            f"holds a domain vocabulary ({DOMAIN_VOCAB_FILE}); set model.vocab=domain" if domain else
            f"has no {DOMAIN_VOCAB_FILE}; model.vocab=domain needs one (or use model.vocab=full)"))
    seeds = seen_shops(m.hf_dir)
    if cfg.env.domain == "builtin" and cfg.env.builtin_seed in seeds:
        raise ConfigError(f"env.builtin_seed: shop {cfg.env.builtin_seed} is one the base model in {m.hf_dir} was "
                          f"pretrained on (shops {seeds[0]}..{seeds[-1]}); its tasks would not be held out")


def initial_params(model_cfg: Qwen3Config, hf_dir: str | None, mesh, seed: int):
    shardings = param_shardings(model_cfg, mesh)
    if hf_dir:
        params, _ = load_params(hf_dir, model_cfg, shardings)
        return params
    return jax.jit(lambda key: init_params(model_cfg, key), out_shardings=shardings)(jax.random.key(seed))
