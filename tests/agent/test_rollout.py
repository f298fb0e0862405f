"""The rollout loop on a real (tiny, random, chatty) Qwen3 with the real tokenizer.

The model is random but bent towards a small vocabulary that ends turns with <|im_end|>
and often opens <tool_call> (muajax.bench.rollout.chatty_params): its garbage exercises
both routes (user, tool error) through the real engine. Routing of well-formed tool calls
is tested on scripted text fed to the same `Conversation` state machine the loop drives.

The engine, model and tokenizer are built once per process (`shared_engine`) and also
used by the other rollout test files: compiling the decode programs dominates test time.
"""
from __future__ import annotations

import asyncio
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.bench.rollout import chatty_params, random_params, tiny_config
from muajax.agent.chat import (
    after_assistant_ids,
    generation_prompt_ids,
    system_prompt_ids,
    user_turn_ids,
)
from muajax.engine.engine import Engine
from muajax.domains.builtin import BuiltinEnvironment
from muajax.models.qwen3 import forward_jit
from muajax.models.tokenizer import IM_END_ID, IM_START_ID, load_tokenizer
from muajax.agent.calls import execute_tool, tool_schemas
from muajax.agent.conversation import Conversation
from muajax.agent.rollout import rollout_seed, run_rollouts, run_rollouts_sync
from muajax.agent.rollout_config import RolloutConfig
from muajax.agent.trajectory import (
    CONTEXT,
    MALFORMED_CALL,
    MAX_TURNS,
    USER_STOP,
    rollout_metrics,
)
from muajax.runtime.host_batch import collate
from muajax.domains.builtin.user import ScriptedUser

MAX_LEN = 2048


