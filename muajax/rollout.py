"""The host-side multi-turn rollout loop: tasks × n conversations → `Trajectory`s.

Each conversation gets a fresh environment session (`env.reset(task)`), its own simulated
user and one engine slot (more conversations than slots queue for one). One driver
coroutine owns the engine: it alternates `engine.step()` (one decode chunk over every
generating slot, in a worker thread so the event loop serves HTTP meanwhile) with handling
the user replies and tool results that arrived. Those are asyncio tasks / thread-pool jobs
that only post to an inbox, so while one conversation waits on its user the others decode.

Routing (`route_assistant`, a pure function of the sampled text): a message with a tool
call, or a failed attempt at one, goes to the environment (its first call only); plain
text goes to the simulated user.

Decisions worth knowing:
- A turn cut at `max_new_tokens_per_turn` (finish "length") is parsed and routed like any
  other: its text is what the agent said (a cut tool call parses as malformed). The host
  then closes the turn with `<|im_end|>` (mask 0: never sampled), so the next turn sees
  the chat format it was trained on.
- `max_turns` counts user replies and tool observations (as MUA-RL does). The episode ends
  right after the max_turns-th one, which is recorded in `messages` but not appended to
  the tokens (no generation would read it).
- A malformed call (unparseable, unknown tool, arguments that break the tool's schema) is
  counted; with `end_on_malformed_call` it ends the episode unexecuted, otherwise a parse
  error gets `format_tool_error` as its observation and a schema violation runs through
  the environment, whose own error the agent sees. Calls that never ran are left out of
  the message's `tool_calls`, so evaluators that replay calls replay only what ran.
- Per-rollout seeds derive from (seed, task index, rollout index) and the engine's sampling
  key from (seed, position): samples do not depend on scheduling or batch composition.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from muajax import trajectory as tr
from muajax.chat import (after_assistant_ids, format_tool_error, generation_prompt_ids, im_end_id, parse_assistant,
                         strip_control_tokens, system_prompt_ids, tool_response_ids, user_turn_ids)
from muajax.engine.engine import Engine, SamplingParams
from muajax.envs.base import Environment, EnvSession, Observation, Task, ToolCall
from muajax.envs.general_tools import TRANSFER_TOOL
from muajax.trajectory import RolloutBatch, Trajectory
from muajax.users.base import OUT_OF_SCOPE, STOP, TRANSFER, UserSession, UserSimulator, UserTurn, find_end_token

log = logging.getLogger(__name__)

END_TOKEN_TERMINATION = {STOP: tr.USER_STOP, TRANSFER: tr.USER_TRANSFER, OUT_OF_SCOPE: tr.USER_OUT_OF_SCOPE}
UNKNOWN_TOOL = "<unknown>"  # one counter bucket for invented names, so garbage cannot grow the Counter

TOOL, USER, END = "tool", "user", "end"


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    n: int = 8  # rollouts per task
    max_turns: int = 30  # user replies + tool observations
    max_new_tokens_per_turn: int = 1024
    max_context: int | None = None  # tokens; None = the engine's max_len
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    end_on_malformed_call: bool = False
    communicate_info: bool = False  # passed to evaluate: off in training
    system_text: str | None = None  # None = env.policy()
    user_timeout_s: float | None = None  # a bound on one whole user turn, on top of the simulator's own
    tool_workers: int = 8  # threads for tool calls and evaluation
    # False = the reference mode that waits for every pending user reply / tool result
    # before decoding anything else (the benchmark's baseline; also handy when debugging).
    overlap_io: bool = True

    def __post_init__(self):
        for name in ("n", "max_turns", "max_new_tokens_per_turn", "tool_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RolloutOptions.{name} must be an int >= 1, got {value!r}")
        if self.max_context is not None and (not isinstance(self.max_context, int) or self.max_context < 2):
            raise ValueError(f"RolloutOptions.max_context must be an int >= 2 or None, got {self.max_context!r}")
        if self.user_timeout_s is not None and not self.user_timeout_s > 0:
            raise ValueError(f"RolloutOptions.user_timeout_s must be > 0 or None, got {self.user_timeout_s!r}")
        self.sampling(1)  # validates temperature / top_p / top_k with the engine's own checks

    @classmethod
    def from_config(cls, cfg: Any, **overrides) -> RolloutOptions:
        """From `muajax.config.RolloutConfig` (n_per_task → n); keyword overrides win."""
        values = {"n": cfg.n_per_task, "max_turns": cfg.max_turns,
                  "max_new_tokens_per_turn": cfg.max_new_tokens_per_turn, "max_context": cfg.max_context,
                  "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                  "end_on_malformed_call": cfg.end_on_malformed_call}
        return cls(**{**values, **overrides})

    def sampling(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=max_new_tokens)


def rollout_seed(seed: int, task_index: int, rollout_index: int) -> int:
    """A uint32 sampling seed that depends only on (seed, task index, rollout index)."""
    if min(seed, task_index, rollout_index) < 0:
        raise ValueError(f"seeds and indices must be >= 0, got {seed}, {task_index}, {rollout_index}")
    return int(np.random.SeedSequence([seed, task_index, rollout_index]).generate_state(1, np.uint32)[0])


# ---------------------------------------------------------------------------------------------- routing


def safe_text(text: Any) -> str:
    """Text that is safe to tokenize as a turn: a str, no chat control tokens, valid UTF-8."""
    text = text if isinstance(text, str) else str(text)
    return strip_control_tokens(text.encode("utf-8", "replace").decode("utf-8"))


def tool_schemas(session: EnvSession) -> dict[str, dict[str, Any]]:
    """{name: function schema} of the agent's tools."""
    fns = (schema.get("function", schema) for schema in session.tools() if isinstance(schema, dict))
    return {fn["name"]: fn for fn in fns if isinstance(fn, dict) and isinstance(fn.get("name"), str)}


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


