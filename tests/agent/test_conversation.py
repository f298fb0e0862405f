"""The conversation state machine's evaluation switches: every call of a message run in
order (`execute_all_calls`), τ2's termination-aware scoring (`zero_unfinished`), and a tool
list that changes mid-episode rendered into the prompt, in the real rollout loop too."""
from __future__ import annotations

import json

from muajax.agent.calls import TOOL, execute_tools, route_assistant, tool_schemas
from muajax.agent.chat import generation_prompt_ids, system_prompt_ids
from muajax.agent.conversation import Conversation
from muajax.agent.rollout import run_rollouts_sync
from muajax.agent.rollout_config import RolloutConfig
from muajax.agent.trajectory import (ENV_DONE, FINISHED_TERMINATIONS, MAX_TURNS, TERMINATIONS, TRANSFER, USER_STOP,
                                     Trajectory)
from muajax.domains.base import (STOP, Environment, EnvSession, Evaluation, Observation, Task, UserSession,
                                 UserSimulator, UserTurn)
from muajax.models.tokenizer import IM_END_ID
from tests.agent.test_rollout import shared_engine, tokenizer


def _tool(name: str, **params: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {p: {"type": kind} for p, kind in params.items()}, "required": list(params)}}}


class RegisterSession(EnvSession):
    """A register the calls act on in the order they run: the outputs prove the order."""

    def __init__(self, task):
        self.task, self.value, self.log = task, 0, []
        self.extra: list[dict] = []

    def tools(self):
        return [_tool("set", value="integer"), _tool("add", value="integer"), _tool("get"),
                _tool("transfer_to_human_agents", summary="string"), *self.extra]

    def step(self, call):
        self.log.append(call.name)
        if call.name == "set":
            self.value = call.arguments["value"]
        elif call.name == "add":
            self.value += call.arguments["value"]
        elif call.name == "transfer_to_human_agents":
            return Observation("Transfer successful", done=True)
        return Observation(str(self.value))

    def evaluate(self, messages, *, communicate_info):
        return Evaluation(float(self.value == 3), 0.5)  # "the database is right" whatever ended the episode


class RegisterEnvironment(Environment):
    name = "register"

    def policy(self):
        return "Keep the register."

    def tasks(self, split):
        return [Task(f"{split}-0", self.name, "Make it 3.", "")]

    def reset(self, task):
        return RegisterSession(task)


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _conversation(options: RolloutConfig, system_for=None) -> Conversation:
    env = RegisterEnvironment()
    task = env.tasks("test")[0]
    session = env.reset(task)
    return Conversation(tokenizer(), options, task, group_id=0, rollout_index=0, seed=0, session=session,
                        user_session=None, system_ids=[1, 2, 3], schemas=tool_schemas(session), max_context=10**6,
                        system_for=system_for)


def _say(conv: Conversation, text: str):
    ids = tokenizer().encode(text, add_special_tokens=False) + [IM_END_ID]
    route = conv.on_generation(ids, [-0.5] * len(ids), "stop")
    if route.kind == TOOL:
        return route, conv.on_tool_results(execute_tools(conv.session, route.calls))
    return route, None


