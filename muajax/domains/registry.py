"""The one factory of domains: a run's `env` and `user` config sections → a `Domain`.

The sections are read by attribute (`muajax.config.schema.EnvConfig`, `UserConfig`), so
this layer needs nothing above it. τ2, BFCL and MCP are imported only when asked for:
each pulls a heavy stack (litellm, BFCL's checker, an MCP client) that a run on another
domain should not pay for, and BFCL is an optional install.
"""
from __future__ import annotations

from muajax.domains.base import Domain, Environment, UserSimulator
from muajax.domains.latency import reply_delay

TAU2_DOMAINS = ("retail", "airline", "telecom")
# τ1-bench's tasks on τ2's environment of the same domain (muajax.domains.tau1; env.tau1_dir)
TAU1_DOMAINS = {"tau1-retail": "retail", "tau1-airline": "airline"}


class DomainConfigError(ValueError):
    """The env and user sections do not make a domain; the message names the key."""


def tau2_domains(env_cfg) -> tuple[str, ...]:
    """The τ2 domains a config names (several with `env.domains`), else ()."""
    if env_cfg.domains:
        return tuple(env_cfg.domains)
    if env_cfg.domain in TAU1_DOMAINS:
        return (TAU1_DOMAINS[env_cfg.domain],)
    return (env_cfg.domain,) if env_cfg.domain in TAU2_DOMAINS else ()


def make_environment(env_cfg) -> Environment:
    domain = env_cfg.domain
    if env_cfg.domains or domain in TAU2_DOMAINS:
        from muajax.domains.combined import CombinedEnvironment
        from muajax.domains.tau2.environment import Tau2Environment

        tools = env_cfg.tau2_tools
        if env_cfg.domains:  # trained together: one task list, each task with its domain's policy
            return CombinedEnvironment([Tau2Environment(d, tools=tools) for d in env_cfg.domains])
        return Tau2Environment(domain, tools=tools)
    if domain in TAU1_DOMAINS:
        from muajax.domains.tau1.environment import Tau1Environment
        from muajax.domains.tau1.tasks import Tau1CheckoutError

        try:
            return Tau1Environment(TAU1_DOMAINS[domain], env_cfg.tau1_dir, tools=env_cfg.tau2_tools)
        except Tau1CheckoutError as exc:  # the message names env.tau1_dir
            raise DomainConfigError(str(exc)) from None
    if domain == "builtin":
        from muajax.domains.builtin import BuiltinEnvironment

        e = env_cfg
        return BuiltinEnvironment(seed=e.builtin_seed, terse_tools=e.builtin_terse_tools, n_users=e.builtin_users,
                                  n_test_users=e.builtin_test_users, n_train_tasks=e.builtin_train_tasks,
                                  n_test_tasks=e.builtin_test_tasks, kind_weights=e.builtin_kind_weights,
                                  n_validation_tasks=e.builtin_validation_tasks)
    if domain == "bfcl":
        from muajax.domains.bfcl.environment import BfclEnvironment  # raises with the install line when missing

        return BfclEnvironment(env_cfg.bfcl_category)
    if domain == "acebench":
        from muajax.domains.acebench.environment import AceBenchEnvironment

        return AceBenchEnvironment(env_cfg.acebench_dir, env_cfg.acebench_language)
    if domain == "mcp":
        from muajax.domains.mcp.environment import environment_from_config

        return environment_from_config(env_cfg.mcp)
    raise DomainConfigError(f"env.domain: unknown domain {domain!r}")


def process_count() -> int:
    """The run's processes (hosts) once `jax.distributed` is up, else 1; never starts a backend."""
    import jax

    return jax.process_count() if jax.distributed.is_initialized() else 1


def make_user(user_cfg, env_cfg) -> UserSimulator:
    if env_cfg.domain == "bfcl":
        # BFCL's user turns are the benchmark's data, never a model
        if user_cfg.kind != "scripted":
            raise DomainConfigError(f"user.kind: env.domain=bfcl plays BFCL's scripted user turns; "
                                    f"user.kind={user_cfg.kind!r} does not apply (use user.kind=scripted)")
        from muajax.domains.bfcl.user import BfclUser

        return BfclUser(reply_delay(user_cfg))
    if user_cfg.kind == "scripted":
        if env_cfg.domain != "builtin" or env_cfg.domains:
            raise DomainConfigError(f"user.kind: 'scripted' exists only for env.domain=builtin; use "
                                    f"user.kind=openai for {tau2_domains(env_cfg) or env_cfg.domain!r}")
        from muajax.domains.builtin.user import ScriptedUser

        return ScriptedUser(delay=reply_delay(user_cfg))
    from muajax.domains.openai_user import MissingApiKeyError, OpenAIUserSimulator

    share = process_count()
    kwargs = dict(model=user_cfg.model, api_key_env=user_cfg.api_key_env, timeout_s=user_cfg.timeout_s,
                  max_retries=user_cfg.max_retries, max_concurrency=user_cfg.max_concurrency,
                  temperature=user_cfg.temperature, turn_timeout_s=user_cfg.turn_timeout_s,
                  # the config's rate limits are the whole run's: each process paces its share
                  requests_per_minute=user_cfg.requests_per_minute and user_cfg.requests_per_minute / share,
                  tokens_per_minute=user_cfg.tokens_per_minute and user_cfg.tokens_per_minute / share)
    if user_cfg.base_url:
        kwargs["base_url"] = user_cfg.base_url
    names = tau2_domains(env_cfg)
    if names:
        from muajax.domains.tau2.environment import tau2_user_guidelines

        # retail and airline share τ2's guidelines; telecom's add the user's own tools
        kwargs["guidelines"] = tau2_user_guidelines(names[0])
    simulator: type[OpenAIUserSimulator] = OpenAIUserSimulator
    if env_cfg.domain == "acebench":  # ACEBench's user prompt per item; its multi-step items have no user
        from muajax.domains.acebench.user import AceBenchUserSimulator

        simulator = AceBenchUserSimulator
    try:
        return simulator(**kwargs)
    except MissingApiKeyError as exc:  # the run stops before it writes anything, naming the key
        raise DomainConfigError(f"user.api_key_env: {exc}") from None


def make_domain(env_cfg, user_cfg) -> Domain:
    env = make_environment(env_cfg)
    return Domain(env, make_user(user_cfg, env_cfg))
