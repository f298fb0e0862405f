"""The `user` section of a run config (also `eval.user`): which simulated user, and for an
LLM endpoint how it is reached and paced. `muajax.domains.registry.make_user` builds it."""
from __future__ import annotations

import dataclasses
import re
from typing import Literal

from muajax.settings.fields import bounded, check
from muajax.domains.latency import reply_delay

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# The keys that pace an endpoint; they apply to user.kind 'openai' only.
PACING_KEYS = ("requests_per_minute", "tokens_per_minute", "turn_timeout_s")


@dataclasses.dataclass(frozen=True)
class UserConfig:
    """The simulated user. For `openai` the key is read from the env var `api_key_env`."""

    kind: Literal["scripted", "openai"] = "scripted"  # "scripted" (built-in domain only) or "openai" (an LLM endpoint)
    base_url: str | None = None  # the OpenAI-compatible endpoint; None: https://api.openai.com/v1
    model: str | None = None  # the endpoint's model name (required for "openai")
    api_key_env: str | None = "OPENAI_API_KEY"  # the NAME of the variable holding the key (local hosts need none)
    timeout_s: float = bounded(60.0, gt=0)  # seconds per request to the endpoint
    max_retries: int = bounded(3, ge=0)  # retries of a failed request (with backoff) before the reply fails
    max_concurrency: int = bounded(16, ge=1)  # requests in flight at once, over all sessions (per process)
    # Requests a minute to the endpoint, over the whole run: each of the run's processes
    # (hosts) starts at most requests_per_minute / process_count a minute, evenly spaced (a
    # limiter shared by all its conversations). None: no limit.
    requests_per_minute: float | None = bounded(None, gt=0)
    # Tokens a minute to the endpoint, over the whole run (each process: its share, as
    # above): a request counts its messages and tools at 4 characters a token plus its
    # max_tokens, and the reply's reported usage where that is more. None: no limit.
    tokens_per_minute: float | None = bounded(None, gt=0)
    # Seconds for one whole user turn: the waits for a request slot and for the rate limits,
    # every attempt, its retries (a Retry-After that would pass the deadline is not waited
    # out) and the user's own tool rounds. Past it the turn fails: the rollout is a user
    # failure (user_error, out of the update, counted in failed_rollouts). None: no bound.
    turn_timeout_s: float | None = bounded(None, gt=0)
    temperature: float = bounded(0.0, ge=0)  # its sampling temperature (the paper's ran greedy in training)
    # The scripted users' (built-in, BFCL) reply delay, so an offline run waits on its users as
    # one against an LLM user does (GPT-4o: 1-3 s a reply): its mean in seconds, waited with
    # asyncio.sleep (the other conversations, the engine and the update go on) and counted in
    # the reply's latency (evaluations too, unless eval.user is set). 0: answer at once. An
    # openai endpoint's latency is its own.
    latency_s: float = bounded(0.0, ge=0)
    # The delay's standard deviation as a share of its mean (0: always latency_s); uniform: at
    # most 0.577 (mean x (1 +- sqrt(3) x jitter)), lognormal: any.
    latency_jitter: float = bounded(0.0, ge=0)
    # The delay's shape: uniform, or lognormal (right-skewed, as an endpoint's latency is).
    latency_distribution: Literal["uniform", "lognormal"] = "uniform"
    # Seeds the delays: each session draws its own stream (by task id and how many sessions of
    # that task came before), so a run repeats them whatever order its conversations ask in.
    latency_seed: int = 0

    def validate(self) -> None:
        check(self.kind != "openai" or bool(self.model), "model", "is required when user.kind is 'openai'")
        check(self.kind != "openai" or self.latency_s == 0, "latency_s",
              "delays the scripted users only; user.kind 'openai' waits on its endpoint (set it to 0)")
        for key in PACING_KEYS:
            check(self.kind == "openai" or getattr(self, key) is None, key,
                  "paces an LLM endpoint: it applies to user.kind 'openai' only (set it to null)")
        try:
            reply_delay(self)
        except ValueError as exc:
            check(False, "latency_jitter", str(exc))
        # A pasted key (e.g. 'sk-...') fails this pattern; the value is not echoed.
        check(self.api_key_env is None or bool(_ENV_NAME.match(self.api_key_env)), "api_key_env",
              "must be the NAME of an environment variable (letters, digits, '_'), not the key itself")
