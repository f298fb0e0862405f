"""Bad chat-completion requests: every kind the server must refuse with a 4xx, and a seeded
fuzzer that builds more. Each case is invalid by construction, whatever the fuzzer draws.

A case is (raw body bytes, expected status, the `param` the error names or None).
"""
from __future__ import annotations

import json
import random
import string

from tests.serving.conftest import CONTEXT, MAX_BODY_BYTES
from tests.serving.test_serve import CALCULATE, MODEL, USER

VOCAB = 151936
GOOD = {"model": MODEL, "messages": USER, "temperature": 0}
NAN, INF, NEG_INF = "__NaN__", "__Infinity__", "__-Infinity__"  # placeholders for JSON's non-standard literals
DEEP = "__deep__"  # where `raw(..., deep=text)` puts a deeply nested JSON text


def raw(body, deep: str = "", **fields) -> bytes:
    """`body` (a dict, updated with `fields`) as JSON text, with the placeholders spelled as
    the bare NaN / Infinity literals Python's json would otherwise accept, and DEEP
    replaced by `deep` (Python's json cannot write deep values: it recurses per level)."""
    text = json.dumps({**body, **fields})
    for marker, literal in ((NAN, "NaN"), (INF, "Infinity"), (NEG_INF, "-Infinity"), (DEEP, deep)):
        text = text.replace(json.dumps(marker), literal)
    return text.encode()


def nested(depth: int, leaf: str = "1") -> str:
    """JSON text of `depth` levels of alternating objects and arrays around `leaf`."""
    opens = "".join('{"k": ' if i % 2 == 0 else "[" for i in range(depth))
    return opens + leaf + "".join("}" if i % 2 == 0 else "]" for i in reversed(range(depth)))


def call_history(arguments) -> list[dict]:
    """USER, then an assistant tool call with these `arguments`, then its result."""
    call = {"id": "call_1", "type": "function", "function": {"name": "calculate", "arguments": arguments}}
    return USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "5"}]


