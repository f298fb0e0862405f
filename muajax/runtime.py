"""Build what a run needs from its config: mesh, model config, tokenizer, params,
environment and simulated user. Shared by train, eval and serve.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax

from muajax import parallel
from muajax.config import ConfigError, TrainConfig
from muajax.envs.base import Environment
from muajax.models.qwen3 import Qwen3Config, init_params
from muajax.models.tokenizer import load_tokenizer
from muajax.models.vocab import DOMAIN_VOCAB_FILE, DomainTokenizer, DomainVocab, checkpoint_tokenizer


def maybe_initialize_distributed() -> None:
    """Join a multi-process run when the launcher says so (see tpu/README.md, gpu/README.md):

    - MUAJAX_COORDINATOR=host:port, MUAJAX_NUM_PROCESSES, MUAJAX_PROCESS_ID: any cluster;
      MUAJAX_LOCAL_DEVICE_IDS=0,1,... restricts a process to those accelerators (one
      process per GPU);
    - MUAJAX_DISTRIBUTED=auto: jax detects the cluster itself (Cloud TPU VM slices through
      the metadata server, SLURM, Open MPI); GKE's TPU variables do the same.
    On TPU pods this is optional for the computation but orbax's multi-host checkpointing
    needs the coordination service it starts.
    """
    if os.environ.get("MUAJAX_COORDINATOR"):
        missing = [v for v in ("MUAJAX_NUM_PROCESSES", "MUAJAX_PROCESS_ID") if not os.environ.get(v)]
        if missing:
            raise SystemExit(f"MUAJAX_COORDINATOR is set but {' and '.join(missing)} is not")
        ids = os.environ.get("MUAJAX_LOCAL_DEVICE_IDS")
        jax.distributed.initialize(
            coordinator_address=os.environ["MUAJAX_COORDINATOR"],
            num_processes=int(os.environ["MUAJAX_NUM_PROCESSES"]),
            process_id=int(os.environ["MUAJAX_PROCESS_ID"]),
            local_device_ids=[int(i) for i in ids.split(",")] if ids else None,
            # explicit settings win: under SLURM, detection would otherwise narrow each
            # process to the one GPU numbered by its SLURM_LOCALID
            cluster_detection_method="deactivate",
        )
    elif (os.environ.get("MUAJAX_DISTRIBUTED") == "auto" or os.environ.get("TPU_WORKER_HOSTNAMES")
          or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS")):
        jax.distributed.initialize()


def make_mesh(cfg: TrainConfig):
    data, fsdp, tensor = cfg.mesh.resolve(jax.device_count())
    return parallel.make_mesh(data, fsdp, tensor)


def make_environment(cfg: TrainConfig) -> Environment:
    if cfg.env.domains:
        from muajax.envs.combined import CombinedEnvironment
        from muajax.envs.tau2 import Tau2Environment

        return CombinedEnvironment([Tau2Environment(d) for d in cfg.env.domains])
    domain = cfg.env.domain
    if domain == "builtin":
        from muajax.envs.builtin import BuiltinEnvironment

        e = cfg.env
        return BuiltinEnvironment(seed=e.builtin_seed, terse_tools=e.builtin_terse_tools, n_users=e.builtin_users,
                                  n_test_users=e.builtin_test_users, n_train_tasks=e.builtin_train_tasks,
                                  n_test_tasks=e.builtin_test_tasks, kind_weights=e.builtin_kind_weights)
    if domain in ("retail", "airline", "telecom"):
        from muajax.envs.tau2 import Tau2Environment

        return Tau2Environment(domain)
    if domain == "bfcl":
        from muajax.envs.bfcl import BfclEnvironment  # raises with the install line when nvidia-bfcl is missing

        return BfclEnvironment(cfg.env.bfcl_category)
    from muajax.envs.mcp import McpEnvironment

    return McpEnvironment.from_config(cfg.env.mcp)


def make_user(cfg: TrainConfig, env: Environment):
    if cfg.env.domain == "bfcl":
        # BFCL's user turns are the benchmark's data, never a model
        if cfg.user.kind != "scripted":
            raise SystemExit(f"env.domain=bfcl plays BFCL's scripted user turns; user.kind={cfg.user.kind!r} "
                             "does not apply (use user.kind=scripted)")
        from muajax.users.bfcl import BfclUser

        return BfclUser()
    if cfg.user.kind == "scripted":
        if cfg.env.domain != "builtin":
            raise SystemExit(f"user.kind=scripted exists only for env.domain=builtin; use user.kind=openai for "
                             f"{cfg.env.domain!r}")
        from muajax.users.scripted import ScriptedUser

        return ScriptedUser()
    from muajax.users.openai_user import OpenAIUserSimulator

    kwargs = dict(model=cfg.user.model, api_key_env=cfg.user.api_key_env, timeout_s=cfg.user.timeout_s,
                  max_retries=cfg.user.max_retries, max_concurrency=cfg.user.max_concurrency,
                  temperature=cfg.user.temperature)
    if cfg.user.base_url:
        kwargs["base_url"] = cfg.user.base_url
    tau2_domains = cfg.env.domains or ((cfg.env.domain,) if cfg.env.domain in ("retail", "airline", "telecom") else ())
    if tau2_domains:
        from muajax.envs.tau2 import tau2_user_guidelines

        # retail and airline share τ2's guidelines; telecom's add the user's own tools
        kwargs["guidelines"] = tau2_user_guidelines(tau2_domains[0])
    return OpenAIUserSimulator(**kwargs)


def domain_ids(env: Environment, tokenizer) -> set[int]:
    """Every Qwen3 id the domain can put in a conversation, taken from the token streams
    exactly as rendered (system turn, tool-call blocks, tool responses, chat markers) of
    the scripted expert's careful and careless conversations on all tasks — a vocabulary,
    not outcomes. Encoding bare message texts instead misses the ids BPE forms across the
    format's seams (`"}}\n`, ` "#`), which would then map to UNK in every tool call."""
    from muajax.chat import format_tool_error, render_messages_ids, system_prompt_ids
    from muajax.envs.builtin.expert import expert_conversation

    ids: set[int] = set(tokenizer.encode(format_tool_error("tool call is not valid JSON"), add_special_tokens=False))
    for split in ("train", "test"):
        for task in env.tasks(split):
            session = env.reset(task)
            try:
                system, tools = env.policy_for(task), session.tools()
            finally:
                session.close()
            ids.update(system_prompt_ids(tokenizer, system, tools))
            for careless in (0.0, 1.0):
                messages, _ = expert_conversation(env, task, careless=careless, seed=0, evaluate=False)
                ids.update(render_messages_ids(tokenizer, system, tools, messages)[0])
    return ids


