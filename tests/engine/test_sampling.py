"""The sort-free top-k/top-p filter against a NumPy sort-based reference, ties and edges included."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muajax.engine.sampling import NEG_INF, _filter_top_k_top_p, first_argmax, sample_tokens

filter_jit = jax.jit(_filter_top_k_top_p)


def reference_keep(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The sort-based cut, in float64: sort descending, cut at the k-th entry and at the
    last entry whose preceding mass is < p, keep every token >= the higher cut value."""
    s = scaled.astype(np.float64)
    desc = -np.sort(-s)
    k = min(top_k, len(s)) if top_k > 0 else len(s)
    threshold = desc[k - 1]
    if top_p < 1.0:
        probs = np.exp(desc - desc[0])
        probs /= probs.sum()
        mass_before = np.cumsum(probs) - probs
        threshold = max(threshold, desc[max(int(np.sum(mass_before < top_p)) - 1, 0)])
    return s >= threshold


def cut_masses(scaled: np.ndarray) -> np.ndarray:
    """For each distinct value (descending), the probability mass of the tokens strictly above it."""
    desc = -np.sort(-scaled.astype(np.float64))
    probs = np.exp(desc - desc[0])
    probs /= probs.sum()
    first = np.r_[True, desc[1:] != desc[:-1]]
    return (np.cumsum(probs) - probs)[first]


def between_cuts(scaled: np.ndarray, target: float) -> float:
    """A p near `target` halfway between two consecutive cut masses: float32 rounding of
    the mass cannot move it across a cut, so the kept set is well defined."""
    masses = np.r_[cut_masses(scaled), 1.0]
    j = min(int(np.searchsorted(masses, target, side="right")) - 1, len(masses) - 2)
    return float((masses[j] + masses[j + 1]) / 2)


def check(logits: np.ndarray, top_k, top_p):
    got = np.asarray(filter_jit(jnp.asarray(logits, jnp.float32), jnp.asarray(top_k, jnp.int32),
                                jnp.asarray(top_p, jnp.float32)))
    for row, k, p, g in zip(logits, top_k, top_p, got):
        keep = reference_keep(row, int(k), float(p))
        # kept logits pass through untouched (a kept -inf stays -inf), the rest become NEG_INF
        np.testing.assert_array_equal(g, np.where(keep, row, np.float32(NEG_INF)), err_msg=f"k={k} p={p}")


def test_random_logits_match_sort_reference():
    rng = np.random.RandomState(0)
    vocab = 1000
    logits = (rng.randn(12, vocab) * rng.choice([0.5, 3.0, 10.0], size=(12, 1))).astype(np.float32)
    logits[3:6] = np.round(logits[3:6] * 2) / 2  # coarse values: many ties, also at the cuts
    top_k = np.asarray([0, 1, 5, 40, vocab, vocab + 7, 0, 3, 17, 0, 1, 999])
    top_p = np.asarray([0.9, 1.0, 0.5, 0.95, 1.0, 0.3, 0.999, 1.0, 0.7, 1e-6, 0.5, 0.6], np.float32)
    for i in np.nonzero(top_p < 1.0)[0]:
        top_p[i] = between_cuts(logits[i], top_p[i])
    check(logits, top_k, top_p)


@pytest.mark.parametrize("seed", range(4))
def test_p_between_cuts_and_small_vocab_ties(seed):
    rng = np.random.RandomState(seed)
    logits = rng.randint(-3, 4, size=(8, 24)).astype(np.float32)  # 7 distinct values among 24: ties everywhere
    top_k = rng.randint(0, 30, size=8)
    top_p = np.asarray([between_cuts(row, rng.uniform()) for row in logits], np.float32)
    check(logits, top_k, top_p)


def test_edges():
    row = np.asarray([1.0, 3.0, 3.0, -2.0, 3.0, 0.5, -np.inf, 2.0], np.float32)
    logits = np.tile(row, (7, 1))
    top_k = np.asarray([1, 2, 8, 100, 0, 0, 0])
    top_p = np.asarray([1.0, 1.0, 1.0, 1.0, 1e-9, 1.0, 0.999999], np.float32)
    check(logits, top_k, top_p)
    got = np.asarray(filter_jit(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p))) > NEG_INF / 2
    assert got[0].tolist() == [False, True, True, False, True, False, False, False]  # k=1 keeps all tied tops
    assert got[1].tolist() == got[0].tolist()  # so does k=2: the 2nd entry is still a top
    assert got[2].sum() == 7 and not got[2][6]  # k=V: everything (the -inf token is still -inf)
    assert (got[4] == got[0]).all()  # tiny p: the top value's ties only
    # uniform logits, p=0.5: nothing is strictly above any token, so all are kept
    uniform = np.asarray(filter_jit(jnp.zeros((1, 4)), jnp.asarray([0]), jnp.asarray([0.5])))
    assert (uniform == 0).all()
    # -0.0 and +0.0 are one value: they tie
    zeros = np.asarray(filter_jit(jnp.asarray([[-0.0, 0.0, -1.0]]), jnp.asarray([1]), jnp.asarray([1.0])))
    assert (zeros[0, :2] == 0).all() and zeros[0, 2] == NEG_INF


def test_large_vocab_and_sampling_draws_from_the_reference_set():
    rng = np.random.RandomState(5)
    vocab = 151936
    logits = (rng.randn(4, vocab) * 4).astype(np.float32)
    top_k = np.asarray([50, 0, 20, 0])
    top_p = np.asarray([1.0, 0.9, 0.8, 1.0], np.float32)
    temperature = np.asarray([1.0, 0.7, 1.3, 1.0], np.float32)
    scaled = logits / temperature[:, None]
    for i in np.nonzero(top_p < 1.0)[0]:
        top_p[i] = between_cuts(scaled[i], top_p[i])
    check(scaled, top_k, top_p)
    keys = jax.vmap(jax.random.key)(jnp.arange(4))
    tokens, logprobs = jax.jit(sample_tokens)(jnp.asarray(logits), keys, jnp.asarray(temperature),
                                             jnp.asarray(top_p), jnp.asarray(top_k))
    for i in range(4):  # the draw is a categorical over exactly the reference's kept logits
        masked = np.where(reference_keep(scaled[i], int(top_k[i]), float(top_p[i])), scaled[i], NEG_INF)
        want = jax.random.categorical(keys[i], jnp.asarray(masked, jnp.float32))
        assert int(tokens[i]) == int(want)
    np.testing.assert_allclose(np.asarray(logprobs), jax.nn.log_softmax(jnp.asarray(scaled))[np.arange(4), tokens],
                               atol=1e-5)


def test_first_argmax_is_argmax_with_ties_nans_and_infinities():
    rng = np.random.RandomState(3)
    x = rng.randn(6, 1000).astype(np.float32)
    x[1, [7, 300, 999]] = 50.0                 # ties: the first wins
    x[2] = -np.inf                             # nothing finite: index 0, as argmax
    x[3, [10, 20]] = np.nan                    # the first NaN, as argmax
    x[4, 999] = np.inf
    x[5, :] = 0.0                              # all equal
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got.tolist()[:4] == [int(np.argmax(x[0])), 7, 0, 10]