def fixed_cases() -> list[tuple[bytes, int, str | None]]:
    deep_schema = {"type": "function", "function": {"name": "deep", "parameters": DEEP}}
    cases = [
        # sampling fields: out of range, wrong type, not finite
        (raw(GOOD, top_k=2**40), 400, "top_k"),
        (raw(GOOD, top_k=VOCAB + 1), 400, "top_k"),
        (raw(GOOD, top_k=2**31), 400, "top_k"),
        (raw(GOOD, top_k=-2), 400, "top_k"),
        (raw(GOOD, top_k=1.5), 400, "top_k"),
        (raw(GOOD, temperature=NAN), 400, None),  # NaN is not JSON: refused by the parser
        (raw(GOOD, temperature=INF), 400, None),
        (raw(GOOD, temperature=NEG_INF), 400, None),
        (raw(GOOD).replace(b'"temperature": 0', b'"temperature": 1e400'), 400, "temperature"),  # parses to inf
        (raw(GOOD, temperature=2.5), 400, "temperature"),
        (raw(GOOD, temperature="0.5"), 400, "temperature"),
        (raw(GOOD, top_p=NAN), 400, None),
        (raw(GOOD)[:-1] + b', "top_p": 1e-400}', 400, "top_p"),  # underflows to 0
        (raw(GOOD, top_p=1.01), 400, "top_p"),
        (raw(GOOD, max_tokens=2**40), 400, "max_tokens"),
        (raw(GOOD, max_tokens=CONTEXT + 1), 400, "max_tokens"),
        (raw(GOOD, max_tokens=0), 400, "max_tokens"),
        (raw(GOOD, max_tokens=12.0), 400, "max_tokens"),
        (raw(GOOD, max_completion_tokens=-1), 400, "max_completion_tokens"),
        (raw(GOOD, n=2), 400, "n"),
        (raw(GOOD, n=2**64), 400, "n"),
        (raw(GOOD, seed=2**63), 400, "seed"),
        (raw(GOOD, seed=-(2**63) - 1), 400, "seed"),
        (raw(GOOD, seed=1.5), 400, "seed"),
        (raw(GOOD, stop=["a", "b", "c", "d", "e"]), 400, "stop"),
        (raw(GOOD, stop=[""]), 400, "stop"),
        (raw(GOOD, stop="x" * 10_000), 400, "stop"),
        (raw(GOOD, stop=[1]), 400, "stop"),
        (raw(GOOD, stream="yes"), 400, "stream"),
        (raw(GOOD, stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
        (raw(GOOD, presence_penalty=NAN), 400, None),
        (raw(GOOD, frequency_penalty=0.5), 400, "frequency_penalty"),
        (raw(GOOD, logit_bias={"1": 5}), 400, "logit_bias"),
        (raw(GOOD, tools=[CALCULATE], tool_choice="required"), 400, "tool_choice"),
        (raw(GOOD, response_format={"type": "json_object"}), 400, "response_format"),
        # nesting: as objects in the body, and as JSON text the renderer would parse
        (raw(GOOD, deep=nested(5000), messages=call_history(DEEP)), 400, None),
        (raw(GOOD, messages=call_history(nested(5000))), 400, "messages[2].tool_calls[0].function.arguments"),
        (raw(GOOD, deep=nested(3000), tools=[deep_schema]), 400, None),
        (b"[" * 100_000 + b"]" * 100_000, 400, None),
        # size: declared, and (see `chunked`) undeclared
        (raw(GOOD, messages=[{"role": "user", "content": "x" * (MAX_BODY_BYTES + 1)}]), 413, None),
        # malformed bodies and messages
        (b"", 400, None),
        (b"{not json", 400, None),
        (raw(GOOD)[:-5], 400, None),
        (b"\xff\xfe\x00garbage", 400, None),
        (b"[1, 2, 3]", 400, None),
        (raw(GOOD, model="gpt-9"), 404, "model"),
        (raw({"messages": USER}), 400, "model"),
        (raw(GOOD, messages=[]), 400, "messages"),
        (raw(GOOD, messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
        (raw(GOOD, messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
        (raw(GOOD, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]), 400,
         "messages"),
        (raw(GOOD, messages=[{"role": "user", "content": "hi<|im_end|>"}]), 400, "messages"),
        (raw(GOOD).replace(b"What is 2+3?", b"What is \\ud800?"), 400, None),  # a lone surrogate
        (raw(GOOD, messages=call_history("{not json")), 400, "messages"),
        (raw(GOOD, messages=call_history("[1, 2]")), 400, "messages"),
        (raw(GOOD, messages=[{"role": "user", "content": "word " * (CONTEXT + 100)}]), 400, "messages"),
        (raw(GOOD, messages=[{"role": "user", "content": "hi"}] * (CONTEXT + 1)), 400, "messages"),
        (raw(GOOD, tools=[{"type": "function"}]), 400, "tools[0]"),
        (raw(GOOD, tools={"calculate": CALCULATE}), 400, "tools"),
    ]
    return cases


def chunked(size: int):
    """A body of `size` bytes sent without a Content-Length (chunked transfer encoding)."""
    async def body():
        head = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "'
        yield head
        left = size - len(head)
        while left > 0:
            piece = min(left, 64 * 1024)
            yield b"x" * piece
            left -= piece
    return body


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(n))


def _invalid_field(rng: random.Random) -> dict:
    """One top-level field set to a value that is never valid."""
    big = rng.randrange(1, 10**12)
    choices = {
        "temperature": [2 + rng.uniform(1e-6, 1e6), -rng.uniform(1e-9, 10), NAN, INF, _random_text(rng, 3), [1]],
        "top_p": [-rng.uniform(0, 1), 1 + rng.uniform(1e-6, 10), NAN, NEG_INF, {"p": 1}],
        "top_k": [VOCAB + big, -2 - rng.randrange(1000), rng.uniform(0.1, 50), "40"],
        "max_tokens": [CONTEXT + big, -rng.randrange(0, 1000), rng.uniform(1, 100), "64"],
        "seed": [2**63 + big, -(2**63) - big, rng.uniform(-5, 5), [big]],
        "n": [2 + rng.randrange(1000), -rng.randrange(0, 1000), "1"],
        "stop": [[_random_text(rng, 2) for _ in range(5 + rng.randrange(5))], [""], _random_text(rng, 300), [big]],
        "stream": [1 + rng.randrange(9), "true", [True]],
        "messages": [[], {}, _random_text(rng, 5), [{"role": "x-" + _random_text(rng, 4), "content": "hi"}],
                     [{"role": "user"}], [{"role": "user", "content": big}], [[]]],
        "tools": [{}, [big], [{"type": "function"}], [{"type": "function", "function": {"name": ""}}]],
        "model": ["", big, "x-" + _random_text(rng, 8)],
    }
    name = rng.choice(sorted(choices))
    return {name: rng.choice(choices[name])}


def fuzz_cases(count: int, seed: int = 20) -> list[tuple[bytes, int | None, None]]:
    """`count` random invalid bodies: truncated JSON, random bytes, an invalid field, or
    nesting past the limit at a random place. The status is None: any 4xx will do."""
    rng = random.Random(seed)
    good = {**GOOD, "tools": [CALCULATE], "max_tokens": 16, "seed": 3}
    cases = []
    for _ in range(count):
        kind = rng.choice(("truncate", "bytes", "field", "field", "deep"))
        if kind == "truncate":  # a proper prefix of a JSON object is never valid JSON
            text = raw(good)
            body = text[: rng.randrange(1, len(text))]
        elif kind == "bytes":
            body = b"\x00" + rng.randbytes(rng.randrange(0, 200))
        elif kind == "field":
            body = raw(good, **_invalid_field(rng))
        else:
            deep = nested(rng.randrange(130, 4000), leaf=json.dumps(_random_text(rng, 3)))
            where = rng.choice(("arguments", "arguments text", "content", "metadata", "schema"))
            if where == "arguments":
                body = raw(good, deep=deep, messages=call_history(DEEP))
            elif where == "arguments text":
                body = raw(good, messages=call_history(deep))
            elif where == "content":
                body = raw(good, deep=deep, messages=[{"role": "user", "content": [DEEP]}])
            elif where == "metadata":
                body = raw(good, deep=deep, metadata=DEEP)
            else:
                body = raw(good, deep=deep, tools=[{"type": "function", "function": {"name": "f", "parameters": DEEP}}])
        cases.append((body, None, None))
    return cases
