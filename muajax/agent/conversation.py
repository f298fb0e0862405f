"""One rollout's host-side state machine: the tokens it was fed, what the agent sampled,
and where each message went, recorded as a `Trajectory`.

Decisions worth knowing:
- A turn cut at `max_new_tokens_per_turn` (finish "length") is parsed and routed like any
  other: its text is what the agent said (a cut tool call parses as malformed). The host
  then closes the turn with `<|im_end|>` (mask 0: never sampled), so the next turn sees
  the chat format it was trained on.
- `max_turns` counts user replies and tool observations (as MUA-RL does). The episode ends
  right after the max_turns-th one, which is recorded in `messages` but not appended to
  the tokens (no generation would read it).
- A session whose tool list changes mid-episode (`EnvSession.tools_revision`, BFCL's
  miss_func) gets the new list rendered into its system prompt before the next turn:
  the tokens after the system prompt stay as they were, and `reprompted` tells the
  driver to prefill the whole conversation again instead of appending.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from muajax.agent import trajectory as tr
from muajax.agent.calls import END, TOOL, UNKNOWN_TOOL, USER, Route, route_assistant, safe_text, tool_schemas
from muajax.agent.rollout_config import RolloutConfig
from muajax.agent.chat import after_assistant_ids, generation_prompt_ids, im_end_id, tool_response_ids, user_turn_ids
from muajax.agent.trajectory import Trajectory
from muajax.domains.base import (OUT_OF_SCOPE, STOP, TRANSFER, EnvSession, Observation, Task, UserSession, UserTurn,
                                 find_end_token)
from muajax.domains.general_tools import TRANSFER_TOOL

log = logging.getLogger(__name__)

END_TOKEN_TERMINATION = {STOP: tr.USER_STOP, TRANSFER: tr.USER_TRANSFER, OUT_OF_SCOPE: tr.USER_OUT_OF_SCOPE}


class Conversation:
    """One rollout's host-side state machine. It never touches the engine or awaits: the
    driver feeds it generations and observations and appends the ids it returns. Its
    state is the `Trajectory` it fills in (`record`)."""

    def __init__(self, tokenizer, options: RolloutConfig, task: Task, *, group_id: int, rollout_index: int,
                 seed: int, session: EnvSession, user_session: UserSession | None, system_ids: Sequence[int],
                 schemas: Mapping[str, dict[str, Any]], max_context: int,
                 system_for: Callable[[list[dict[str, Any]]], list[int]] | None = None):
        """`system_for(tools)` renders a new system prompt when the session's tools change."""
        self.tok, self.opts, self.task, self.seed = tokenizer, options, task, seed
        self.session, self.user_session, self.schemas = session, user_session, schemas
        self.max_context = max_context
        self.im_end = im_end_id(tokenizer)
        self.system_for = system_for
        self.system_len = len(system_ids)
        self.tools_revision = getattr(session, "tools_revision", 0)
        self.reprompted = False  # the system prompt changed: the engine must prefill it all again
        first = safe_text(task.first_user_message)
        prompt = list(system_ids) + user_turn_ids(tokenizer, first) + generation_prompt_ids(tokenizer)
        self.record = Trajectory(task_id=task.task_id, group_id=group_id, rollout_index=rollout_index, seed=seed,
                                 tokens=prompt, loss_mask=[0] * len(prompt), logprobs=[0.0] * len(prompt),
                                 prompt_len=len(prompt), messages=[{"role": "user", "content": first}],
                                 termination="", domain=task.domain)
        self.pending: Route | None = None
        self.close_turn = False  # the last turn lacks a sampled <|im_end|>: the host writes one
        self.slot: int | None = None
        self.started = time.perf_counter()
        if len(prompt) >= max_context:
            self._end(tr.CONTEXT)

    @property
    def done(self) -> bool:
        return bool(self.record.termination)

    def _end(self, termination: str, error: str | None = None) -> None:
        self.record.termination, self.pending = termination, None
        self.record.error = error if error is not None else self.record.error
        self.record.wall_s = time.perf_counter() - self.started

    def budget(self) -> int:
        """New tokens the next generation may sample."""
        return max(1, min(self.opts.max_new_tokens_per_turn, self.max_context - len(self.record.tokens)))

    def _extend(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None) -> None:
        r = self.record
        r.tokens.extend(ids)
        r.loss_mask.extend([mask] * len(ids))
        r.logprobs.extend([0.0] * len(ids) if logprobs is None else (float(x) for x in logprobs))

    def on_generation(self, tokens: Sequence[int], logprobs: Sequence[float], finish_reason: str) -> Route:
        r = self.record
        if self.done or self.pending is not None:
            raise RuntimeError(f"conversation {r.task_id}/{r.rollout_index} got a generation it did not ask for")
        tokens = [int(t) for t in tokens]
        start = len(r.tokens)
        self._extend(tokens, 1, logprobs)
        r.sampled_spans.append((start, len(r.tokens)))
        r.assistant_turns += 1
        self.close_turn = not tokens or tokens[-1] != self.im_end
        text = safe_text(self.tok.decode(tokens if self.close_turn else tokens[:-1], skip_special_tokens=False))
        r.assistant_texts.append(text)
        if finish_reason == "length":
            if len(r.tokens) >= self.max_context:
                finish_reason = "context"  # cut by our max_context, not by the turn budget
            else:
                r.truncated_turns += 1
        route = route_assistant(text, finish_reason, self.schemas, end_on_malformed_call=self.opts.end_on_malformed_call,
                                id_prefix=f"call_{r.assistant_turns}", execute_all_calls=self.opts.execute_all_calls)
        r.messages.append(route.message)
        r.malformed_calls += route.malformed_count
        if route.kind == END:
            self._end(route.termination)
            return route
        for call in route.calls:
            r.tool_calls[call.name if call.name in self.schemas else UNKNOWN_TOOL] += 1
        self.pending = route
        return route

    def on_tool_result(self, observation: Observation) -> list[int] | None:
        """`on_tool_results` of one observation."""
        return self.on_tool_results([observation])

    def on_tool_results(self, observations: Sequence[Observation]) -> list[int] | None:
        """The observations of the pending message's calls, in order (fewer when one ended
        the episode); the next turn's ids to append, or None when the episode is over."""
        route = self._expect(TOOL)
        if not observations or len(observations) > max(1, len(route.calls)):
            raise RuntimeError(f"conversation {self.task.task_id}/{self.record.rollout_index}: "
                               f"{len(observations)} observations for {len(route.calls)} calls")
        contents = []
        for i, observation in enumerate(observations):
            if observation.setup_error:  # the environment was never there: nothing to learn from
                return self._end(tr.SETUP_ERROR, safe_text(observation.content))
            content = safe_text(observation.content)
            message: dict[str, Any] = {"role": "tool", "content": content}
            if i < len(route.calls):
                message.update(tool_call_id=route.call_ids[i], name=route.calls[i].name)
            self.record.messages.append(message)
            self.record.turns += 1
            contents.append(content)
            if observation.done:
                called = route.calls[i].name if i < len(route.calls) else None
                return self._end(tr.TRANSFER if called == TRANSFER_TOOL else tr.ENV_DONE)
        return self._next(tool_response_ids(self.tok, contents))

    def on_user_turn(self, turn: UserTurn, latency_s: float) -> list[int] | None:
        self._expect(USER)
        self.record.user_latency_s.append(float(latency_s))
        if turn.failed:
            return self._end(tr.USER_ERROR, turn.error or "the user simulator failed")
        text = safe_text(turn.text)
        self.record.messages.append({"role": "user", "content": text})
        self.record.turns += 1
        end = turn.end or find_end_token(text)
        if end is not None:
            return self._end(END_TOKEN_TERMINATION.get(end, tr.USER_STOP))
        return self._next(user_turn_ids(self.tok, text))

    def _expect(self, kind: str) -> Route:
        if self.pending is None or self.pending.kind != kind:
            raise RuntimeError(f"conversation {self.task.task_id}/{self.record.rollout_index} is not waiting for "
                               f"a {kind}")
        return self.pending

    def _next(self, turn_ids: list[int]) -> list[int] | None:
        if self.record.turns >= self.opts.max_turns:
            return self._end(tr.MAX_TURNS)
        ids = ([self.im_end] if self.close_turn else []) + after_assistant_ids(self.tok) + turn_ids
        ids += generation_prompt_ids(self.tok)
        revision = getattr(self.session, "tools_revision", 0)
        system = self._new_system() if revision != self.tools_revision else None
        grown = 0 if system is None else len(system) - self.system_len
        if len(self.record.tokens) + grown + len(ids) >= self.max_context:  # not even one token could be sampled
            return self._end(tr.CONTEXT)
        self._extend(ids, 0)
        if system is not None:
            self._replace_system(system)
            self.tools_revision = revision
        self.pending = None
        return ids

    def _new_system(self) -> list[int]:
        if self.system_for is None:
            raise RuntimeError(f"the tools of {self.task.task_id} changed mid-episode, but this conversation "
                               "has no system_for to render them")
        return list(self.system_for(self.session.tools()))

    def _replace_system(self, system: list[int]) -> None:
        """The same conversation behind a new system prompt (see the module docstring)."""
        r, old = self.record, self.system_len
        shift = len(system) - old
        r.tokens = system + r.tokens[old:]
        r.loss_mask = [0] * len(system) + r.loss_mask[old:]
        r.logprobs = [0.0] * len(system) + r.logprobs[old:]
        r.prompt_len += shift
        r.sampled_spans = [(start + shift, end + shift) for start, end in r.sampled_spans]
        self.system_len = len(system)
        self.schemas = tool_schemas(self.session)
        self.reprompted = True

    def trajectory(self) -> Trajectory:
        """Evaluate (off the driver: it may be slow) and return the record. Evaluation errors
        give reward 0 and `details["evaluate_error"]`."""
        r = self.record
        try:
            evaluation = self.session.evaluate(r.messages, communicate_info=self.opts.communicate_info)
            r.reward, r.partial = float(evaluation.reward), float(evaluation.partial)
            r.details = dict(evaluation.details)
            if self.opts.zero_unfinished and not r.finished:
                # τ2's rule; the domain's own verdict stays in the details
                r.details.update(unfinished=r.termination, reward_if_finished=r.reward)
                r.reward = 0.0
        except Exception as e:
            log.exception("evaluating %s/%d failed", r.task_id, r.rollout_index)
            r.details = {"evaluate_error": f"{type(e).__name__}: {e}"}
        finally:
            close_quietly(self.session)
        return r


def close_quietly(session: EnvSession | None) -> None:
    try:
        if session is not None:
            session.close()
    except Exception:
        log.exception("closing an environment session failed")
