"""τ2-bench's official protocol against a muajax checkpoint (`python -m muajax.eval --protocol tau2`).

The checkpoint is served by muajax's own OpenAI-compatible server, in this process, on
127.0.0.1 at a free port; τ2's own runner (`tau2.run.run_tasks`, what `tau2 run` calls)
does everything else: τ2's orchestrator (the agent greets, then the user LLM writes; every
tool call of a message runs; at most `max_steps` steps, 200 by default, and `max_errors`
tool errors), τ2's LLM agent with its system prompt (its agent instruction and the domain
policy) and τ2's tool list, τ2's user simulator, and τ2's evaluator (any ending but an
agent or user stop scores 0). pass^k is τ2's own metric (`compute_metrics`), per domain,
over the split's tasks `trials` times each; the de-duplicated score is the same metric
without the split twins (`muajax.domains.tau2.twins`).

A simulation that raises (e.g. a conversation longer than the served context, or an agent
reply with neither text nor a call) is scored 0 as τ2's `skip_failed_samples` does, and
counted in `skipped`. When every simulation of a domain failed, one short request asks the
user endpoint whether it answers: if not, the evaluation stops and says why; if it does, the
agent's replies were at fault and the zeros stand.

Each domain's results (τ2's `Results`, every conversation) are written as JSON with the API
keys removed: τ2 records its LLM arguments in the results' info.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import Counter
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would otherwise use the network

import litellm  # noqa: E402
from tau2.evaluator.evaluator import EvaluationType  # noqa: E402
from tau2.metrics.agent_metrics import compute_metrics  # noqa: E402
from tau2.run import get_tasks, run_tasks  # noqa: E402

from muajax.settings.fields import ConfigError  # noqa: E402
from muajax.config.schema import UserConfig, load_config  # noqa: E402
from muajax.domains.tau2.twins import twin_ids  # noqa: E402
from muajax.serving.app import BackgroundServer, create_app  # noqa: E402
from muajax.serving.loading import ServeOptions, build_service  # noqa: E402
from muajax.evaluation.saved_policy import DEFAULT_CONTEXT, eval_user_config  # noqa: E402
from muajax.runtime.policy import Policy, load_policy  # noqa: E402

AGENT_MODEL = "muajax-agent"  # the served model's name
TAU2_DEFAULT_SEED = 300  # `tau2 run`'s


@dataclasses.dataclass(frozen=True)
class Tau2ProtocolRequest:
    checkpoint: str
    domains: tuple[str, ...]
    split: str = "test"  # a τ2 task split: train, test or base (every task)
    trials: int = 4
    max_tasks: int | None = None
    task_ids: tuple[str, ...] | None = None
    stage: str | None = None
    step: int | None = None
    dtype: str | None = None
    user: dict[str, Any] = dataclasses.field(default_factory=dict)  # `UserConfig` fields given explicitly
    temperature: float = 0.0  # the agent's (τ2's default, the paper's greedy evaluation)
    max_steps: int = 200
    max_errors: int = 10
    max_retries: int = 3  # per LLM call, τ2's default
    concurrency: int = 8  # simulations in flight; the server decodes that many side by side
    max_context: int | None = None  # tokens per request (default: the run's, else 16384)
    max_new_tokens: int | None = None  # per agent message (default: the run's, else 1024)
    seed: int = TAU2_DEFAULT_SEED
    out: str | None = None
    config: str | None = None  # a run config file whose evaluation user to use


def _limits(request: Tau2ProtocolRequest, policy: Policy) -> tuple[int, int]:
    run = policy.config.rollout if policy.config is not None else None
    context = min(request.max_context or (run.max_context if run else DEFAULT_CONTEXT),
                  policy.model_cfg.max_position_embeddings)
    return context, min(request.max_new_tokens or (run.max_new_tokens_per_turn if run else 1024), context - 1)


def user_llm(user: UserConfig) -> tuple[str, dict[str, Any]]:
    """τ2's user model name and LLM arguments (litellm) for an OpenAI-compatible endpoint."""
    if user.kind != "openai":
        raise ConfigError(f"--protocol tau2 plays τ2's LLM user: it needs an OpenAI-compatible user, not "
                          f"user.kind={user.kind!r}")
    args: dict[str, Any] = {"temperature": user.temperature, "num_retries": user.max_retries,
                            "timeout": user.timeout_s}
    model = user.model
    if user.base_url:
        args["base_url"] = user.base_url
        model = model if model.startswith("openai/") else f"openai/{model}"  # litellm: any OpenAI-style server
    key = os.environ.get(user.api_key_env) if user.api_key_env else None
    if key:
        args["api_key"] = key
    elif user.base_url:
        args["api_key"] = "unused"  # the OpenAI client wants one; a local server ignores it
    return model, args


def user_unreachable(model: str, args: dict[str, Any]) -> str | None:
    """Why the user LLM does not answer one short request, or None when it does."""
    probe = {k: v for k, v in args.items() if k != "temperature"}
    try:
        litellm.completion(model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=1, **probe)
    except Exception as e:  # noqa: BLE001 - any failure to answer is the finding
        message = str(e)[:300]
        if args.get("api_key"):  # an endpoint may quote the key it refused
            message = message.replace(args["api_key"], "***")
        return f"{type(e).__name__}: {message}"
    return None


