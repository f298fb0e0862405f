"""The host-side multi-turn rollout loop: tasks x n conversations -> `Trajectory`s.

Each conversation gets a fresh environment session (`env.reset(task)`), its own simulated
user and one engine slot (more conversations than slots queue for one). One driver
coroutine owns the engine: it alternates `engine.step()` (one decode chunk over every
generating slot, in a worker thread so the event loop serves HTTP meanwhile) with handling
the user replies and tool results that arrived. Those are asyncio tasks / thread-pool jobs
that only post to an inbox, so while one conversation waits on its user the others decode.
Each conversation is a `Conversation` (its state machine), each message routed by
`muajax.agent.calls`.

Per-rollout seeds derive from (seed, task index, rollout index) and the engine's sampling
key from (seed, position): samples do not depend on scheduling. Nor do the numbers they are
drawn from, when the engine's calls have fixed shapes (`rollout.deterministic`,
`Engine(batch_rows=...)`): then the same seed gives the same bits whatever the timing of
users and tools. The system prompt is registered as the engine's shared prefix.

A stop request (`stop`, by default the process's own: `muajax.runtime.stopping` sets it on
SIGTERM) is seen between engine calls and, while every conversation waits on its user or
tools, every `STOP_POLL_S`: the conversations in flight are dropped (their slots released,
their user and tool jobs cancelled) and `RolloutsStopped` is raised.
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
from collections.abc import Sequence
from typing import Any

import numpy as np

from muajax.agent import trajectory as tr
from muajax.agent.calls import END, TOOL, USER, execute_tools, tool_schemas
from muajax.agent.chat import system_prompt_ids
from muajax.agent.conversation import Conversation, close_quietly
from muajax.agent.trajectory import RolloutBatch, Trajectory
from muajax.domains.base import Environment, Observation, Task, ToolCall, UserSimulator, UserTurn
from muajax.agent.rollout_config import RolloutConfig
from muajax.engine.engine import Engine

log = logging.getLogger(__name__)

STOP_POLL_S = 0.2  # how often a rollout whose conversations all wait on I/O looks at its stop request


class RolloutsStopped(RuntimeError):
    """The rollouts were stopped on request (SIGTERM, a preemption notice): the conversations
    in flight were dropped, none of them was returned."""


_default_stop: list = [None]


def set_default_stop(event) -> None:
    """The stop request (anything with `is_set()`, e.g. a `threading.Event`; None: none) that
    rollouts started without a `stop` of their own obey."""
    _default_stop[0] = event


def rollout_seed(seed: int, task_index: int, rollout_index: int) -> int:
    """A uint32 sampling seed that depends only on (seed, task index, rollout index)."""
    if min(seed, task_index, rollout_index) < 0:
        raise ValueError(f"seeds and indices must be >= 0, got {seed}, {task_index}, {rollout_index}")
    return int(np.random.SeedSequence([seed, task_index, rollout_index]).generate_state(1, np.uint32)[0])


class _Driver:
    def __init__(self, engine: Engine, tokenizer, env: Environment, user: UserSimulator, tasks: Sequence[Task],
                 options: RolloutConfig, seed: int, first_task_index: int = 0, weights=None, stop=None):
        self.stop = stop  # a stop request: anything with `is_set()`
        self._reply: asyncio.Future | None = None  # the inbox read a stop check may leave pending
        self.engine, self.tok, self.env, self.user = engine, tokenizer, env, user
        self.weights = weights  # partial rollouts: newer weights are taken between engine calls
        self.turn_version: dict[int, int] = {}  # slot -> the oldest version its current turn sampled with
        self.tasks, self.opts, self.seed, self.first_task_index = list(tasks), options, seed, first_task_index
        self.max_context = options.max_context
        if self.max_context > engine.max_len:
            raise ValueError(f"max_context={self.max_context} exceeds the engine's max_len={engine.max_len}")
        self.queue = collections.deque((ti, ri) for ti in range(len(self.tasks)) for ri in range(options.n_per_task))
        self.live: dict[int, Conversation] = {}
        self.in_flight: set[asyncio.Task] = set()
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.evaluations: list[asyncio.Future] = []
        self.setup_failures: list[Trajectory] = []
        self._system_ids: dict[str, list[int]] = {}
        self.stats = {"steps": 0, "peak_live": 0, "wait_s": 0.0}

    def _system(self, schemas: Sequence[dict[str, Any]], task: Task) -> list[int]:
        text = self.opts.system_text if self.opts.system_text is not None else self.env.policy_for(task)
        text = text or None  # an empty policy: no system text, the tools block alone (BFCL's FC prompt)
        key = json.dumps([text, schemas], sort_keys=True, default=str)
        if key not in self._system_ids:
            ids = self._system_ids[key] = system_prompt_ids(self.tok, text, schemas)
            if len(ids) < self.engine.max_len:
                # every conversation of the domain starts with it: computed once per policy version
                self.engine.register_prefix(ids)
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
                                schemas=tool_schemas(session), max_context=self.max_context,
                                system_for=lambda new_tools, task=task: self._system(new_tools, task))
        except Exception as e:
            log.exception("setting up %s/%d failed", getattr(task, "task_id", task), ri)
            close_quietly(session)
            self.setup_failures.append(Trajectory(
                task_id=str(getattr(task, "task_id", ti)), group_id=ti, rollout_index=ri, seed=seed, tokens=[],
                loss_mask=[], logprobs=[], prompt_len=0, messages=[], termination=tr.SETUP_ERROR,
                error=f"{type(e).__name__}: {e}", domain=str(getattr(task, "domain", ""))))
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

    def _engine_step(self):
        """One engine call (in the engine thread): first the newest published weights, with
        partial rollouts; then every generating conversation's turn is marked with the
        version it samples with (a turn spanning an update keeps the oldest)."""
        engine = self.engine
        newest = self.weights.newest() if self.weights is not None else None
        if newest is not None and newest[0] > getattr(engine, "version", 0):
            engine.adopt(*newest)
        version = getattr(engine, "version", 0)
        for slot in self.live:
            if engine.is_generating(slot):
                self.turn_version[slot] = min(self.turn_version.get(slot, version), version)
        return engine.step()

    def _on_generation(self, gen) -> None:
        conv = self.live[gen.slot]
        route = conv.on_generation(gen.tokens, gen.logprobs, gen.finish_reason)
        conv.record.versions.append(self.turn_version.pop(gen.slot, getattr(self.engine, "version", 0)))
        self._check_sync(conv)
        if route.kind == END:
            self._finish(conv)
        elif route.kind == USER:
            self.in_flight.add(asyncio.ensure_future(self._ask_user(conv, route.user_text)))
        elif not route.calls:  # nothing to execute: the parse error is the observation
            self._continue(conv, conv.on_tool_results([Observation(route.error_observation, error=True)]))
        else:
            self.in_flight.add(asyncio.ensure_future(self._run_tools(conv, route.calls)))

    def _handle(self, item) -> None:
        task, kind, conv, payload, latency = item
        self.in_flight.discard(task)
        ids = conv.on_user_turn(payload, latency) if kind == USER else conv.on_tool_results(payload)
        self._continue(conv, ids)

    def _continue(self, conv: Conversation, ids: list[int] | None) -> None:
        if ids is None:
            self._finish(conv)
            return
        if conv.reprompted:  # a new system prompt: the whole conversation is prefilled again
            self.engine.release(conv.slot)
            del self.live[conv.slot]
            conv.slot = self.engine.open(conv.record.tokens, seed=conv.seed)
            self.live[conv.slot] = conv
            conv.reprompted = False
        else:
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
            if getattr(self.engine, "record_experts", False):  # routing replay: every computed token's experts
                conv.record.experts = self.engine.experts(conv.slot)
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

    async def _run_tools(self, conv: Conversation, calls: Sequence[ToolCall]) -> None:
        observations = await asyncio.get_running_loop().run_in_executor(self.pool, execute_tools, conv.session, calls)
        self.inbox.put_nowait((asyncio.current_task(), TOOL, conv, observations, 0.0))

    # -- the loop
    async def run(self) -> RolloutBatch:
        engine = self.engine
        stats0 = dict(engine.stats)
        self.pool = concurrent.futures.ThreadPoolExecutor(self.opts.tool_workers, thread_name_prefix="muajax-tools")
        engine_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="muajax-engine")
        t0 = time.perf_counter()
        try:
            while True:
                self._check_stop()
                self._admit()
                while not self.inbox.empty():
                    self._handle(self.inbox.get_nowait())
                generating = any(engine.is_generating(s) for s in self.live)
                if generating and (self.opts.overlap_io or not self.in_flight):
                    generations = await asyncio.wrap_future(engine_pool.submit(self._engine_step))
                    self.stats["steps"] += 1
                    for gen in generations:
                        self._on_generation(gen)
                elif self.in_flight:
                    waited = time.perf_counter()
                    item = await self._next_reply()
                    self.stats["wait_s"] += time.perf_counter() - waited
                    if item is not None:
                        self._handle(item)
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
            **{k: engine.stats[k] - stats0[k] for k in ("decode_tokens", "extend_tokens", "decode_calls", "preemptions",
                                                        "prefix_hits", "prefix_prefill_tokens")}})

    def _check_stop(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise RolloutsStopped(f"rollouts stopped on request: {len(self.live)} conversation(s) in flight and "
                                  f"{len(self.queue)} not started were dropped")

    async def _next_reply(self):
        """The next user reply or tool result; with a stop request to watch, None when none
        came within STOP_POLL_S (the read stays pending for the next call)."""
        if self.stop is None:
            return await self.inbox.get()
        if self._reply is None:
            self._reply = asyncio.ensure_future(self.inbox.get())
        done, _ = await asyncio.wait({self._reply}, timeout=STOP_POLL_S)
        if not done:
            return None
        item, self._reply = self._reply.result(), None
        return item

    async def _cleanup(self, engine_pool) -> None:
        if self._reply is not None:
            self._reply.cancel()
        for task in self.in_flight:
            task.cancel()
        await asyncio.gather(*self.in_flight, return_exceptions=True)
        # A step still running in its thread (the driver was cancelled) must end before the
        # slots it uses are released.
        engine_pool.shutdown(wait=True)
        for slot, conv in list(self.live.items()):
            with contextlib.suppress(KeyError):  # already released
                self.engine.release(slot)
            close_quietly(conv.session)
        self.live.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)


async def run_rollouts(engine: Engine, tokenizer, env: Environment, user: UserSimulator, tasks: Sequence[Task], *,
                       options: RolloutConfig | None = None, seed: int = 0, first_task_index: int = 0,
                       weights=None, stop=None, **overrides) -> RolloutBatch:
    """Roll out every task `n_per_task` times; returns the trajectories ordered by (task, rollout).

    `overrides` are `RolloutConfig` fields (e.g. `n_per_task=4, max_turns=10`) applied on
    top of `options` (default: `RolloutConfig.for_engine(engine.max_len)`). All slots this
    call opens are released when it returns or raises.
    `tasks` may be one process's share of a step that starts at task `first_task_index`: seeds
    and group ids are then those the whole step gives them (`muajax.runtime.distributed`).
    `weights` (partial rollouts, `muajax.train.async_grpo`): its `newest()` is (version,
    prepared params) or None; newer ones are adopted by the engine between its calls. Each
    trajectory's `versions` are its turns' (the engine's `version`, 0 for a plain Engine).
    `stop` (default: `set_default_stop`'s): once it `is_set()`, the conversations in flight
    are dropped and `RolloutsStopped` is raised.
    """
    options = (dataclasses.replace(options, **overrides) if options is not None
               else RolloutConfig.for_engine(engine.max_len, **overrides))
    if not tasks:
        return RolloutBatch([], {"wall_s": 0.0, "device_s": 0.0, "busy_share": 0.0, "conversations": 0})
    stop = _default_stop[0] if stop is None else stop
    return await _Driver(engine, tokenizer, env, user, tasks, options, seed, first_task_index, weights, stop).run()


_thread_loops = threading.local()


def rollout_loop() -> asyncio.AbstractEventLoop:
    """This thread's rollout event loop, the one `run_rollouts_sync` runs on. Another thread
    may run it while this one does not (asynchronous GRPO's rollout thread does), so a user
    simulator bound to it keeps working for this thread's later calls."""
    loop = getattr(_thread_loops, "loop", None)
    if loop is None or loop.is_closed():
        loop = _thread_loops.loop = asyncio.new_event_loop()
    return loop


def run_rollouts_sync(*args, **kwargs) -> RolloutBatch:
    """`run_rollouts` from synchronous code. Calls from one thread share one event loop, so a
    user simulator holding HTTP connections (bound to a loop) can be reused across calls."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("run_rollouts_sync was called from a running event loop: `await run_rollouts(...)`")
    return rollout_loop().run_until_complete(run_rollouts(*args, **kwargs))