def test_every_call_of_a_message_runs_in_order_only_when_asked():
    text = "Setting it." + _call("set", value=1) + _call("add", value=2) + _call("get")
    conv = _conversation(RolloutConfig(execute_all_calls=True))
    route, ids = _say(conv, text)
    assert [c.name for c in route.calls] == ["set", "add", "get"] and route.malformed_count == 0
    assert conv.session.log == ["set", "add", "get"]
    tools = conv.record.messages[2:]
    assert [(m["name"], m["content"], m["tool_call_id"]) for m in tools] == [
        ("set", "1", "call_1_0"), ("add", "3", "call_1_1"), ("get", "3", "call_1_2")]
    assert conv.record.turns == 3 and dict(conv.record.tool_calls) == {"set": 1, "add": 1, "get": 1}
    # the three results come back in one user turn, in order (Qwen3's layout)
    turn = tokenizer().decode(ids, skip_special_tokens=False)
    assert turn == ("\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n3\n</tool_response>\n"
                    "<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert conv.trajectory().reward == 1.0

    first_only = _conversation(RolloutConfig())  # MUA-RL's training rollout
    route, _ = _say(first_only, text)
    assert [c.name for c in route.calls] == ["set"] and first_only.session.log == ["set"]
    assert [m["role"] for m in first_only.record.messages] == ["user", "assistant", "tool"]
    assert len(first_only.record.messages[1]["tool_calls"]) == 3  # the transcript keeps what was written
    assert first_only.trajectory().reward == 0.0

    # a call that ends the episode is the last to run; malformed calls are each counted
    ending = _conversation(RolloutConfig(execute_all_calls=True))
    _say(ending, _call("set", value=3) + _call("transfer_to_human_agents", summary="x") + _call("add", value=1)
         + _call("nope"))
    assert ending.session.log == ["set", "transfer_to_human_agents"] and ending.record.termination == TRANSFER
    assert ending.record.malformed_calls == 1 and ending.trajectory().reward == 1.0
    routed = route_assistant(_call("nope") + _call("get", x=1), "stop", tool_schemas(ending.session),
                             execute_all_calls=True, end_on_malformed_call=True)
    assert routed.kind == "end" and routed.malformed_count == 2 and "unknown tool" in routed.malformed


def test_unfinished_episodes_score_zero_only_with_termination_aware_scoring():
    assert FINISHED_TERMINATIONS < set(TERMINATIONS)
    for zero, expected in ((False, 1.0), (True, 0.0)):
        conv = _conversation(RolloutConfig(max_turns=1, zero_unfinished=zero))
        _, ids = _say(conv, _call("set", value=3))
        assert ids is None and conv.record.termination == MAX_TURNS  # cut off with the register right
        record = conv.trajectory()
        assert record.reward == expected and record.partial == 0.5 and not record.finished
        if zero:
            assert record.details == {"unfinished": MAX_TURNS, "reward_if_finished": 1.0}

    conv = _conversation(RolloutConfig(zero_unfinished=True))
    _say(conv, _call("set", value=3))
    _say(conv, "Done, it is 3.")
    assert conv.on_user_turn(UserTurn(f"Thanks {STOP}", end=STOP), 0.0) is None
    record = conv.trajectory()
    assert record.termination == USER_STOP and record.finished and record.reward == 1.0
    for ending in (TRANSFER, ENV_DONE, "user_transfer", "user_out_of_scope"):
        assert Trajectory("t", 0, 0, 0, [], [], [], 0, [], ending).finished
    for ending in ("max_turns", "context", "malformed_call", "user_error", "setup_error"):
        assert not Trajectory("t", 0, 0, 0, [], [], [], 0, [], ending).finished


def test_a_tool_list_that_grows_is_rendered_into_a_new_system_prompt():
    tok = tokenizer()
    new_system = system_prompt_ids(tok, "Keep the register.", [_tool("square")])
    conv = _conversation(RolloutConfig(), system_for=lambda tools: new_system)
    _say(conv, _call("set", value=2))
    before = list(conv.record.tokens)
    spans, prompt_len = list(conv.record.sampled_spans), conv.record.prompt_len
    conv.session.extra, conv.session.tools_revision = [_tool("square")], 1
    _, ids = _say(conv, _call("get"))
    record = conv.record
    assert conv.reprompted and "square" in conv.schemas
    assert record.tokens == new_system + before[3:] + list(record.tokens[len(new_system) + len(before) - 3:])
    assert ids == record.tokens[-len(ids):] and ids[-len(generation_prompt_ids(tok)):] == generation_prompt_ids(tok)
    shift = len(new_system) - 3
    assert record.sampled_spans[0] == (spans[0][0] + shift, spans[0][1] + shift)
    assert record.prompt_len == prompt_len + shift
    record.check()  # masks and spans still agree after the shift


class _GrowingUser(UserSimulator):
    """First reply: a new tool appears (as BFCL's miss_func turn); second: stop."""

    def start(self, task, env=None):
        user = self

        class Session(UserSession):
            replies = 0

            async def reply(self, agent_message):
                self.replies += 1
                if self.replies == 1:
                    env.extra, env.tools_revision = [_tool("square")], 1
                    user.grew = True
                    return UserTurn("I have updated some more functions you can choose from. What about now?")
                return UserTurn(STOP, end=STOP)

        return Session()


def test_the_rollout_loop_prefills_a_conversation_again_when_its_tools_change():
    class PlainSession(RegisterSession):
        def tools(self):  # no tools at first: the random model's text goes to the user
            return list(self.extra)

    class Env(RegisterEnvironment):
        def reset(self, task):
            return PlainSession(task)

    user = _GrowingUser()
    batch = run_rollouts_sync(shared_engine(), tokenizer(), Env(), user, Env().tasks("test"), n_per_task=1,
                              max_turns=6, max_new_tokens_per_turn=8, seed=3)
    (record,) = batch
    assert getattr(user, "grew", False), "the random model never answered in plain text (seeded: deterministic)"
    expected = system_prompt_ids(tokenizer(), "Keep the register.", [_tool("square")])
    assert record.tokens[: len(expected)] == expected  # what the engine was fed (the loop checks it matches)
    assert record.termination in (USER_STOP, MAX_TURNS, "context", ENV_DONE) and record.error is None
    assert shared_engine().free_slots == shared_engine().num_slots


def test_an_environment_that_could_not_be_set_up_ends_the_episode_as_a_setup_error():
    """A session built in the background (τ2's) reports a failed build on its first tool call:
    the conversation ends as setup_error, which the update leaves out, not as a normal episode."""
    from muajax.agent.trajectory import ERROR_TERMINATIONS, SETUP_ERROR

    conv = _conversation(RolloutConfig())
    ids = tokenizer().encode(_call("get"), add_special_tokens=False) + [IM_END_ID]
    route = conv.on_generation(ids, [-0.5] * len(ids), "stop")
    assert route.kind == TOOL
    failed = Observation("Error: the environment could not be set up: ValueError: no", error=True, setup_error=True)
    assert conv.on_tool_results([failed]) is None
    assert conv.record.termination == SETUP_ERROR and SETUP_ERROR in ERROR_TERMINATIONS
    assert conv.record.error == failed.content