def _is(value: Any, name: str) -> bool:
    # JSON true is not a number, although Python's bool is an int
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    return isinstance(value, _JSON_TYPES[name]) or (name == "integer" and isinstance(value, float)
                                                     and value.is_integer())


def _type_ok(value: Any, spec: Any) -> bool:
    kind = spec.get("type") if isinstance(spec, dict) else None
    names = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
    if not names or any(n not in _JSON_TYPES for n in names):
        return True  # anyOf / $ref / untyped / exotic: not judged here, the environment will
    return any(_is(value, n) for n in names)


def _json_type(value: Any) -> str:
    return next((name for name in _JSON_TYPES if _is(value, name)), type(value).__name__)


def _short(text: str, limit: int = 60) -> str:
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def check_call(call: ToolCall, schemas: Mapping[str, dict[str, Any]]) -> str | None:
    """Why `call` breaks the contract the agent was shown (unknown tool, a missing or
    unexpected argument, a wrong JSON type), or None. Conservative: only plain JSON-schema
    `type`s are checked, anything fancier is left to the environment."""
    fn = schemas.get(call.name)
    if fn is None:
        names = ", ".join(sorted(schemas)[:30])
        return f"unknown tool {_short(call.name)}; the tools are: {names}"
    params = fn.get("parameters")
    if not isinstance(params, dict):
        return None
    props = params.get("properties")
    props = props if isinstance(props, dict) else None
    required = params.get("required") if isinstance(params.get("required"), list) else []
    missing = [r for r in required if isinstance(r, str) and r not in call.arguments]
    if missing:
        return f"{call.name}: missing required argument(s) {', '.join(map(repr, missing))}"
    if props is not None:
        if params.get("additionalProperties", False) is False:
            extra = sorted(k for k in call.arguments if k not in props)
            if extra:
                return f"{call.name}: unexpected argument(s) {', '.join(_short(k, 40) for k in extra[:5])}"
        for key, value in call.arguments.items():
            if key in props and not _type_ok(value, props[key]):
                return (f"{call.name}: argument {key!r} must be {props[key].get('type')}, "
                        f"got {_json_type(value)}")
    return None