class RecordingEngine(Engine):
    """The real engine; it only keeps a copy of every generation it returns."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generations: list[tuple[tuple[int, ...], tuple[float, ...], str]] = []

    def step(self):
        finished = super().step()
        self.generations.extend((tuple(g.tokens), tuple(g.logprobs), g.finish_reason) for g in finished)
        return finished


@functools.cache
def tokenizer():
    return load_tokenizer()


@functools.cache
def tiny_model():
    cfg = tiny_config()
    return cfg, chatty_params(random_params(cfg, seed=0), tokenizer(), mean_turn_tokens=6.0)


@functools.cache
def shared_engine() -> RecordingEngine:
    cfg, params = tiny_model()
    return RecordingEngine(params, cfg, num_slots=2, max_len=MAX_LEN, decode_chunk=8, extend_widths=(128,))


@functools.cache
def builtin_env() -> BuiltinEnvironment:
    return BuiltinEnvironment(seed=0)


class RecordingEnv(BuiltinEnvironment):
    """The built-in domain, remembering every session it hands out."""

    def __init__(self):
        super().__init__(seed=0)
        self.sessions = []

    def reset(self, task):
        session = super().reset(task)
        self.sessions.append(session)
        return session


def full_forward_logprobs(tokens: list[int], positions: list[int]) -> np.ndarray:
    """log p(tokens[i] | tokens[:i]) for each i in positions, from one forward over the whole
    sequence (padded to MAX_LEN so every trajectory shares one compiled program)."""
    cfg, params = tiny_model()
    padded = np.zeros((1, MAX_LEN), np.int32)
    padded[0, : len(tokens)] = tokens
    index = np.zeros((1, 256), np.int32)
    assert len(positions) <= 256
    index[0, : len(positions)] = np.asarray(positions) - 1  # the logits at i-1 predict token i
    logits, _ = forward_jit(params, cfg, jnp.asarray(padded), logits_index=jnp.asarray(index))
    logp = jax.nn.log_softmax(np.asarray(logits[0, : len(positions)], np.float64), axis=-1)
    return logp[np.arange(len(positions)), np.asarray(tokens)[positions]]


@pytest.fixture(scope="module")
def main_run():
    engine, env = shared_engine(), RecordingEnv()
    tasks = env.tasks("train")[:2]
    engine.generations.clear()
    batch = run_rollouts_sync(engine, tokenizer(), env, ScriptedUser(max_stalls=2), tasks, n_per_task=2, max_turns=4,
                              max_new_tokens_per_turn=10, seed=7)
    return batch, list(engine.generations), env, tasks


def test_loss_mask_is_exactly_the_sampled_tokens_and_logprobs_match_a_full_forward(main_run):
    batch, generations, _, tasks = main_run
    tok = tokenizer()
    assert [(t.group_id, t.rollout_index) for t in batch] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert shared_engine().free_slots == shared_engine().num_slots  # every slot went back
    spans = []
    for traj in batch:
        traj.check()
        system = system_prompt_ids(tok, builtin_env().policy(), builtin_env().reset(tasks[traj.group_id]).tools())
        prompt = system + user_turn_ids(tok, tasks[traj.group_id].first_user_message) + generation_prompt_ids(tok)
        assert traj.tokens[: traj.prompt_len] == prompt
        assert traj.assistant_turns == len(traj.sampled_spans) >= 1
        mask = np.asarray(traj.loss_mask)
        for k, (start, end) in enumerate(traj.sampled_spans):
            sampled = traj.tokens[start:end]
            spans.append((tuple(sampled), tuple(traj.logprobs[start:end])))
            # every sampled turn follows a generation prompt, and mask 1 covers it exactly
            assert traj.tokens[start - len(generation_prompt_ids(tok)): start] == generation_prompt_ids(tok)
            assert mask[start:end].all() and not mask[start - 1] and (end == len(mask) or not mask[end])
            if end < len(traj.tokens):  # a following turn: <|im_end|> (host-closed if cut), "\n", <|im_start|>
                closed = sampled[-1] == IM_END_ID
                follow = traj.tokens[end:end + 3]
                want = ([] if closed else [IM_END_ID]) + after_assistant_ids(tok) + [IM_START_ID]
                assert follow[: len(want)] == want
                assert closed or len(sampled) == 10  # only a turn cut at max_new_tokens is host-closed
        assert mask.sum() == sum(e - s for s, e in traj.sampled_spans)
        assert not np.asarray(traj.logprobs)[mask == 0].any()
    # the mask-1 tokens of all trajectories are exactly what the engine returned, logprobs too
    assert sorted(spans) == sorted((g[0], g[1]) for g in generations)
    for traj in batch:
        positions = [i for i, m in enumerate(traj.loss_mask) if m]
        want = full_forward_logprobs(traj.tokens, positions)
        np.testing.assert_allclose(np.asarray(traj.logprobs)[positions], want, atol=1e-4, rtol=0)


def test_routing_transcript_and_stats(main_run):
    batch, _, env, _ = main_run
    # each conversation had its own environment session: n rollouts never share a database
    assert len(env.sessions) == 4 and len({id(s) for s in env.sessions}) == 4
    routes = {"user": 0, "tool": 0}
    for traj in batch:
        assert traj.termination in (USER_STOP, MAX_TURNS, CONTEXT)
        assert traj.turns <= 4 and traj.turns == len(traj.messages) - 1 - traj.assistant_turns
        assert traj.messages[0] == {"role": "user", "content": env.tasks("train")[traj.group_id].first_user_message}
        assert [m["role"] for m in traj.messages[1::2]] == ["assistant"] * traj.assistant_turns
        for reply in traj.messages[2::2]:
            routes["user" if reply["role"] == "user" else "tool"] += 1
        assert len(traj.user_latency_s) == sum(m["role"] == "user" for m in traj.messages[1:])
        assert traj.malformed_calls == sum(m["role"] == "tool" and m["content"].startswith("Error")
                                           for m in traj.messages)
        assert 0.0 <= traj.reward <= 1.0 and "db_match" in traj.details
    assert routes["user"] > 0 and routes["tool"] > 0  # the chatty model exercises both routes
    assert 0.0 < batch.stats["busy_share"] <= 1.0 and batch.stats["device_s"] > 0
    assert batch.stats["peak_live"] == 2  # 4 conversations queued on 2 slots


def test_same_samples_whatever_the_scheduling(main_run):
    batch, _, env, tasks = main_run
    # the reference mode decodes in a different order and batch makeup; the seeds are per
    # (seed, task, rollout), so each conversation must come out the same
    again = run_rollouts_sync(shared_engine(), tokenizer(), env, ScriptedUser(max_stalls=2), tasks, n_per_task=2, max_turns=4,
                              max_new_tokens_per_turn=10, seed=7, overlap_io=False)
    assert [t.tokens for t in again] == [t.tokens for t in batch]
    assert [t.termination for t in again] == [t.termination for t in batch]
    assert rollout_seed(7, 1, 0) == batch[2].seed != batch[3].seed


def test_collate_and_metrics(main_run):
    batch = main_run[0]
    arrays = collate(batch, multiple=64)
    longest = max(len(t.tokens) for t in batch)
    b, t = arrays["tokens"].shape
    assert b == 4 and t % 64 == 0 and longest <= t < longest + 64
    for i, traj in enumerate(batch):
        n = len(traj.tokens)
        assert arrays["tokens"][i, :n].tolist() == traj.tokens
        assert (arrays["tokens"][i, n:] == 151643).all() and not arrays["loss_mask"][i, n:].any()
        assert arrays["loss_mask"][i, :n].tolist() == traj.loss_mask
        np.testing.assert_array_equal(arrays["old_logprobs"][i, :n], np.float32(traj.logprobs))
    assert arrays["group_ids"].tolist() == [0, 0, 1, 1]
    np.testing.assert_array_equal(arrays["rewards"], np.float32([t.reward for t in batch]))
    assert arrays["tokens"].dtype == np.int32 and arrays["old_logprobs"].dtype == np.float32
    with pytest.raises(ValueError, match="shorter"):
        collate(batch, length=longest - 1)
    metrics = batch.metrics()
    assert metrics["termination"] and abs(sum(metrics["termination"].values()) - 1.0) < 1e-9
    assert metrics["turns"] == np.mean([t.turns for t in batch])
    assert metrics["all_correct_ratio"] + metrics["all_wrong_ratio"] <= 1.0
    assert metrics["busy_share"] == batch.stats["busy_share"]
    assert rollout_metrics([])["reward"] is None


def test_max_turns_and_malformed_end(main_run):
    env, tok = builtin_env(), tokenizer()
    tasks = env.tasks("train")[2:4]
    never_done = ScriptedUser(max_turns=100, max_stalls=100)
    batch = run_rollouts_sync(shared_engine(), tok, env, never_done, tasks, n_per_task=2, max_turns=3,
                              max_new_tokens_per_turn=10, seed=1, end_on_malformed_call=True)
    seen = set()
    for traj in batch:
        traj.check()
        seen.add(traj.termination)
        if traj.termination == MAX_TURNS:
            # the 3rd observation is recorded in the transcript, never fed to the model
            assert traj.turns == 3 and traj.assistant_turns == 3 and traj.messages[-1]["role"] in ("user", "tool")
            assert traj.malformed_calls == 0 and traj.loss_mask[-1] == 1
        else:
            assert traj.termination == MALFORMED_CALL
            assert traj.malformed_calls == 1 and traj.messages[-1]["role"] == "assistant"
            assert "tool_calls" not in traj.messages[-1]  # never executed
            assert traj.loss_mask[-1] == 1 and traj.turns == traj.assistant_turns - 1
    assert seen == {MAX_TURNS, MALFORMED_CALL}


def test_context_limit_ends_episodes(main_run):
    env, tok = builtin_env(), tokenizer()
    tasks = env.tasks("train")[:1]
    prompt_len = main_run[0][0].prompt_len
    batch = run_rollouts_sync(shared_engine(), tok, env, ScriptedUser(max_turns=100, max_stalls=100), tasks, n_per_task=2,
                              max_turns=30, max_new_tokens_per_turn=10, max_context=prompt_len + 60, seed=3)
    for traj in batch:
        traj.check()
        assert traj.termination == CONTEXT and len(traj.tokens) <= prompt_len + 60
    # a prompt that does not fit is a context end before any decoding
    tiny = run_rollouts_sync(shared_engine(), tok, env, ScriptedUser(), tasks, n_per_task=1, max_context=prompt_len)
    assert tiny[0].termination == CONTEXT and tiny[0].assistant_turns == 0 and not any(tiny[0].loss_mask)
    with pytest.raises(ValueError, match="max_len"):
        run_rollouts_sync(shared_engine(), tok, env, ScriptedUser(), tasks, n_per_task=1, max_context=MAX_LEN + 1)
    with pytest.raises(ValueError, match="max_turns"):
        RolloutConfig(max_turns=0)


def _scripted_turn(conv: Conversation, text: str) -> list[int]:
    tok = tokenizer()
    ids = tok.encode(text, add_special_tokens=False) + [IM_END_ID]
    route = conv.on_generation(ids, [-1.0] * len(ids), "stop")
    assert route.kind == "tool" and route.call is not None, text
    return conv.on_tool_result(execute_tool(conv.session, route.call))


def _conversation(env, task, rollout_index: int) -> Conversation:
    session = env.reset(task)
    return Conversation(tokenizer(), RolloutConfig(), task, group_id=0, rollout_index=rollout_index, seed=0,
                        session=session, user_session=None, system_ids=[1, 2, 3], schemas=tool_schemas(session),
                        max_context=10**6)


def test_concurrent_rollouts_of_one_task_never_see_each_others_writes():
    env = builtin_env()
    task = next(t for t in env.tasks("train") if t.metadata["kind"] == "cancel")
    meta, order = task.metadata, task.metadata["order_id"]
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
    login = call.format("find_user", f'{{"name": "{meta["name"]}", "zip": "{meta["zip"]}"}}')
    get = call.format("get_order", f'{{"order_id": "{order}"}}')
    cancel = call.format("cancel_order", f'{{"order_id": "{order}"}}')
    a, b = _conversation(env, task, 0), _conversation(env, task, 1)
    for conv in (a, b):
        _scripted_turn(conv, login)
    _scripted_turn(a, cancel)
    assert "cancelled" in a.record.messages[-1]["content"] and not a.record.messages[-1]["content"].startswith("Error")
    _scripted_turn(b, get)  # interleaved after a's write
    assert json.loads(b.record.messages[-1]["content"])["status"] == "pending"
    _scripted_turn(a, get)
    assert json.loads(a.record.messages[-1]["content"])["status"] == "cancelled"
    ta, tb = a.trajectory(), b.trajectory()
    assert ta.tool_calls["cancel_order"] == 1 and tb.tool_calls["cancel_order"] == 0
    assert ta.details["db_match"] != tb.details["db_match"]
    assert b.session.db["orders"][order]["status"] == "pending"
    assert a.session.db["orders"][order]["status"] == "cancelled"


def test_run_rollouts_sync_refuses_a_running_loop():
    async def inside():
        with pytest.raises(RuntimeError, match="await run_rollouts"):
            run_rollouts_sync(shared_engine(), tokenizer(), builtin_env(), ScriptedUser(), [], n_per_task=1)
        return await run_rollouts(shared_engine(), tokenizer(), builtin_env(), ScriptedUser(), [], n_per_task=1)

    assert asyncio.run(inside()) == []