def warmup_windows(cfg: TrainConfig) -> tuple[list[dict], ...]:
    """The built-in domain's warm-up windows for this run (`sft.domain_warmup_*`)."""
    from muajax.envs.builtin.warmup import warmup_windows as windows

    return windows(cfg.env.builtin_seed, shops=cfg.sft.domain_warmup_shops)


def model_and_tokenizer(cfg: TrainConfig, env: Environment, run_dir: str, tokenizer=None):
    """(Qwen3Config, tokenizer, hf_dir or None). A domain vocabulary is built once and
    saved in the run directory, so a resumed run reads back the same ids."""
    m = cfg.model
    dtypes = dict(param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat)
    if m.hf_dir:
        from muajax.models.hf import load_config

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
        from muajax.models.presets import preset_config

        return preset_config(m.preset, **dtypes), tokenizer, None
    arch = dataclasses.asdict(m.arch)
    if m.vocab == "domain":
        path = os.path.join(run_dir, "vocab.json")
        if os.path.isfile(path):
            vocab = DomainVocab.load(path)
        else:
            ids = domain_ids(env, tokenizer)
            if cfg.sft.domain_warmup_steps and "sft" in cfg.run.stages:
                from muajax.chat import render_messages_ids

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
    from muajax.pretrain import BASE_META_FILE

    meta_path = os.path.join(m.hf_dir, BASE_META_FILE)
    if not os.path.isfile(meta_path):
        return
    with open(meta_path) as f:
        seeds = json.load(f).get("shop_seeds", [])
    if cfg.env.domain == "builtin" and cfg.env.builtin_seed in seeds:
        raise ConfigError(f"env.builtin_seed: shop {cfg.env.builtin_seed} is one the base model in {m.hf_dir} was "
                          f"pretrained on (shops {seeds[0]}..{seeds[-1]}); its tasks would not be held out")


def initial_params(model_cfg: Qwen3Config, hf_dir: str | None, mesh, seed: int):
    shardings = parallel.param_shardings(model_cfg, mesh)
    if hf_dir:
        from muajax.models.hf import load_params

        params, _ = load_params(hf_dir, model_cfg, shardings)
        return params
    return jax.jit(lambda key: init_params(model_cfg, key), out_shardings=shardings)(jax.random.key(seed))