@dataclasses.dataclass(frozen=True)
class Route:
    """Where one assistant message goes. kind TOOL: run `call`, or (call None) answer with
    `error_observation`; USER: send `user_text`; END: the episode is over (`termination`)."""

    kind: str
    message: dict[str, Any]  # the assistant message for the transcript
    call: ToolCall | None = None
    call_id: str | None = None
    error_observation: str | None = None
    user_text: str | None = None
    malformed: str | None = None  # why the call was malformed (counted either way)
    termination: str | None = None


def _assistant_message(content: str, calls: Sequence[ToolCall] = (), id_prefix: str = "call") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": f"{id_prefix}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for i, c in enumerate(calls)]
    return message


def route_assistant(text: str, finish_reason: str, schemas: Mapping[str, dict[str, Any]], *,
                    end_on_malformed_call: bool = False, id_prefix: str = "call") -> Route:
    """Route one decoded assistant message (without its `<|im_end|>`). Never raises."""
    parsed = parse_assistant(text)
    content = parsed.content
    if finish_reason == "context":
        return Route(END, _assistant_message(content), termination=tr.CONTEXT)
    if parsed.error is not None:
        if end_on_malformed_call:
            return Route(END, _assistant_message(content), malformed=parsed.error, termination=tr.MALFORMED_CALL)
        return Route(TOOL, _assistant_message(content), error_observation=format_tool_error(parsed.error),
                     malformed=parsed.error)
    if parsed.tool_calls:
        call = parsed.tool_calls[0]
        problem = check_call(call, schemas)
        if problem is not None and end_on_malformed_call:
            return Route(END, _assistant_message(content), malformed=problem, termination=tr.MALFORMED_CALL)
        message = _assistant_message(content, parsed.tool_calls, id_prefix)
        return Route(TOOL, message, call=call, call_id=message["tool_calls"][0]["id"], malformed=problem)
    return Route(USER, _assistant_message(content), user_text=content)


def execute_tool(session: EnvSession, call: ToolCall) -> Observation:
    """`session.step(call)`; an environment that raises (a bug: step must not) gets its error
    turned into an observation, so one broken tool cannot take down a batch."""
    try:
        obs = session.step(call)
        if not isinstance(obs, Observation):
            raise TypeError(f"step returned {type(obs).__name__}, not an Observation")
        return obs
    except Exception as e:
        log.exception("tool %r raised", call.name)
        return Observation(f"Error: tool {call.name} failed: {type(e).__name__}: {e}", error=True)


# ---------------------------------------------------------------------------------------------- one conversation


class Conversation:
    """One rollout's host-side state machine. It never touches the engine or awaits: the
    driver feeds it generations and observations and appends the ids it returns. Its
    state is the `Trajectory` it fills in (`record`)."""

    def __init__(self, tokenizer, options: RolloutOptions, task: Task, *, group_id: int, rollout_index: int,
                 seed: int, session: EnvSession, user_session: UserSession | None, system_ids: Sequence[int],
                 schemas: Mapping[str, dict[str, Any]], max_context: int):
        self.tok, self.opts, self.task, self.seed = tokenizer, options, task, seed
        self.session, self.user_session, self.schemas = session, user_session, schemas
        self.max_context = max_context
        self.im_end = im_end_id(tokenizer)
        first = safe_text(task.first_user_message)
        prompt = list(system_ids) + user_turn_ids(tokenizer, first) + generation_prompt_ids(tokenizer)
        self.record = Trajectory(task_id=task.task_id, group_id=group_id, rollout_index=rollout_index, seed=seed,
                                 tokens=prompt, loss_mask=[0] * len(prompt), logprobs=[0.0] * len(prompt),
                                 prompt_len=len(prompt), messages=[{"role": "user", "content": first}],
                                 termination="")
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
                                id_prefix=f"call_{r.assistant_turns}")
        r.messages.append(route.message)
        r.malformed_calls += route.malformed is not None
        if route.kind == END:
            self._end(route.termination)
            return route
        if route.kind == TOOL and route.call is not None:
            r.tool_calls[route.call.name if route.call.name in self.schemas else UNKNOWN_TOOL] += 1
        self.pending = route
        return route

    def on_tool_result(self, observation: Observation) -> list[int] | None:
        """The next turn's ids to append, or None when the episode is over."""
        route = self._expect(TOOL)
        content = safe_text(observation.content)
        message: dict[str, Any] = {"role": "tool", "content": content}
        if route.call is not None:
            message.update(tool_call_id=route.call_id, name=route.call.name)
        self.record.messages.append(message)
        self.record.turns += 1
        if observation.done:
            called = route.call.name if route.call is not None else None
            return self._end(tr.TRANSFER if called == TRANSFER_TOOL else tr.ENV_DONE)
        return self._next(tool_response_ids(self.tok, [content]))

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
        if len(self.record.tokens) + len(ids) >= self.max_context:  # not even one token could be sampled
            return self._end(tr.CONTEXT)
        self._extend(ids, 0)
        self.pending = None
        return ids

    def trajectory(self) -> Trajectory:
        """Evaluate (off the driver: it may be slow) and return the record. Evaluation errors
        give reward 0 and `details["evaluate_error"]`."""
        r = self.record
        try:
            evaluation = self.session.evaluate(r.messages, communicate_info=self.opts.communicate_info)
            r.reward, r.partial = float(evaluation.reward), float(evaluation.partial)
            r.details = dict(evaluation.details)
        except Exception as e:
            log.exception("evaluating %s/%d failed", r.task_id, r.rollout_index)
            r.details = {"evaluate_error": f"{type(e).__name__}: {e}"}
        finally:
            _close(self.session)
        return r


