"""Checkpoint test states: a small train-state-like tree, its abstract form, bit-exact
comparison, and a directory of saved steps (shared by test_checkpoint*.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from muajax.runtime.checkpoint import Checkpointer


def make_state(seed=0.0):
    w = jnp.arange(4000, dtype=jnp.float32).reshape(40, 100) * 0.37 + seed
    w = w.at[0, 0].set(jnp.nan).at[0, 1].set(-0.0)  # bit-exactness, not just ==
    return {
        "params": {"w": w, "b": (jnp.arange(6, dtype=jnp.bfloat16) / 3 + seed).astype(jnp.bfloat16)},
        "opt": [jnp.int32(7 + int(seed)), {"mu": jnp.full((5,), 1e-30 + seed, jnp.float32),
                                          "mask": jnp.array([True, False, True])}],
    }


def abstract_of(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def assert_bit_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(bits(x), bits(y))


def save_steps(directory, steps, keep=3, **kw):
    ck = Checkpointer(directory, keep=keep, every_steps=1, **kw)
    for s in steps:
        assert ck.save(s, make_state(float(s)), rng=jax.random.key(s), data_position={"index": s * 10})
    ck.close()
