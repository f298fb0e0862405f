"""`python -m muajax.serve`: the real `openai` client over HTTP (chat, tool calls, streaming,
seeds, many concurrent requests), 4xx for malformed requests, and τ2's own CLI run
end to end against the server (as both agent and user).

The served model is a real Qwen3 checkpoint with the full vocabulary whose weights are
set so that, greedy, it always answers CHAIN_TEXT (a tool call), which makes tool-call
output testable with a model small enough for CI (see `make_chain_model`).
"""
import asyncio
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from starlette.testclient import TestClient

from muajax.agent.chat import generation_prompt_ids, render_messages_ids
from muajax.models.tokenizer import IM_END_ID, load_tokenizer
from tests.support.tiny_models import ONE_LAYER_CONFIG

MODEL = "tiny-agent"
CHAIN_TEXT = 'Sure.<tool_call>{"name":"calculate","arguments":{"expression": "2+3"}}</tool_call>'
CALCULATE = {"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
HIDDEN = 32
MARGIN = 10.0


_BUILT: dict[tuple[int, str], str] = {}


def chain_model(tmp_path_factory, max_position_embeddings: int = 8192, text: str = CHAIN_TEXT) -> str:
    """One chain model per text per test session (the serve, eval and rollout tests share them)."""
    if (max_position_embeddings, text) not in _BUILT:
        path = tmp_path_factory.mktemp("chain") / "model"
        _BUILT[max_position_embeddings, text] = make_chain_model(path, max_position_embeddings=max_position_embeddings,
                                                                 text=text)
    return _BUILT[max_position_embeddings, text]


def make_chain_model(path, *, max_position_embeddings: int = 4096, text: str = CHAIN_TEXT) -> str:
    """A Qwen3 checkpoint (vocab 151936, hidden 32, 1 layer) that is a bigram model: the
    attention and MLP outputs are zeroed (wo = w_down = 0), so the residual stream is the
    current token's embedding and the next token depends on the current one only. The
    tokens of "\\n\\n" (the end of the generation prompt), `text` (CHAIN_TEXT unless given)
    and <|im_end|> are all distinct, so giving each its own embedding direction and pointing
    the LM head from it to its successor (logit MARGIN; every other logit ~N(0, 0.1)) makes
    greedy decoding write `text` and stop. At temperature 1 the successor has only ~10%
    probability, so sampled outputs differ by seed."""
    import jax

    from muajax.models.hf import save_hf
    from muajax.models.qwen3 import init_params

    tok = load_tokenizer()
    chain = generation_prompt_ids(tok)[-1:] + tok.encode(text, add_special_tokens=False) + [IM_END_ID]
    assert len(set(chain)) == len(chain) <= HIDDEN
    cfg = ONE_LAYER_CONFIG.replace(vocab_size=151936, hidden_size=HIDDEN, max_position_embeddings=max_position_embeddings)
    params = jax.tree.map(np.array, init_params(cfg, jax.random.key(0)))
    params["layers"]["wo"][:] = 0
    params["layers"]["w_down"][:] = 0
    params["final_norm"][:] = 1
    embed, head = params["embed"], params["lm_head"]
    for i, (current, successor) in enumerate(itertools.pairwise(chain)):
        embed[current] = 0
        embed[current, i] = 1  # RMSNorm scales it to sqrt(HIDDEN) along direction i
        head[:, successor] = 0
        head[i, successor] = MARGIN / math.sqrt(HIDDEN)
    save_hf(params, cfg, str(path))
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from muajax.serve import options_from_args, parse_args
    from muajax.serving.app import BackgroundServer, create_app
    from muajax.serving.loading import build_service

    path = chain_model(tmp_path_factory)
    # τ2 retail's system prompt and tools alone are ~2,700 tokens
    args = parse_args(["--checkpoint", path, "--model-name", MODEL, "--slots", "4", "--max-len", "8192",
                       "--max-tokens", "64", "--decode-chunk", "8", "--port", "0"])
    _, service = build_service(options_from_args(args))
    with BackgroundServer(create_app(service)) as srv:
        srv.service = service
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


USER = [{"role": "system", "content": "You are a shop assistant."}, {"role": "user", "content": "What is 2+3?"}]


def test_chat_tool_calls_and_usage_through_the_openai_client(server, client, tokenizer):
    assert [m.id for m in client.models.list().data] == [MODEL]
    tok = tokenizer

    r = chat(client, USER, tools=[CALCULATE], temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "calculate" and json.loads(call.function.arguments) == {"expression": "2+3"}
    prompt = render_messages_ids(tok, None, [CALCULATE], USER)[0] + generation_prompt_ids(tok)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(tok.encode(CHAIN_TEXT)) + 1  # + <|im_end|>
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    # the call and its result go back in: OpenAI-style history renders and the model answers again
    history = USER + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    again = chat(client, history, tools=[CALCULATE], temperature=0)
    assert again.choices[0].message.tool_calls[0].function.name == "calculate"
    assert again.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens

    plain = chat(client, USER, temperature=0)  # no tools offered: no tool_calls, the raw text
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == CHAIN_TEXT and plain.choices[0].finish_reason == "stop"

    cut = chat(client, USER, tools=[CALCULATE], temperature=0, max_tokens=1)
    assert cut.choices[0].message.content == "Sure" and cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 1

    stopped = chat(client, USER, temperature=0, stop=["<tool_call>"])
    assert stopped.choices[0].message.content == "Sure." and stopped.choices[0].finish_reason == "stop"
    # the stop string ended the generation early (checked after each decode chunk), not at <|im_end|>
    assert stopped.usage.completion_tokens < r.usage.completion_tokens


def test_seed_and_temperature_are_honored(client):
    def sample(seed):
        return chat(client, USER, temperature=1.0, seed=seed, max_tokens=12).choices[0].message.content

    first = sample(7)
    assert sample(7) == first  # same seed, same prompt: same tokens
    assert sample(8) != first
    assert first != CHAIN_TEXT  # at temperature 1 the chain is a ~10%-per-token path


def test_streaming_sends_content_then_tool_calls(client, tokenizer):
    stream = chat(client, USER, tools=[CALCULATE], temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert content == "Sure."
    calls = [tc for c in with_choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "calculate" and calls[0].index == 0
    assert json.loads(calls[0].function.arguments) == {"expression": "2+3"}
    assert with_choices[-1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(tokenizer.encode(CHAIN_TEXT)) + 1

    text = "".join(c.choices[0].delta.content or "" for c in chat(client, USER, temperature=0, stream=True)
                   if c.choices)
    assert text == CHAIN_TEXT


def test_many_concurrent_requests_are_batched_continuously(server):
    before = httpx.get(server.url.removesuffix("/v1") + "/health").json()

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300) as c:
            done = {}

            async def one(name, **kwargs):
                r = await c.chat.completions.create(model=MODEL, messages=USER, **kwargs)
                done[name] = time.perf_counter()
                return r

            # two long sampled generations start first; ten short greedy ones join while they run
            longs = [asyncio.create_task(one(f"long{i}", temperature=1.0, seed=i, max_tokens=240))
                     for i in range(2)]
            await asyncio.sleep(0.2)
            shorts = await asyncio.gather(*(one(f"short{i}", tools=[CALCULATE], temperature=0) for i in range(10)))
            return shorts, await asyncio.gather(*longs), done

    shorts, longs, done = asyncio.run(run())
    for r in shorts:
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.tool_calls[0].function.arguments == '{"expression": "2+3"}'
    assert all(r.usage.completion_tokens == 240 for r in longs)
    assert max(done[f"short{i}"] for i in range(10)) < min(done["long0"], done["long1"])
    after = httpx.get(server.url.removesuffix("/v1") + "/health").json()
    assert after["completed"] - before["completed"] == 12 and after["errors"] == before["errors"]
    assert after["peak_running"] == 4 and after["running"] == 0 and after["queued"] == 0


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(server, client):
    good = {"model": MODEL, "messages": USER}
    cases = [
        (b"{not json", 400, "not valid JSON"),
        ({"model": MODEL}, 400, "'messages'"),
        ({"messages": USER}, 400, "'model' is required"),
        ({**good, "model": "gpt-9"}, 404, "does not exist"),
        ({**good, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        ({**good, "messages": [{"role": "assistant"}]}, 400, "'content' or 'tool_calls'"),
        ({**good, "temperature": 3}, 400, "'temperature'"),
        ({**good, "top_p": 0}, 400, "'top_p'"),
        ({**good, "max_tokens": 0}, 400, "'max_tokens'"),
        ({**good, "n": 2}, 400, "n=1"),
        ({**good, "tools": [{"type": "function"}]}, 400, "tools[0]"),
        ({**good, "tools": [CALCULATE], "tool_choice": "required"}, 400, "tool_choice"),
        ({**good, "stop": [1, 2]}, 400, "'stop'"),
        ({**good, "messages": [{"role": "user", "content": "hi<|im_end|>"}]}, 400, "control token"),
        ({**good, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "context"),
        ([1, 2, 3], 400, "JSON object"),
    ]
    url = server.url + "/chat/completions"
    for body, status, needle in cases:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert needle in error["message"], (needle, error)
        assert error["type"] == "invalid_request_error"
    base = server.url.removesuffix("/v1")
    assert httpx.get(base + "/v1/nope").json()["error"]["code"] == "not_found"
    assert httpx.get(url).status_code == 405
    with pytest.raises(openai.BadRequestError, match="'temperature' must be in"):
        chat(client, USER, temperature=-1)
    r = chat(client, USER, tools=[CALCULATE], temperature=0)  # still serving
    assert r.choices[0].message.tool_calls[0].function.name == "calculate"


def test_an_api_key_is_enforced_when_configured(server):
    from muajax.serving.app import ChatService, create_app

    secret = "s3cret-for-test"
    service = ChatService(server.service.engine, server.service.tok, MODEL, vocab_size=151936, api_key=secret)
    http = TestClient(create_app(service))  # no lifespan: the check runs before any generation
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = http.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    assert secret not in http.get("/v1/models").text


def tau2_command() -> list[str]:
    exe = shutil.which("tau2", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "tau2.cli"]


def test_tau2_cli_completes_a_run_against_the_server(server, tmp_path):
    llm_args = json.dumps({"base_url": server.url, "api_key": "unused", "temperature": 0})
    cmd = tau2_command() + [
        "run", "--domain", "retail", "--agent-llm", f"openai/{MODEL}", "--agent-llm-args", llm_args,
        "--user-llm", f"openai/{MODEL}", "--user-llm-args", llm_args, "--num-tasks", "1", "--max-steps", "5",
        "--max-concurrency", "1", "--max-retries", "0", "--results-dir", str(tmp_path), "--save-to", "run"]
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "run.json").read_text())
    (simulation,) = results["simulations"]
    messages = simulation["messages"]
    calls = [c for m in messages if m["role"] == "assistant" for c in (m.get("tool_calls") or [])]
    assert calls and calls[0]["name"] == "calculate" and calls[0]["arguments"] == {"expression": "2+3"}
    tool_results = [m["content"] for m in messages if m["role"] == "tool"]
    assert tool_results and "5" in tool_results[0]
    user_turns = [m for m in messages if m["role"] == "user"]
    assert user_turns and user_turns[0]["content"] == CHAIN_TEXT  # the same server played the user
    assert simulation["termination_reason"] in ("max_steps", "too_many_errors", "user_stop", "agent_stop")
