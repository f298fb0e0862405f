"""A simulated user's reply delay, for offline runs that should wait on their users as a
run against an LLM user does (GPT-4o answers in 1-3 s), without a remote endpoint.

`ReplyDelay(mean_s, jitter, distribution, seed)` describes the delay before each reply:

- `mean_s`: its mean in seconds (0: no delay, the reply is computed at once);
- `jitter`: its standard deviation as a share of the mean (0: always `mean_s`);
- `distribution`: "uniform" (spread evenly over mean_s x (1 +- sqrt(3) x jitter), so jitter
  is at most 1/sqrt(3), about 0.577: no delay below 0) or "lognormal" (right-skewed as an
  endpoint's latency is, its mean and standard deviation exactly mean_s and jitter x mean_s;
  any jitter);
- `seed`: the delays repeat for the same seed. Each user session draws from its own stream,
  keyed by the seed, the task's id and how many sessions of that task the simulator has
  started before it (`stream(task_id, k)`), so a session's delays do not depend on the
  order in which concurrent conversations happen to ask.

A session waits its delay with `asyncio.sleep` (`answer_after`): the event loop runs the
other conversations, the engine and the update meanwhile; the reply's `UserTurn.latency_s`
is the whole wait, delay included.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Callable

from muajax.domains.base import UserTurn

DISTRIBUTIONS = ("uniform", "lognormal")
UNIFORM_MAX_JITTER = 1.0 / math.sqrt(3.0)  # a uniform delay's standard deviation reaches its mean here


@dataclasses.dataclass(frozen=True)
class ReplyDelay:
    mean_s: float = 0.0
    jitter: float = 0.0
    distribution: str = "uniform"
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.mean_s) and self.mean_s >= 0):
            raise ValueError(f"a reply delay's mean must be >= 0 seconds, got {self.mean_s!r}")
        if not (math.isfinite(self.jitter) and self.jitter >= 0):
            raise ValueError(f"a reply delay's jitter must be >= 0, got {self.jitter!r}")
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"a reply delay's distribution is one of {DISTRIBUTIONS}, got {self.distribution!r}")
        if self.distribution == "uniform" and self.jitter > UNIFORM_MAX_JITTER + 1e-12:
            raise ValueError(f"a uniform delay's jitter is at most 1/sqrt(3) = {UNIFORM_MAX_JITTER:.3f} (its lowest "
                             f"draw would be below 0), got {self.jitter!r}; use the lognormal distribution")

    @property
    def enabled(self) -> bool:
        return self.mean_s > 0

    def draw(self, rng: random.Random) -> float:
        """One delay in seconds."""
        if not self.enabled:
            return 0.0
        if self.jitter == 0:
            return self.mean_s
        if self.distribution == "uniform":
            half = math.sqrt(3.0) * self.jitter * self.mean_s
            return max(0.0, rng.uniform(self.mean_s - half, self.mean_s + half))
        sigma2 = math.log1p(self.jitter ** 2)  # a lognormal of this mean and coefficient of variation
        return rng.lognormvariate(math.log(self.mean_s) - sigma2 / 2, math.sqrt(sigma2))

    def stream(self, task_id: str, k: int = 0) -> DelayStream:
        """The delays of the `k`-th session of task `task_id` (a str seed: the same in every
        process, unlike `hash`)."""
        return DelayStream(self, random.Random(f"muajax-user-delay/{self.seed}/{task_id}/{k}"))


class DelayStream:
    """One session's delays, drawn in turn order."""

    def __init__(self, delay: ReplyDelay, rng: random.Random):
        self.delay, self.rng = delay, rng

    def next(self) -> float:
        return self.delay.draw(self.rng)


class SessionDelays:
    """A simulator's delay streams: one per started session, numbered per task."""

    def __init__(self, delay: ReplyDelay | None):
        self.delay = delay if delay is not None and delay.enabled else None
        self.started: dict[str, int] = {}

    def start(self, task_id: str) -> DelayStream | None:
        if self.delay is None:
            return None
        k = self.started.get(task_id, 0)
        self.started[task_id] = k + 1
        return self.delay.stream(task_id, k)


async def answer_after(stream: DelayStream | None, respond: Callable[[], UserTurn]) -> UserTurn:
    """`respond()`'s turn after the stream's next delay, waited without blocking the event
    loop; its latency_s is the whole wait. Without a stream, the turn at once, as it is."""
    if stream is None:
        return respond()
    t0 = time.perf_counter()
    await asyncio.sleep(stream.next())
    turn = respond()
    return dataclasses.replace(turn, latency_s=time.perf_counter() - t0)


def reply_delay(user_cfg) -> ReplyDelay | None:
    """The delay a `user` config section asks for (read by attribute: `UserConfig`), or None."""
    mean = float(getattr(user_cfg, "latency_s", 0.0) or 0.0)
    if mean <= 0:
        return None
    return ReplyDelay(mean, float(user_cfg.latency_jitter), user_cfg.latency_distribution, int(user_cfg.latency_seed))
