import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp
import numpy as np
import pytest

from muajax.rl import group_advantages


def random_layout(rng, num_groups):
    """Group ids of random sizes 1..8, shuffled so groups are not contiguous, and rewards
    mixing binary, continuous and all-equal groups."""
    sizes = rng.integers(1, 9, size=num_groups)
    ids = np.repeat(np.arange(num_groups), sizes)
    rewards = np.empty(len(ids))
    for g, n in enumerate(sizes):
        kind = g % 3
        if kind == 0:
            vals = rng.integers(0, 2, size=n).astype(np.float64)
        elif kind == 1:
            vals = rng.uniform(-1.0, 2.0, size=n)
        else:
            # 0.1 and 0.7 are not exact in binary, so n copies need not average back to them.
            vals = np.full(n, rng.choice([0.1, 0.7, 1 / 3, 1.0]))
        rewards[ids == g] = vals
    perm = rng.permutation(len(ids))
    return rewards[perm].astype(np.float32), ids[perm].astype(np.int32)


def reference(rewards, ids, num_groups, scale, eps):
    r = rewards.astype(np.float64)
    out = np.zeros_like(r)
    for g in range(num_groups):
        sel = ids == g
        vals = r[sel]
        if len(vals) < 2 or np.all(vals == vals[0]):
            continue
        centered = vals - vals.mean()
        out[sel] = centered / (vals.std(ddof=1) + eps) if scale == "std" else centered
    return out


@pytest.mark.parametrize("scale", ["std", "none"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_float64_reference(scale, seed):
    rng = np.random.default_rng(seed)
    num_groups = 12
    rewards, ids = random_layout(rng, num_groups)
    got = np.asarray(group_advantages(rewards, ids, num_groups, scale=scale))
    assert got.dtype == np.float32
    want = reference(rewards, ids, num_groups, scale, 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", ["std", "none"])
def test_singleton_and_equal_groups_are_exactly_zero(scale):
    ids = np.array([0, 1, 1, 1, 2, 3, 3, 2, 1, 4, 4, 4, 4, 4, 4, 4], np.int32)
    rewards = np.array([0.3, 0.1, 0.1, 0.1, 1.0, 0.7, 0.7, 0.0, 0.1] + [1 / 3] * 7, np.float32)
    got = np.asarray(group_advantages(rewards, ids, 5, scale=scale))
    degenerate = np.isin(ids, [0, 1, 3, 4])
    assert np.all(got[degenerate] == 0.0)
    assert np.all(got[~degenerate] != 0.0)


def test_paper_formula_on_hand_case():
    # Group [1, 0, 0, 0]: mean 0.25, unbiased std 0.5.
    got = np.asarray(group_advantages(np.array([1.0, 0, 0, 0], np.float32), np.zeros(4, np.int32), 1))
    np.testing.assert_allclose(got, [0.75 / (0.5 + 1e-6)] + [-0.25 / (0.5 + 1e-6)] * 3, rtol=1e-6)
    none = np.asarray(group_advantages(np.array([1.0, 0, 0, 0], np.float32), np.zeros(4, np.int32), 1,
                                       scale="none"))
    np.testing.assert_allclose(none, [0.75, -0.25, -0.25, -0.25], rtol=1e-6)


def test_eps_is_added_to_std():
    rewards = np.array([0.0, 1.0], np.float32)
    got = np.asarray(group_advantages(rewards, np.zeros(2, np.int32), 1, eps=0.5))
    std = np.std([0.0, 1.0], ddof=1)
    np.testing.assert_allclose(got, [-0.5 / (std + 0.5), 0.5 / (std + 0.5)], rtol=1e-6)


def test_layout_permutation_equivariant_and_unused_groups_harmless():
    rng = np.random.default_rng(5)
    rewards, ids = random_layout(rng, 10)
    base = np.asarray(group_advantages(rewards, ids, 10))
    perm = rng.permutation(len(ids))
    permuted = np.asarray(group_advantages(rewards[perm], ids[perm], 10))
    np.testing.assert_allclose(permuted, base[perm], rtol=1e-6, atol=1e-7)
    # Relabel the groups sparsely inside a larger id space.
    roomy = np.asarray(group_advantages(rewards, ids * 3 + 1, 31))
    np.testing.assert_allclose(roomy, base, rtol=1e-6, atol=1e-7)


def test_out_of_range_ids_are_padding():
    rewards = np.array([1.0, 0.0, 5.0, -3.0, 1.0], np.float32)
    ids = np.array([0, 0, -1, 2, 0], np.int32)  # -1 and 2 are outside [0, 2)
    got = np.asarray(group_advantages(rewards, ids, 2))
    assert got[2] == 0.0 and got[3] == 0.0
    np.testing.assert_allclose(got[[0, 1, 4]], reference(rewards[[0, 1, 4]], ids[[0, 1, 4]], 2, "std", 1e-6),
                               rtol=1e-6)


def test_num_groups_static_positional_or_keyword():
    rewards = jnp.array([1.0, 0.0, 1.0, 0.0])
    ids = jnp.array([0, 0, 1, 1])
    np.testing.assert_array_equal(group_advantages(rewards, ids, 2), group_advantages(rewards, ids, num_groups=2))


@pytest.mark.parametrize("kwargs, name", [
    (dict(scale="mean"), "scale"),
    (dict(num_groups=0), "num_groups"),
    (dict(num_groups=2.0), "num_groups"),
    (dict(eps=-1.0), "eps"),
])
def test_invalid_options_raise(kwargs, name):
    args = dict(num_groups=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        group_advantages(jnp.zeros(4), jnp.zeros(4, jnp.int32), **args)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(jnp.zeros(4), jnp.zeros(3, jnp.int32), 2)
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(jnp.zeros((2, 2)), jnp.zeros((2, 2), jnp.int32), 2)
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(jnp.zeros(4), jnp.zeros(4), 2)