def _close(session: EnvSession | None) -> None:
    try:
        if session is not None:
            session.close()
    except Exception:
        log.exception("closing an environment session failed")


# ---------------------------------------------------------------------------------------------- the driver


class _Driver:
    def __init__(self, engine: Engine, tokenizer, env: Environment, user: UserSimulator, tasks: Sequence[Task],
                 options: RolloutOptions, seed: int, first_task_index: int = 0):
        self.engine, self.tok, self.env, self.user = engine, tokenizer, env, user
        self.tasks, self.opts, self.seed, self.first_task_index = list(tasks), options, seed, first_task_index
        self.max_context = options.max_context or engine.max_len
        if self.max_context > engine.max_len:
            raise ValueError(f"max_context={self.max_context} exceeds the engine's max_len={engine.max_len}")
        self.queue = collections.deque((ti, ri) for ti in range(len(self.tasks)) for ri in range(options.n))
        self.live: dict[int, Conversation] = {}
        self.in_flight: set[asyncio.Task] = set()
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.evaluations: list[asyncio.Future] = []
        self.setup_failures: list[Trajectory] = []
        self._system_ids: dict[str, list[int]] = {}
        self.stats = {"steps": 0, "peak_live": 0, "wait_s": 0.0}

    def _system(self, schemas: Sequence[dict[str, Any]], task: Task) -> list[int]:
        text = self.opts.system_text if self.opts.system_text is not None else self.env.policy_for(task)
        key = json.dumps([text, schemas], sort_keys=True, default=str)
        if key not in self._system_ids:
            self._system_ids[key] = system_prompt_ids(self.tok, text, schemas)
        return self._system_ids[key]

    def _new_conversation(self, ti: int, ri: int) -> Conversation | None:
        task, session = self.tasks[ti], None
        ti += self.first_task_index  # the global task index: seeds and group ids match a one-process run
        seed = rollout_seed(self.seed, ti, ri)
        try:
            session = self.env.reset(task)
            user_session = self.user.start(task, session)
            tools = session.tools()
            return Conversation(self.tok, self.opts, task, group_id=ti, rollout_index=ri, seed=seed, session=session,
                                user_session=user_session, system_ids=self._system(tools, task),
                                schemas=tool_schemas(session), max_context=self.max_context)
        except Exception as e:
            log.exception("setting up %s/%d failed", getattr(task, "task_id", task), ri)
            _close(session)
            self.setup_failures.append(Trajectory(
                task_id=str(getattr(task, "task_id", ti)), group_id=ti, rollout_index=ri, seed=seed, tokens=[],
                loss_mask=[], logprobs=[], prompt_len=0, messages=[], termination=tr.SETUP_ERROR,
                error=f"{type(e).__name__}: {e}"))
            return None

    def _admit(self) -> None:
        while self.queue and self.engine.free_slots > 0:
            conv = self._new_conversation(*self.queue.popleft())
            if conv is None:
                continue
            if conv.done:  # the prompt alone fills the context
                self._finish(conv)
                continue
            conv.slot = self.engine.open(conv.record.tokens, seed=conv.seed)
            self.live[conv.slot] = conv
            self.engine.start(conv.slot, self.opts.sampling(conv.budget()))
        self.stats["peak_live"] = max(self.stats["peak_live"], len(self.live))

    def _on_generation(self, gen) -> None:
        conv = self.live[gen.slot]
        route = conv.on_generation(gen.tokens, gen.logprobs, gen.finish_reason)
        self._check_sync(conv)
        if route.kind == END:
            self._finish(conv)
        elif route.kind == USER:
            self.in_flight.add(asyncio.ensure_future(self._ask_user(conv, route.user_text)))
        elif route.call is None:  # nothing to execute: the parse error is the observation
            self._continue(conv, conv.on_tool_result(Observation(route.error_observation, error=True)))
        else:
            self.in_flight.add(asyncio.ensure_future(self._run_tool(conv, route.call)))

    def _handle(self, item) -> None:
        task, kind, conv, payload, latency = item
        self.in_flight.discard(task)
        ids = conv.on_user_turn(payload, latency) if kind == USER else conv.on_tool_result(payload)
        self._continue(conv, ids)

    def _continue(self, conv: Conversation, ids: list[int] | None) -> None:
        if ids is None:
            self._finish(conv)
            return
        self.engine.append(conv.slot, ids)
        self._check_sync(conv)
        self.engine.start(conv.slot, self.opts.sampling(conv.budget()))

    def _check_sync(self, conv: Conversation) -> None:
        # The trajectory must be exactly what the engine was fed; a mismatch is a bug here.
        if self.engine.length(conv.slot) != len(conv.record.tokens):
            raise RuntimeError(f"rollout bookkeeping bug: slot {conv.slot} holds {self.engine.length(conv.slot)} "
                               f"tokens but the trajectory has {len(conv.record.tokens)}")

    def _finish(self, conv: Conversation) -> None:
        if conv.slot is not None:
            self.engine.release(conv.slot)
            del self.live[conv.slot]
        loop = asyncio.get_running_loop()
        self.evaluations.append(loop.run_in_executor(self.pool, conv.trajectory))

    # -- I/O jobs: they only post to the inbox
    async def _ask_user(self, conv: Conversation, text: str) -> None:
        start = time.perf_counter()
        try:
            if self.opts.user_timeout_s is None:
                turn = await conv.user_session.reply(text)
            else:
                async with asyncio.timeout(self.opts.user_timeout_s):
                    turn = await conv.user_session.reply(text)
            if not isinstance(turn, UserTurn):
                turn = UserTurn("", failed=True, error=f"reply returned {type(turn).__name__}, not a UserTurn")
        except TimeoutError:
            turn = UserTurn("", failed=True, error=f"no reply within user_timeout_s={self.opts.user_timeout_s:g}")
        except Exception as e:
            log.exception("user simulator raised for %s/%d", conv.task.task_id, conv.record.rollout_index)
            turn = UserTurn("", failed=True, error=f"{type(e).__name__}: {e}")
        self.inbox.put_nowait((asyncio.current_task(), USER, conv, turn, time.perf_counter() - start))

    async def _run_tool(self, conv: Conversation, call: ToolCall) -> None:
        obs = await asyncio.get_running_loop().run_in_executor(self.pool, execute_tool, conv.session, call)
        self.inbox.put_nowait((asyncio.current_task(), TOOL, conv, obs, 0.0))

    # -- the loop
    async def run(self) -> RolloutBatch:
        engine = self.engine
        stats0 = dict(engine.stats)
        self.pool = concurrent.futures.ThreadPoolExecutor(self.opts.tool_workers, thread_name_prefix="muajax-tools")
        engine_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="muajax-engine")
        t0 = time.perf_counter()
        try:
            while True:
                self._admit()
                while not self.inbox.empty():
                    self._handle(self.inbox.get_nowait())
                generating = any(engine.is_generating(s) for s in self.live)
                if generating and (self.opts.overlap_io or not self.in_flight):
                    generations = await asyncio.wrap_future(engine_pool.submit(engine.step))
                    self.stats["steps"] += 1
                    for gen in generations:
                        self._on_generation(gen)
                elif self.in_flight:
                    waited = time.perf_counter()
                    self._handle(await self.inbox.get())
                    self.stats["wait_s"] += time.perf_counter() - waited
                elif self.live:
                    raise RuntimeError("rollout bug: conversations are live but none is decoding or waiting")
                elif self.queue:
                    raise RuntimeError(f"the engine has no free slot (all {engine.num_slots} are held "
                                       "elsewhere): release some before running rollouts")
                else:
                    break
            trajectories = list(await asyncio.gather(*self.evaluations)) + self.setup_failures
        finally:
            await self._cleanup(engine_pool)
        wall = time.perf_counter() - t0
        if trajectories and all(t.termination == tr.SETUP_ERROR for t in trajectories):
            raise RuntimeError(f"all {len(trajectories)} conversations failed to start; the first error: "
                               f"{trajectories[0].error}")
        device = engine.stats["device_s"] - stats0["device_s"]
        return RolloutBatch(sorted(trajectories, key=lambda t: (t.group_id, t.rollout_index)), {
            "wall_s": wall, "device_s": device, "busy_share": device / wall if wall > 0 else 0.0,
            "conversations": len(trajectories), **self.stats,
            **{k: engine.stats[k] - stats0[k] for k in ("decode_tokens", "extend_tokens", "decode_calls")}})

    async def _cleanup(self, engine_pool) -> None:
        for task in self.in_flight:
            task.cancel()
        await asyncio.gather(*self.in_flight, return_exceptions=True)
        # A step still running in its thread (the driver was cancelled) must end before the
        # slots it uses are released.
        engine_pool.shutdown(wait=True)
        for slot, conv in list(self.live.items()):
            with contextlib.suppress(KeyError):  # already released
                self.engine.release(slot)
            _close(conv.session)
        self.live.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)


