"""The XLA decode floor is the engine's step's matmuls as XLA runs the engine's: plain dots.

The floor used to sum each product into a scalar; XLA fused each dot with its sum into a loop
it generates itself, not the kernel library that runs the engine's dots, and how those two
compare depends on the box's vector ISA: the engine's ratio to the floor moved with the box.
"""
import re

import numpy as np

from muajax.bench import decode_floor


def _weights(layers=2, hidden=32, inter=48, q=32, kv=16, vocab=64):
    rng = np.random.RandomState(0)
    shapes = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]
    return [(0.1 * rng.randn(*s)).astype(np.float32) for s in shapes * layers + [(hidden, vocab)]]


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, current = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{$", line)
        if head:
            current = comps.setdefault(head.group(1), [])
        elif current is not None and "=" in line:
            current.append(line)
    return comps


def test_every_product_is_a_plain_dot_and_none_is_lost():
    weights = _weights()
    run = decode_floor.xla_step(weights, batch=4, steps=3, calls=2)
    hlo = run.program.lower(*run.args).compile().as_text()
    with_dots = [lines for lines in _computations(hlo).values() if any(" dot(" in x for x in lines)]
    assert sum(" dot(" in x for lines in with_dots for x in lines) == len(weights)  # 7 a layer and the head
    for lines in with_dots:  # a dot's computation holds the dot and its operands, nothing fused into it
        ops = [re.search(r"= \S+ ([\w\-]+)\(", x).group(1) for x in lines]
        assert set(ops) <= {"dot", "parameter", "bitcast"}, lines


def test_the_floor_runs_steps_in_a_loop_and_calls_one_after_another():
    weights = _weights()
    run = decode_floor.xla_step(weights, batch=4, steps=3, calls=2)
    h, logits, side = run()
    assert logits.shape == (4, 64) and np.isfinite(np.asarray(logits)).all()
    assert len(side) == 2 * 2  # each layer's k and v products are carried out of the loop
    # the residual after 3 steps: each step fed the last one's normalised residual
    x = np.ones((4, 32), np.float32)
    for _ in range(3):
        hh = x
        for i in range(0, 14, 7):
            wq, wk, wv, wo, wg, wu, wd = weights[i:i + 7]
            hh = hh + (hh @ wq) @ wo
            hh = hh + ((hh @ wg) * (hh @ wu)) @ wd
        out = hh @ weights[-1]
        x = hh / np.sqrt(np.mean(hh * hh, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(logits), out, rtol=2e-4, atol=2e-4)


def test_the_attention_floor_adds_two_plain_dots_a_layer_over_the_cache():
    weights = _weights()
    attention = decode_floor.Attention(heads=4, kv_heads=2, head_dim=8, context=5)
    run = decode_floor.xla_step(weights, batch=3, steps=2, calls=1, attention=attention)
    hlo = run.program.lower(*run.args).compile().as_text()
    dots = [x for lines in _computations(hlo).values() for x in lines if " dot(" in x]
    assert len(dots) == len(weights) + 2 * 2  # the scores and the weighted values of each layer
    caches = run.args[1]
    assert [k.shape for k, _ in caches] == [(3, 2, 5, 8)] * 2
    h, logits, _ = run()
    x = np.ones((3, 32), np.float32)
    for _ in range(2):  # numpy: each layer's attention output feeds o
        hh = x
        for layer, i in enumerate(range(0, 14, 7)):
            wq, wk, wv, wo, wg, wu, wd = weights[i:i + 7]
            keys, values = (np.asarray(c) for c in caches[layer])
            q = (hh @ wq).reshape(3, 2, 2, 8)
            s = np.einsum("bkgh,bksh->bkgs", q, keys) / np.sqrt(8)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            hh = hh + np.einsum("bkgs,bksh->bkgh", p, values).reshape(3, 32) @ wo
            hh = hh + ((hh @ wg) * (hh @ wu)) @ wd
        out = hh @ weights[-1]
        x = hh / np.sqrt(np.mean(hh * hh, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(logits), out, rtol=2e-4, atol=2e-4)
