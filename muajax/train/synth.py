"""Cold-start SFT data from a run's own domain and simulated user (`python -m muajax.synth`).

An agent plays every task of a split against the domain (built from the `env` section, as
in training: τ2, the built-in shop, MCP scenarios) and the simulated user (the `user`
section, as in training); the conversations that earn reward 1 (τ-bench's output check
on) are kept, one JSON line each (`muajax.domains.base.sft_record`), for `sft.data`.
Conversations whose user or agent endpoint failed are never kept.

Agents: `expert`, the built-in domain's scripted expert (offline; it plays against the
domain's scripted user), or `openai`, any OpenAI-compatible chat endpoint given the tools
(`muajax.agent.openai_agent`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from typing import Any

from muajax.agent.openai_agent import AgentEndpoint, openai_records
from muajax.config.schema import EnvConfig, UserConfig
from muajax.domains.base import WRITES_CONFIRMED, Environment
from muajax.domains.builtin.expert import expert_records
from muajax.domains.registry import DomainConfigError, make_environment, make_user


@dataclasses.dataclass(frozen=True)
class SynthRequest:
    out: str
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    user: UserConfig = dataclasses.field(default_factory=UserConfig)
    agent: str = "expert"  # "expert" (built-in domain) or "openai" (`endpoint`)
    endpoint: AgentEndpoint | None = None
    split: str = "train"
    max_tasks: int | None = None  # the first N tasks of the split
    careless: float = 0.3  # expert only: share of tasks on which it writes before the user confirms
    repeats: int = 1  # passes over the tasks (the expert's with their own seeds)
    seed: int = 0
    keep_all: bool = False  # also keep reward-0 conversations (never failed ones)
    max_turns: int = 30
    concurrency: int = 8


def check_request(request: SynthRequest) -> None:
    """A request that cannot run stops here, naming what to change."""
    if request.agent not in ("expert", "openai"):
        raise DomainConfigError(f"agent: expected 'expert' or 'openai', got {request.agent!r}")
    if request.agent == "expert" and (request.env.domain != "builtin" or request.env.domains):
        raise DomainConfigError("the expert agent exists only for the built-in domain; use an OpenAI-compatible "
                                "agent (--agent openai) for τ2 and MCP")
    if request.user.kind == "scripted" and (request.env.domain != "builtin" or request.env.domains):
        raise DomainConfigError("the scripted user exists only for the built-in domain: give an LLM user "
                                "(user.kind=openai, or --user openai --user-model M --user-base-url URL)")
    if request.agent == "openai" and request.endpoint is None:
        raise DomainConfigError("the openai agent needs an endpoint (--agent-model and --agent-base-url)")
    for name in ("repeats", "max_turns", "concurrency"):
        if getattr(request, name) < 1:
            raise DomainConfigError(f"{name} must be >= 1, got {getattr(request, name)}")


async def _openai_run(request: SynthRequest, env: Environment, tasks) -> list[dict[str, Any]]:
    # The user simulator's HTTP client belongs to this event loop: made, used and closed in it.
    user = make_user(request.user, request.env)
    try:
        return await openai_records(env, tasks, user, request.endpoint, repeats=request.repeats,
                                    max_turns=request.max_turns, concurrency=request.concurrency)
    finally:
        await user.aclose()


def generate(request: SynthRequest, env: Environment) -> list[dict[str, Any]]:
    """Every conversation of the request, kept or not."""
    tasks = env.tasks(request.split)[: request.max_tasks]
    if not tasks:
        raise DomainConfigError(f"split {request.split!r} of {env.name} has no tasks")
    if request.agent == "expert":
        return [record for r in range(request.repeats)
                for record in expert_records(env, tasks, careless=request.careless, seed=request.seed + r)]
    return asyncio.run(_openai_run(request, env, tasks))


def write_jsonl(path: str, records: list[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    os.replace(tmp, path)


def synthesize(request: SynthRequest) -> dict[str, Any]:
    """Generate, filter and write the data; returns the summary (counts, the first failure)."""
    check_request(request)
    env = make_environment(request.env)
    try:
        records = generate(request, env)
    finally:
        close = getattr(env, "close", None)  # MCP: shared servers
        if close is not None:
            close()
    failed = [r for r in records if r.get("failed")]
    kept = [r for r in records if not r.get("failed") and (request.keep_all or r["reward"] == 1.0)]
    write_jsonl(request.out, kept)
    unconfirmed = sum(1 for r in kept if r.get(WRITES_CONFIRMED) and not all(r[WRITES_CONFIRMED]))
    return {"generated": len(records), "failed": len(failed), "kept": len(kept),
            "kept_with_unconfirmed_write": unconfirmed, "first_failure": failed[0]["failed"] if failed else None,
            "out": os.path.abspath(request.out)}
