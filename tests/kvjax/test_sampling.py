import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.sampling import SamplingConfig, filter_top_k, filter_top_p, sample_next_token


def test_greedy_is_argmax():
  logits = jax.random.normal(jax.random.key(0), (3, 50))
  np.testing.assert_array_equal(
    sample_next_token(logits, jax.random.key(1), SamplingConfig()), np.argmax(logits, -1)
  )


@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 20), seed=st.integers(0, 1000))
def test_top_k_keeps_exactly_the_k_largest(k, seed):
  logits = jax.random.normal(jax.random.key(seed), (2, 20))
  kept = np.isfinite(np.asarray(filter_top_k(logits, k)))
  expected = np.zeros_like(kept)
  np.put_along_axis(expected, np.argsort(-np.asarray(logits), -1)[:, :k], True, -1)
  np.testing.assert_array_equal(kept, expected)


@settings(max_examples=25, deadline=None)
@given(p=st.floats(0.01, 1.0), seed=st.integers(0, 1000))
def test_top_p_keeps_the_smallest_prefix_reaching_p(p, seed):
  logits = np.asarray(jax.random.normal(jax.random.key(seed), (1, 30)) * 2)
  kept = np.isfinite(np.asarray(filter_top_p(jnp.asarray(logits), p)))[0]
  order = np.argsort(-logits[0])
  probs = np.exp(logits[0] - logits[0].max())
  probs /= probs.sum()
  mass_before = np.cumsum(probs[order]) - probs[order]
  expected = np.zeros(30, bool)
  expected[order[mass_before < p]] = True
  np.testing.assert_array_equal(kept, expected)


def test_sampling_follows_the_distribution_and_the_key():
  logits = jnp.log(jnp.array([[0.7, 0.2, 0.1]]))
  keys = jax.random.split(jax.random.key(0), 4000)
  draws = jax.vmap(lambda k: sample_next_token(logits, k, SamplingConfig(temperature=1.0)))(keys)
  freq = np.bincount(np.asarray(draws).ravel(), minlength=3) / 4000
  np.testing.assert_allclose(freq, [0.7, 0.2, 0.1], atol=0.03)
  again = jax.vmap(lambda k: sample_next_token(logits, k, SamplingConfig(temperature=1.0)))(keys)
  np.testing.assert_array_equal(draws, again)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=1.0, top_k=0), "top_k"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(top_k=5), "need temperature"),
    (dict(temperature=float("inf")), r"temperature=inf must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(temperature="0.5"), "temperature='0.5'"),
    (dict(temperature=True), "temperature=True"),
    (dict(temperature=1.0, top_k=2.5), r"top_k=2.5 must be an int >= 1"),
    (dict(temperature=1.0, top_k=True), "top_k=True"),
    (dict(temperature=1.0, top_p="0.9"), "top_p='0.9' must be in"),
  ],
)
def test_bad_sampling_config_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    SamplingConfig(**kwargs)
