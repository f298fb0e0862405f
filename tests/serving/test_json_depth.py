import json
import random

from muajax.serving.json_depth import exceeds, nesting_depth


def reference_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max((reference_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((reference_depth(v) for v in value.values()), default=0)
    return 0


def random_value(rng: random.Random, depth: int):
    kind = rng.choice("lds" if depth < 12 else "s")
    if kind == "l":
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == "d":
        return {rng.choice(["a", "[{", '"}', "\\"]): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return rng.choice(["x", "[[[", "}}", '"[', "\\", "\\\"{", 1, 2.5, None, True])


def test_depth_matches_a_parse_and_ignores_brackets_in_strings():
    rng = random.Random(0)
    for _ in range(300):
        value = random_value(rng, 0)
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
            assert nesting_depth(text) == reference_depth(value), text
            assert nesting_depth(text.encode()) == reference_depth(value)


def test_deep_text_is_measured_without_recursion():
    deep = "[" * 200_000 + "]" * 200_000
    assert nesting_depth(deep) == 200_000 and exceeds(deep, 128) and not exceeds("[[1]]", 2)
    assert exceeds('{"a": [' + '"[",' * 500 + "1]}", 2) is False  # many brackets, all in strings
    assert nesting_depth('"unterminated [[[') == 3  # invalid JSON: an upper bound is enough