async def run_rollouts(engine: Engine, tokenizer, env: Environment, user: UserSimulator, tasks: Sequence[Task], *,
                       options: RolloutOptions | None = None, seed: int = 0, first_task_index: int = 0,
                       **overrides) -> RolloutBatch:
    """Roll out every task `n` times; returns the trajectories ordered by (task, rollout).

    `overrides` are `RolloutOptions` fields (e.g. `n=4, max_turns=10`) applied on top of
    `options`. All slots this call opens are released when it returns or raises.
    `tasks` may be one process's share of a step that starts at task `first_task_index`: seeds
    and group ids are then those the whole step gives them (`muajax.distributed`).
    """
    options = dataclasses.replace(options or RolloutOptions(), **overrides)
    if not tasks:
        return RolloutBatch([], {"wall_s": 0.0, "device_s": 0.0, "busy_share": 0.0, "conversations": 0})
    return await _Driver(engine, tokenizer, env, user, tasks, options, seed, first_task_index).run()


_thread_loops = threading.local()


def run_rollouts_sync(*args, **kwargs) -> RolloutBatch:
    """`run_rollouts` from synchronous code. Calls from one thread share one event loop, so a
    user simulator holding HTTP connections (bound to a loop) can be reused across calls."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("run_rollouts_sync was called from a running event loop: `await run_rollouts(...)`")
    loop = getattr(_thread_loops, "loop", None)
    if loop is None or loop.is_closed():
        loop = _thread_loops.loop = asyncio.new_event_loop()
    return loop.run_until_complete(run_rollouts(*args, **kwargs))
