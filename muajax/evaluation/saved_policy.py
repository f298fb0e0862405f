"""Evaluate a saved policy in process (`python -m muajax.eval`, the default `--protocol muajax`),
or replay the gold actions (`--policy gold`).

The muajax protocol is the training-consistent diagnostic: the same engine and rollout
loop as training, with the switches that bring it to τ2's rules where they differ from
training's: every tool call of a message runs, in order; an episode that did not end as a
conversation ends (cut at max_turns or the context, a malformed call, a failure) scores 0;
τ2 domains get the tools τ2's own agent gets (no `think`); BFCL gets its function-calling
prompt. What stays muajax's: the canned opening user message, and `max_turns` (30, BFCL
200) where τ2 counts 200 steps (`--protocol tau2` is τ2's own runner). Greedy by default;
τ-bench's told-the-user check is on. Each domain is rolled out and reported on its own;
on τ2's test split each also gets a de-duplicated score without the split twins.

The simulated user (`eval_user_config`): the fields given on the command line override
the run's evaluation user (`eval.user`, else its training `user`) when that user suits
the domain, else the defaults (scripted for builtin, BFCL's own turns, an OpenAI-compatible
endpoint for τ2 and MCP).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from typing import Any

from muajax.agent.pass_k import summarize_domains, task_records
from muajax.agent.gold import gold_summary, replay_gold
from muajax.agent.rollout import run_rollouts_sync
from muajax.agent.rollout_config import RolloutConfig
from muajax.settings.fields import ConfigError, from_dict
from muajax.config.schema import EnvConfig, TrainConfig, UserConfig, load_config
from muajax.domains.acebench.environment import MAX_TURNS as ACEBENCH_MAX_TURNS
from muajax.domains.acebench.scoring import gold_failures, subset_figures
from muajax.domains.registry import TAU2_DOMAINS, DomainConfigError, make_domain, make_environment, make_user
from muajax.runtime.policy import Policy, load_policy, make_engine

DEFAULT_CONTEXT = 16384  # a policy with no run config (an HF directory)
SCRIPTED_DOMAINS = ("builtin", "bfcl")  # domains whose default user needs no model
MAX_TURNS = {"bfcl": 200, "acebench": ACEBENCH_MAX_TURNS}  # --max-turns' default per domain (else 30)


@dataclasses.dataclass(frozen=True)
class EvalRequest:
    """What to evaluate and how (the eval command's options)."""

    checkpoint: str | None  # None only for the gold policy
    domains: tuple[str, ...]
    split: str = "test"
    stage: str | None = None
    step: int | None = None
    bfcl_category: str = "multi_turn_base"
    trials: int = 4
    max_tasks: int | None = None
    task_ids: tuple[str, ...] | None = None  # only these tasks of the split
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    user: dict[str, Any] = dataclasses.field(default_factory=dict)  # `UserConfig` fields given explicitly
    max_turns: int | None = None  # None: MAX_TURNS per domain, else 30
    max_new_tokens: int | None = None
    max_context: int | None = None
    slots: int = 32
    terse_tools: bool | None = None
    communicate_info: bool = True
    dtype: str | None = None
    out: str | None = None
    config: str | None = None  # a run config file: its env section and evaluation user
    acebench_dir: str | None = None  # acebench: the ACEBench checkout (else the run's env.acebench_dir)
    acebench_language: str | None = None  # acebench: en or zh (else the run's, else en)
    tau1_dir: str | None = None  # tau1-* domains: the tau-bench checkout (else the run's env.tau1_dir)


def eval_user_config(given: Mapping[str, Any], run_cfg: TrainConfig | None, domain: str) -> UserConfig:
    """The evaluation user of `domain` (see the module docstring); `given` are the fields set
    explicitly (None values are unset)."""
    base: dict[str, Any] = {"kind": "scripted" if domain in SCRIPTED_DOMAINS else "openai"}
    run_user = run_cfg.eval_user if run_cfg is not None and domain != "bfcl" else None
    if run_user is not None and (run_user.kind == "openai" or domain == "builtin"):
        base = dataclasses.asdict(run_user)
    given = {k: v for k, v in given.items() if v is not None}
    if given.get("kind", base["kind"]) != base["kind"]:  # another kind: the run's settings do not carry over
        base = {"kind": given["kind"]}
    merged = {**base, **given}
    if merged["kind"] == "openai" and not merged.get("model"):
        raise ConfigError(f"the simulated user of {domain} is an OpenAI-compatible endpoint: give --user-model (and "
                          "usually --user-base-url), or evaluate a run whose config sets eval.user or user")
    return from_dict(UserConfig, merged, "user")


def domain_env_config(request: EvalRequest, run_cfg: TrainConfig | None, domain: str) -> EnvConfig:
    """The env section that builds `domain`: the run's when it trained on it (its prompt
    format, e.g. terse tools, its MCP servers), else defaults; τ2's own tool list."""
    run_env = run_cfg.env if run_cfg is not None else None
    trained = run_env is not None and (domain in run_env.domains or (run_env.domain == domain and not run_env.domains))
    if domain == "mcp" and not trained:
        raise DomainConfigError("--domain mcp needs its servers and scenarios: pass --config FILE (a run config with "
                                "env.domain: mcp) or evaluate a run trained on MCP")
    env = dataclasses.replace(run_env, domain=domain, domains=()) if trained else EnvConfig(domain=domain)
    updates: dict[str, Any] = {"tau2_tools": "tau2"}
    if domain == "bfcl":
        updates["bfcl_category"] = request.bfcl_category
    if request.tau1_dir is not None:
        updates["tau1_dir"] = request.tau1_dir
    if domain == "acebench":
        updates.update(acebench_dir=request.acebench_dir or env.acebench_dir,
                       acebench_language=request.acebench_language or env.acebench_language)
    if request.terse_tools is not None:
        updates["builtin_terse_tools"] = request.terse_tools
    return dataclasses.replace(env, **updates)


def rollout_limits(request: EvalRequest, policy: Policy) -> tuple[int, int]:
    """(max_context, max_new_tokens): the request, then the run's settings, then defaults,
    capped by what the model's positions allow."""
    run = policy.config.rollout if policy.config is not None else None
    context = request.max_context or (run.max_context if run else DEFAULT_CONTEXT)
    context = min(context, policy.model_cfg.max_position_embeddings)
    new = request.max_new_tokens or (run.max_new_tokens_per_turn if run else 1024)
    return context, min(new, context - 1)


def write_json(path: str, payload: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(tmp, path)
    return os.path.abspath(path)


def out_path(request: EvalRequest, name: str, prefix: str = "eval") -> str:
    """--out for one domain; with several, the domain's name is added before the extension."""
    if request.out is None:
        return f"{prefix}-{name}-{request.split}.json"
    if len(request.domains) == 1:
        return request.out
    stem, ext = os.path.splitext(request.out)
    return f"{stem}-{name}{ext or '.json'}"


def _twin_ids(domain: str):
    # τ2 (and litellm behind it) loads only for τ2 domains
    from muajax.domains.tau2.twins import twin_ids

    return twin_ids(domain)


def _evaluate_domain(request: EvalRequest, policy: Policy, run_cfg, engine, name: str, setup) -> dict[str, Any]:
    start = time.time()
    env_cfg, user_cfg, domain, tasks = setup
    context, new_tokens = rollout_limits(request, policy)
    end_on_malformed = run_cfg.rollout.end_on_malformed_call if run_cfg is not None else False
    options = RolloutConfig(n_per_task=request.trials, max_turns=request.max_turns or MAX_TURNS.get(name, 30),
                            max_new_tokens_per_turn=new_tokens, max_context=context, temperature=request.temperature,
                            top_p=request.top_p, communicate_info=request.communicate_info,
                            # BFCL never ends an episode over a bad call: its turn goes on
                            end_on_malformed_call=end_on_malformed and name != "bfcl",
                            # ACEBench scores the final state however the dialogue ended
                            execute_all_calls=True, zero_unfinished=name != "acebench")
    print(f"evaluating on {name}/{request.split}: {len(tasks)} tasks x {request.trials} trials, user "
          f"{user_cfg.kind}{f' {user_cfg.model}' if user_cfg.kind == 'openai' else ''}, temperature "
          f"{request.temperature:g}, context {context}", flush=True)
    trajectories = list(run_rollouts_sync(engine, policy.tokenizer, domain.env, domain.user, tasks, options=options,
                                          seed=request.seed))
    twins = _twin_ids if name in TAU2_DOMAINS and request.split == "test" else None
    parts = summarize_domains(trajectories, request.trials, twins=twins)
    if len(parts) != 1:  # one environment per domain here: its tasks share a domain name
        raise RuntimeError(f"{name}'s tasks name several domains: {', '.join(parts)}")
    (summary,) = parts.values()
    summary.update(domain=name, split=request.split, user=user_cfg.kind, user_model=user_cfg.model,
                   temperature=request.temperature, failed_rollouts=sum(t.failed for t in trajectories),
                   sampled_tokens=sum(t.num_sampled for t in trajectories), wall_s=round(time.time() - start, 2))
    label = name
    if name == "bfcl":
        summary["bfcl_category"] = env_cfg.bfcl_category
        label = f"bfcl-{env_cfg.bfcl_category}"
    if name == "acebench":  # its two subsets and their mean, as the paper reports them
        summary["acebench"] = {"language": env_cfg.acebench_language, **subset_figures(trajectories)}
        label = f"acebench-{env_cfg.acebench_language}"
    summary["out"] = write_json(out_path(request, label), {
        "summary": summary, "options": dataclasses.asdict(options),
        "tasks": task_records(trajectories, request.trials)})
    return summary


def select_tasks(request: EvalRequest, env, name: str) -> list:
    """The split's tasks, narrowed to `task_ids` (in the split's order), then to `max_tasks`."""
    tasks = env.tasks(request.split)
    if request.task_ids is not None:
        missing = sorted(set(request.task_ids) - {t.task_id for t in tasks})
        if missing:
            raise ValueError(f"{name} split {request.split!r} has no task {', '.join(map(repr, missing))}")
        tasks = [t for t in tasks if t.task_id in request.task_ids]
    tasks = tasks[: request.max_tasks]
    if not tasks:
        raise ValueError(f"{name} split {request.split!r} has no tasks")
    return tasks


def _setup(request: EvalRequest, run_cfg, name: str):
    env_cfg = domain_env_config(request, run_cfg, name)
    user_cfg = eval_user_config(request.user, run_cfg, name)
    domain = make_domain(env_cfg, user_cfg)
    return env_cfg, user_cfg, domain, select_tasks(request, domain.env, name)


def evaluate_checkpoint(request: EvalRequest) -> dict[str, Any]:
    """The muajax protocol on every requested domain: {"protocol", "split", "trials",
    "checkpoint", "domains": {domain: its summary (pass^k, success, partial, ...)}}."""
    start = time.time()
    policy = load_policy(request.checkpoint, stage=request.stage, step=request.step, dtype=request.dtype)
    print(f"loaded {policy.describe()}", flush=True)
    run_cfg = load_config(request.config) if request.config else policy.config
    setups = {name: _setup(request, run_cfg, name) for name in request.domains}  # every error before any rollout
    context, _ = rollout_limits(request, policy)
    slots = min(request.slots, max(len(s[3]) for s in setups.values()) * request.trials)
    engine = make_engine(policy, num_slots=slots, max_len=context)
    domains = {name: _evaluate_domain(request, policy, run_cfg, engine, name, setup) for name, setup in setups.items()}
    return {"protocol": "muajax", "split": request.split, "trials": request.trials, "checkpoint": policy.path,
            "stage": policy.stage, "step": policy.step, "domains": domains, "wall_s": round(time.time() - start, 2)}


def evaluate_gold(request: EvalRequest) -> dict[str, Any]:
    """Replay every task's gold actions (`muajax.agent.gold`) on one domain: n, reward_mean,
    the reward histogram, and the per-task JSON."""
    start = time.time()
    if len(request.domains) != 1:
        raise ValueError(f"the gold policy replays one domain at a time, got {', '.join(request.domains)}")
    (name,) = request.domains
    run_cfg = load_config(request.config) if request.config else None
    env_cfg = domain_env_config(request, run_cfg, name)
    env = make_environment(env_cfg)
    try:
        tasks = select_tasks(request, env, name)
        # BFCL's next user turns come from its scripted user; no other replay needs a user
        user = make_user(UserConfig(), env_cfg) if name == "bfcl" else None
        replays = replay_gold(env, tasks, user)
    finally:
        close = getattr(env, "close", None)  # MCP environments hold server processes
        if callable(close):
            close()
    summary = {"policy": "gold", "domain": name, "split": request.split, **gold_summary(replays),
               "wall_s": round(time.time() - start, 2)}
    label = f"bfcl-{env_cfg.bfcl_category}" if name == "bfcl" else name
    if name == "acebench":
        summary["acebench"] = {"language": env_cfg.acebench_language, **subset_figures(replays),
                               "failures": gold_failures(replays)}
        label = f"acebench-{env_cfg.acebench_language}"
    summary["out"] = write_json(out_path(request, label, prefix="gold"), {
        "summary": summary, "tasks": [dataclasses.asdict(r) for r in replays]})
    return summary
