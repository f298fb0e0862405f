"""The simulated-user interface.

A `UserSimulator` starts one `UserSession` per rollout. The session sees only the agent's
plain-text messages (never tool calls or results: MUA-RL's role-flipped history) and
answers asynchronously so that the rollout loop can keep decoding other conversations.
"""
from __future__ import annotations

import abc
import dataclasses

from muajax.envs.base import EnvSession, Task

STOP = "###STOP###"
TRANSFER = "###TRANSFER###"
OUT_OF_SCOPE = "###OUT-OF-SCOPE###"
END_TOKENS = (STOP, TRANSFER, OUT_OF_SCOPE)


@dataclasses.dataclass(frozen=True)
class UserTurn:
    """One user reply. `end` is the end token found in `text` (or None); `failed` marks a
    reply that could not be obtained (endpoint errors after all retries)."""

    text: str
    end: str | None = None
    latency_s: float = 0.0
    failed: bool = False
    error: str | None = None


def find_end_token(text: str) -> str | None:
    for token in END_TOKENS:
        if token in text:
            return token
    return None


class UserSession(abc.ABC):
    @abc.abstractmethod
    async def reply(self, agent_message: str) -> UserTurn:
        """The user's answer to the agent's latest plain-text message."""


class UserSimulator(abc.ABC):
    @abc.abstractmethod
    def start(self, task: Task, env: EnvSession | None = None) -> UserSession:
        """A new user for one rollout. `env` lets dual-control users call their own tools."""

    async def aclose(self) -> None:  # noqa: B027
        """Release connections."""
