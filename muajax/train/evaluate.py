"""Evaluate a saved policy (`python -m muajax.eval`): every task of a split, `trials` times,
with a simulated user in the loop, through the same engine and rollout loop as training.

The agent runs greedy by default, as in the paper's evaluation; τ-bench's check that
required facts were told to the user is on (it is off only in training). The per-task
JSON holds every conversation.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from muajax.agent.evaluation import summarize, task_records
from muajax.agent.rollout import run_rollouts_sync
from muajax.agent.rollout_config import RolloutConfig
from muajax.config.fields import from_dict
from muajax.config.schema import EnvConfig, UserConfig
from muajax.domains.registry import make_domain
from muajax.train.policy_loading import Policy, load_policy, make_engine

DEFAULT_CONTEXT = 16384  # a policy with no run config (an HF directory)


@dataclasses.dataclass(frozen=True)
class EvalRequest:
    """What to evaluate and how (the eval command's options)."""

    checkpoint: str
    domain: str
    split: str = "test"
    stage: str | None = None
    step: int | None = None
    bfcl_category: str = "multi_turn_base"
    trials: int = 4
    max_tasks: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    user: dict[str, Any] = dataclasses.field(default_factory=dict)  # `UserConfig` fields
    max_turns: int = 30
    max_new_tokens: int | None = None
    max_context: int | None = None
    slots: int = 32
    terse_tools: bool | None = None
    communicate_info: bool = True
    dtype: str | None = None
    out: str | None = None


def domain_configs(request: EvalRequest, policy: Policy) -> tuple[EnvConfig, UserConfig]:
    """The env and user sections that build the domain: the run's own env settings when it
    trained on this domain (its prompt format, e.g. terse tools), else defaults."""
    base = policy.config
    if request.domain == "mcp" and (base is None or base.env.domain != "mcp"):
        raise ValueError("--domain mcp evaluates the MCP servers and scenarios of the run's config (env.mcp); "
                         f"{request.checkpoint} was not trained on env.domain=mcp")
    env = base.env if base is not None and base.env.domain == request.domain else EnvConfig(domain=request.domain)
    if request.domain == "bfcl":
        env = dataclasses.replace(env, bfcl_category=request.bfcl_category)
    if request.terse_tools is not None:
        env = dataclasses.replace(env, builtin_terse_tools=request.terse_tools)
    return env, from_dict(UserConfig, dict(request.user), "user")


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


def evaluate_checkpoint(request: EvalRequest) -> dict[str, Any]:
    """Run the evaluation; returns its summary (pass^k, success, partial score, turns, ...)."""
    start = time.time()
    policy = load_policy(request.checkpoint, stage=request.stage, step=request.step, dtype=request.dtype)
    print(f"loaded {policy.describe()}", flush=True)
    env_cfg, user_cfg = domain_configs(request, policy)
    domain = make_domain(env_cfg, user_cfg)
    tasks = domain.env.tasks(request.split)[: request.max_tasks]
    if not tasks:
        raise ValueError(f"{request.domain} split {request.split!r} has no tasks")
    context, new_tokens = rollout_limits(request, policy)
    slots = min(request.slots, len(tasks) * request.trials)
    engine = make_engine(policy, num_slots=slots, max_len=context)
    end_on_malformed = policy.config.rollout.end_on_malformed_call if policy.config is not None else False
    if request.domain == "bfcl" and env_cfg.bfcl_category == "multi_turn_miss_func":
        # a function added mid-conversation is not in the tool list the rollout checks calls against
        end_on_malformed = False
    options = RolloutConfig(n_per_task=request.trials, max_turns=request.max_turns,
                            max_new_tokens_per_turn=new_tokens, max_context=context,
                            temperature=request.temperature, top_p=request.top_p,
                            communicate_info=request.communicate_info, end_on_malformed_call=end_on_malformed)
    print(f"evaluating on {request.domain}/{request.split}: {len(tasks)} tasks x {request.trials} trials, user "
          f"{user_cfg.kind}, temperature {request.temperature:g}, {slots} slots, context {context}", flush=True)
    trajectories = list(run_rollouts_sync(engine, policy.tokenizer, domain.env, domain.user, tasks, options=options,
                                          seed=request.seed))
    summary = summarize(trajectories, request.trials)
    summary.update(domain=request.domain, split=request.split, user=user_cfg.kind, temperature=request.temperature,
                   checkpoint=policy.path, stage=policy.stage, step=policy.step,
                   failed_rollouts=sum(t.failed for t in trajectories),
                   sampled_tokens=sum(t.num_sampled for t in trajectories), wall_s=round(time.time() - start, 2))
    name = request.domain
    if request.domain == "bfcl":
        summary["bfcl_category"] = env_cfg.bfcl_category
        name = f"bfcl-{env_cfg.bfcl_category}"
    summary["out"] = write_json(request.out or f"eval-{name}-{request.split}.json", {
        "summary": summary, "options": dataclasses.asdict(options),
        "tasks": task_records(trajectories, request.trials)})
    return summary