def _metrics(results) -> dict[str, Any]:
    metrics = compute_metrics(results)
    return {"tasks": len({s.task_id for s in results.simulations}), "avg_reward": float(metrics.avg_reward),
            **{f"pass^{k}": float(v) for k, v in sorted(metrics.pass_hat_ks.items())}}


def _scrubbed(results) -> dict[str, Any]:
    payload = results.model_dump(mode="json")
    for role in ("agent_info", "user_info"):
        (payload.get("info", {}).get(role, {}).get("llm_args") or {}).pop("api_key", None)
    return payload


def _run_domain(request: Tau2ProtocolRequest, server_url: str, domain: str, user: UserConfig,
                max_tokens: int) -> dict[str, Any]:
    start = time.time()
    tasks = get_tasks(domain, task_split_name=request.split, num_tasks=request.max_tasks,
                      task_ids=list(request.task_ids) if request.task_ids else None)
    agent_args = {"base_url": server_url, "api_key": "unused", "temperature": request.temperature,
                  "max_tokens": max_tokens, "num_retries": request.max_retries}
    user_model, user_args = user_llm(user)
    print(f"τ2 protocol on {domain}/{request.split}: {len(tasks)} tasks x {request.trials} trials, user "
          f"{user.model}, max {request.max_steps} steps", flush=True)
    results = run_tasks(domain=domain, tasks=tasks, agent="llm_agent", user="user_simulator",
                        llm_agent=f"openai/{AGENT_MODEL}", llm_args_agent=agent_args, llm_user=user_model,
                        llm_args_user=user_args, num_trials=request.trials, max_steps=request.max_steps,
                        max_errors=request.max_errors, save_to=None, console_display=False,
                        evaluation_type=EvaluationType.ALL, max_concurrency=request.concurrency,
                        seed=request.seed, log_level="ERROR", skip_failed_samples=True)
    skipped = sum(bool(s.skipped) for s in results.simulations)
    if skipped == len(results.simulations):
        down = user_unreachable(user_model, user_args)
        if down:
            raise ConnectionError(f"every τ2 simulation of {domain} failed, and the user endpoint "
                                  f"{user.base_url or user.model} does not answer: {down}")
        # τ2 raises on some agent replies (an empty message, neither text nor a call): those are
        # the agent's failures, scored 0, not a reason to stop
        print(f"every τ2 simulation of {domain} failed while the user endpoint answers: the agent's "
              f"replies are at fault (each scored 0)", flush=True)
    figures = {"domain": domain, "split": request.split, "trials": request.trials, **_metrics(results),
               "simulations": len(results.simulations), "skipped": skipped,
               "terminations": dict(Counter(s.termination_reason.value for s in results.simulations)),
               "user_model": user.model}
    twins = twin_ids(domain) & {t.id for t in results.tasks}
    if twins:
        kept = results.model_copy(update={"tasks": [t for t in results.tasks if t.id not in twins],
                                          "simulations": [s for s in results.simulations if s.task_id not in twins]})
        # only twins evaluated: nothing is left to score (τ2's metrics need a simulation)
        scored = _metrics(kept) if kept.simulations else {"tasks": 0}
        figures["dedup"] = {**scored, "removed": sorted(twins)}
    figures["wall_s"] = round(time.time() - start, 2)
    out = _out_path(request, domain)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"figures": figures, "results": _scrubbed(results)}, f, indent=1)
    figures["out"] = os.path.abspath(out)
    return figures


def _out_path(request: Tau2ProtocolRequest, domain: str) -> str:
    if request.out is None:
        return f"tau2-{domain}-{request.split}.json"
    if len(request.domains) == 1:
        return request.out
    stem, ext = os.path.splitext(request.out)
    return f"{stem}-{domain}{ext or '.json'}"


def run_tau2_protocol(request: Tau2ProtocolRequest) -> dict[str, Any]:
    """Serve the checkpoint and run τ2's runner on each domain: {"protocol": "tau2", "split",
    "trials", "checkpoint", "domains": {domain: figures (pass^k, avg_reward, dedup, ...)}}."""
    start = time.time()
    policy = load_policy(request.checkpoint, stage=request.stage, step=request.step, dtype=request.dtype)
    print(f"loaded {policy.describe()}", flush=True)
    run_cfg = load_config(request.config) if request.config else policy.config
    users = {domain: eval_user_config(request.user, run_cfg, domain) for domain in request.domains}
    for user in users.values():
        user_llm(user)  # a user τ2 cannot play stops here, before anything is served
    context, max_tokens = _limits(request, policy)
    _, service = build_service(ServeOptions(checkpoint=request.checkpoint, slots=request.concurrency, max_len=context,
                                            max_tokens=max_tokens, model_name=AGENT_MODEL), policy=policy)
    with BackgroundServer(create_app(service)) as server:
        print(f"serving {AGENT_MODEL} at {server.url} ({request.concurrency} slots, context {context})", flush=True)
        domains = {d: _run_domain(request, server.url, d, users[d], max_tokens) for d in request.domains}
    return {"protocol": "tau2", "split": request.split, "trials": request.trials, "checkpoint": policy.path,
            "stage": policy.stage, "step": policy.step, "domains": domains, "wall_s": round(time.time() - start, 2)}
