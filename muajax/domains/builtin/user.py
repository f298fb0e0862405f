"""A deterministic, offline user for the built-in domain.

It reads only the agent's plain text (keyword/regex rules) and answers from the task's
scenario in short, fixed templates, so a tiny model sees a small vocabulary. Rules, in
priority order: give name and zip when asked; give the order id when asked; the
kind-specific move (pick or switch variant, answer a confirmation request, accept an
answer); decline "anything else" once the goal is settled; otherwise restate the
request, and give up with ###STOP### after a few stalls or too many turns.
A change-of-mind user switches variant (or withdraws a cancellation) the first time the
agent lists options or asks for confirmation, so an agent that writes before asking
writes the wrong thing.
With a `ReplyDelay` (`user.latency_s`, muajax.domains.latency) each reply comes after a
seeded delay, waited with asyncio.sleep; `respond` (the scripted expert's) never waits.
"""
from __future__ import annotations

import re
from typing import Any

from muajax.domains.base import EnvSession, Task
from muajax.domains.builtin.tasks import DOMAIN, KINDS
from muajax.domains.base import STOP, UserSession, UserSimulator, UserTurn
from muajax.domains.latency import DelayStream, ReplyDelay, SessionDelays, answer_after

MAX_AGENT_CHARS = 8000  # an assistant turn is at most ~1024 tokens; more is noise, not content

_ID = re.compile(r"\b(name|zip|zipcode|postcode|postal|verify|authenticat\w*|identif\w*|identity)\b")
_ORDER_Q = re.compile(r"\b(which|what) order\b|\border (id|number)\b")
_CONFIRM = re.compile(r"\bconfirm\w*|\b(reply|say|answer|type|respond with)\W{0,2}yes\b|\byes\s*/\s*no\b"
                      r"|\byes or no\b|\bshall i\b|\bshould i\b|\bdo you want me to\b|\bproceed\b|\bgo ahead\b")
_DONE = re.compile(r"\b(done|updated|modified|changed|cancell?ed|successfully|has been|is now|now has)\b")
_ELSE = re.compile(r"\banything else\b|\bsomething else\b|\banything more\b")
_CHOICES = re.compile(r"\b(option|options|variant|variants|available)\b")

_REQUIRED = {
    "modify": ("name", "zip", "order_id", "product", "want"),
    "modify_mind": ("name", "zip", "order_id", "product", "want", "switch_to"),
    "cancel": ("name", "zip", "order_id"),
    "cancel_mind": ("name", "zip", "order_id"),
    "address": ("name", "zip", "address"),
    "info": ("name", "zip", "order_id", "outputs"),
}


def _says(text: str, phrase: str) -> bool:
    """`phrase` appears as whole words ("red" is not found in "ordered", "25" not in "#o250")."""
    return re.search(rf"(?<![\w#]){re.escape(phrase.lower())}(?!\w)", text) is not None


