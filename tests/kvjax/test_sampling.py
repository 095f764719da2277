import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvjax.sampling import (
  MIN_TEMPERATURE,
  SamplingConfig,
  filter_top_k,
  filter_top_p,
  sample_next_token,
)


def test_greedy_is_argmax():
  logits = jax.random.normal(jax.random.key(0), (3, 50))
  np.testing.assert_array_equal(
    sample_next_token(logits, jax.random.key(1), SamplingConfig()), np.argmax(logits, -1)
  )


@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 20), seed=st.integers(0, 1000))
def test_top_k_keeps_exactly_the_k_largest_distinct_logits(k, seed):
  logits = jax.random.normal(jax.random.key(seed), (2, 20))
  kept = np.isfinite(np.asarray(filter_top_k(logits, k)))
  expected = np.zeros_like(kept)
  np.put_along_axis(expected, np.argsort(-np.asarray(logits), -1)[:, :k], True, -1)
  np.testing.assert_array_equal(kept, expected)


def _top_p_set_float64(logits: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
  """(kept, margin): the smallest set of most likely tokens whose probability reaches p, in
  float64, and how far each token's preceding mass is from p (ties broken toward the earlier
  token)."""
  order = np.argsort(-logits, kind="stable")
  probs = np.exp(logits.astype(np.float64) - logits.max())
  probs /= probs.sum()
  mass_before = np.cumsum(probs[order]) - probs[order]
  kept = np.zeros(logits.shape, bool)
  kept[order[(mass_before < p) | (np.arange(logits.size) == 0)]] = True
  return kept, np.abs(mass_before - p).min()


@settings(max_examples=40, deadline=None)
@given(p=st.floats(0.01, 0.999), seed=st.integers(0, 1000), scale=st.sampled_from([0.5, 2, 8]))
def test_top_p_keeps_the_smallest_set_reaching_p(p, seed, scale):
  logits = np.asarray(jax.random.normal(jax.random.key(seed), (1, 300)) * scale)
  expected, margin = _top_p_set_float64(logits[0], p)
  assume(margin > 1e-5)  # a set decided within float32 rounding of p is either answer
  kept = np.isfinite(np.asarray(filter_top_p(jnp.asarray(logits), p)))[0]
  np.testing.assert_array_equal(kept, expected)


def test_top_p_at_one_keeps_the_whole_vocabulary():
  # float32 mass summed from the most likely token reaches 1 before a 49152-token tail
  logits = jax.random.normal(jax.random.key(0), (2, 49152)) * 5
  np.testing.assert_array_equal(filter_top_p(logits, 1.0), logits)


def test_top_p_near_one_keeps_the_tail_float64_keeps():
  logits = np.asarray(jax.random.normal(jax.random.key(0), (1, 49152)) * 3)
  expected, _ = _top_p_set_float64(logits[0], 0.99999)
  kept = np.isfinite(np.asarray(filter_top_p(jnp.asarray(logits), 0.99999)))[0]
  assert abs(int(kept.sum()) - int(expected.sum())) <= 2, (kept.sum(), expected.sum())


def test_top_p_takes_a_traced_p():
  logits = jax.random.normal(jax.random.key(1), (2, 50)) * 2
  np.testing.assert_array_equal(jax.jit(filter_top_p)(logits, 0.6), filter_top_p(logits, 0.6))
  # traced p=1 keeps a token whose float32 probability underflows to 0, as concrete p=1 does
  tail = jnp.array([[0.0, -200.0, -1.0]])
  np.testing.assert_array_equal(jax.jit(filter_top_p)(tail, 1.0), tail)


def test_top_p_with_tied_logits_keeps_the_smallest_set():
  logits = jnp.log(jnp.array([[0.25, 0.25, 0.25, 0.25], [0.4, 0.2, 0.2, 0.2]]))
  kept = np.isfinite(np.asarray(filter_top_p(logits, 0.45)))
  np.testing.assert_array_equal(kept, [[True, True, False, False], [True, True, False, False]])


def test_top_p_and_top_k_leave_minus_inf_logits_out():
  logits = jnp.array([[0.0, -jnp.inf, 1.0, -jnp.inf]])
  for filtered in (filter_top_p(logits, 0.999), filter_top_k(logits, 3)):
    np.testing.assert_array_equal(np.isfinite(np.asarray(filtered)), [[True, False, True, False]])
  draws = jax.vmap(
    lambda k: sample_next_token(logits, k, SamplingConfig(temperature=1.0, top_p=0.99))
  )(jax.random.split(jax.random.key(0), 200))
  assert set(np.asarray(draws).ravel().tolist()) == {0, 2}


def test_the_smallest_temperature_picks_the_argmax_without_overflow():
  logits = jnp.array([[0.0, 50.0, 100.0], [3.0, -1.0, 2.9]])
  draws = sample_next_token(logits, jax.random.key(0), SamplingConfig(temperature=MIN_TEMPERATURE))
  np.testing.assert_array_equal(draws, [2, 0])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_follows_the_tempered_distribution_and_the_key(temperature):
  probabilities = np.array([0.7, 0.2, 0.1])
  logits = jnp.log(jnp.array([probabilities]))
  config = SamplingConfig(temperature=temperature)
  keys = jax.random.split(jax.random.key(0), 4000)
  draws = jax.vmap(lambda k: sample_next_token(logits, k, config))(keys)
  freq = np.bincount(np.asarray(draws).ravel(), minlength=3) / 4000
  tempered = probabilities ** (1 / temperature) / np.sum(probabilities ** (1 / temperature))
  np.testing.assert_allclose(freq, tempered, atol=0.03)  # 0.5: [0.91, 0.07, 0.02]
  again = jax.vmap(lambda k: sample_next_token(logits, k, config))(keys)
  np.testing.assert_array_equal(draws, again)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(temperature=-1.0), "temperature"),
    (
      dict(temperature=1e-39),
      r"temperature=1e-39 must be 0 \(greedy\) or a finite number >= 1e-06",
    ),
    (dict(temperature=1e-7, top_p=0.9), "temperature=1e-07"),
    (dict(temperature=1.0, top_k=0), "top_k"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(top_k=5), "need temperature"),
    (dict(temperature=float("inf")), r"temperature=inf must be 0 \(greedy\) or a finite"),
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


def test_top_k_keeps_logits_tied_with_the_kth():
  kept = np.isfinite(np.asarray(filter_top_k(jnp.array([[1.0, 3.0, 2.0, 2.0, 0.0]]), 2)))
  np.testing.assert_array_equal(kept, [[False, True, True, True, False]])