class ScriptedUserSession(UserSession):
    def __init__(self, task: Task, max_turns: int, max_stalls: int, delays: DelayStream | None = None):
        self.task = task
        self.delays = delays
        self.meta: dict[str, Any] = task.metadata
        self.kind: str = self.meta["kind"]
        self.max_turns = max_turns
        self.max_stalls = max_stalls
        self.turns = 0
        self.stalls = 0
        self.id_given = 0
        self.switched = False
        self.confirmed = False
        self.settled = False
        self.finished = False

    async def reply(self, agent_message: str) -> UserTurn:
        return await answer_after(self.delays, lambda: self.respond(agent_message))

    def respond(self, agent_message: Any) -> UserTurn:
        """The synchronous core of `reply`: any input gives a UserTurn, never an exception."""
        text = agent_message if isinstance(agent_message, str) else ""
        low = " ".join(text[:MAX_AGENT_CHARS].lower().split())
        self.turns += 1
        if self.finished or self.turns > self.max_turns:
            return self._end("Bye.")
        if _ID.search(low) and not self.id_given:
            return self._identity()
        if _ORDER_Q.search(low) and "order_id" in self.meta and not _CONFIRM.search(low):
            return self._say(f"It is order {self.meta['order_id']}.")
        move = getattr(self, "_" + self.kind.split("_")[0])(low)
        if move is not None:
            return move
        if _ID.search(low) and self.id_given < 3:
            return self._identity()
        if _ELSE.search(low) and self.settled:
            return self._end("No, thanks.")
        self.stalls += 1
        if self.stalls >= self.max_stalls:
            return self._end("Bye.")
        return UserTurn(self._request())

    # -- replies ---------------------------------------------------------------------------
    def _say(self, text: str) -> UserTurn:
        self.stalls = 0
        return UserTurn(text)

    def _end(self, text: str) -> UserTurn:
        self.finished = True
        return UserTurn(f"{text} {STOP}", end=STOP)

    def _identity(self) -> UserTurn:
        self.id_given += 1
        return self._say(f"I am {self.meta['name']}, zip {self.meta['zip']}.")

    def _request(self) -> str:
        if self.kind.startswith("modify"):
            want = self._wanted()["options"]
            return f"I want to change the {self.meta['product']} in order {self.meta['order_id']} to {want}."
        return self.task.first_user_message.removeprefix("Hi. ")

    def _wanted(self) -> dict[str, Any]:
        return self.meta["switch_to"] if self.switched else self.meta["want"]

    # -- kind-specific moves: a UserTurn, or None when the message is not about the goal ----
    def _modify(self, low: str) -> UserTurn | None:
        asks = _CONFIRM.search(low) is not None
        if _DONE.search(low) and not asks:
            self.settled = True
            return self._end("Thanks, bye.")
        want = self._wanted()
        other = self.meta.get("switch_to")
        offers = _CHOICES.search(low) is not None or (other is not None and self._names(low, other))
        if self.kind == "modify_mind" and not self.switched and (asks or offers):
            self.switched = True
            return self._say(f"Hmm, I prefer {other['options']} instead.")
        if asks:
            if self._names(low, want):
                self.confirmed = True
                return self._say("Yes.")
            return self._say(f"No, I want {want['options']}.")
        if offers or self._names(low, want):
            return self._say(f"I want {want['options']}.")
        return None

    def _cancel(self, low: str) -> UserTurn | None:
        asks = _CONFIRM.search(low) is not None
        if asks:
            if self.kind == "cancel_mind":
                self.settled = True
                return self._end("No, I will keep the order. Bye.")
            if "cancel" in low or _says(low, self.meta["order_id"].lstrip("#")):
                self.confirmed = True
                return self._say("Yes.")
            return self._say(f"I mean: cancel order {self.meta['order_id']}.")
        if _DONE.search(low):
            self.settled = True
            return self._end("Thanks, bye.")
        return None

    def _address(self, low: str) -> UserTurn | None:
        asks = _CONFIRM.search(low) is not None
        if asks:
            if _says(low, self.meta["address"]):
                self.confirmed = True
                return self._say("Yes.")
            return self._say(f"No, my new address is {self.meta['address']}.")
        if _DONE.search(low):
            self.settled = True
            return self._end("Thanks, bye.")
        return None

    def _info(self, low: str) -> UserTurn | None:
        if all(_says(low.replace(",", ""), fact) for fact in self.meta["outputs"]):
            self.settled = True
            return self._end("Thanks, bye.")
        if _CONFIRM.search(low):
            return self._say(f"No change, please. I only want the {self.meta.get('ask', 'answer')}.")
        return None

    @staticmethod
    def _names(low: str, variant: dict[str, Any]) -> bool:
        return _says(low, variant["options"]) or _says(low, variant["item_id"])


class ScriptedUser(UserSimulator):
    """Deterministic user for built-in tasks; `start` rejects tasks it cannot script."""

    def __init__(self, max_turns: int = 10, max_stalls: int = 3, delay: ReplyDelay | None = None):
        if max_turns < 1 or max_stalls < 1:
            raise ValueError(f"max_turns and max_stalls must be >= 1, got {max_turns}, {max_stalls}")
        self.max_turns = max_turns
        self.max_stalls = max_stalls
        self.delays = SessionDelays(delay)

    def start(self, task: Task, env: EnvSession | None = None) -> ScriptedUserSession:
        if not isinstance(task, Task):
            raise TypeError(f"ScriptedUser.start needs a Task, got {type(task).__name__}")
        meta = task.metadata if isinstance(task.metadata, dict) else {}
        kind = meta.get("kind")
        if task.domain != DOMAIN or kind not in KINDS:
            raise ValueError(f"ScriptedUser can only play built-in tasks (domain {DOMAIN!r}, kind in {KINDS}); "
                             f"task {task.task_id!r} has domain {task.domain!r}, kind {kind!r}")
        missing = [k for k in _REQUIRED[kind] if meta.get(k) in (None, "", [])]
        if missing:
            raise ValueError(f"task {task.task_id!r} ({kind}) lacks scenario fields {missing}")
        return ScriptedUserSession(task, self.max_turns, self.max_stalls, self.delays.start(task.task_id))
