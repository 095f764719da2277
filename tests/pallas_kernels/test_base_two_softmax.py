"""The GPU kernels' base-2 softmax bookkeeping against natural-unit references (float64)."""

import math

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np

from pallas_kernels.base_two_softmax import (
  LN_2,
  LOG2_E,
  base_two_queries,
  natural_log_sum_exp,
)


def test_constants_are_inverse_logarithms():
  assert LOG2_E == math.log2(math.e)
  assert abs(LOG2_E * LN_2 - 1.0) < 1e-15
  queries = jnp.asarray([[1.0, -2.5, 3.0]], jnp.bfloat16)
  scaled = base_two_queries(queries, 0.125)
  assert scaled.dtype == jnp.float32
  np.testing.assert_array_equal(
    np.asarray(scaled), np.asarray([[1.0, -2.5, 3.0]], np.float32) * np.float32(0.125 * LOG2_E)
  )


@hypothesis.settings(deadline=None, max_examples=40)
@hypothesis.given(
  seed=st.integers(0, 2**31 - 1),
  tokens=st.integers(1, 300),
  spread=st.floats(0.1, 60.0),
  offset=st.floats(-80.0, 80.0),
)
def test_base_two_state_gives_the_natural_log_sum_exp(seed, tokens, spread, offset):
  """Scores scaled by log2(e), a base-2 max and sum of exp2: the log-sum-exp written in natural
  units is that of the natural scores, over spreads that underflow most terms."""
  rng = np.random.default_rng(seed)
  scores = offset + spread * rng.standard_normal((3, tokens))  # natural logits, float64
  base_two = jnp.asarray(scores * LOG2_E, jnp.float32)
  running_max = base_two.max(axis=-1)
  running_sum = jnp.exp2(base_two - running_max[:, None]).sum(axis=-1)
  lse = np.asarray(natural_log_sum_exp(running_max, running_sum), np.float64)
  expected = np.logaddexp.reduce(scores, axis=-1)
  # f32 scores: relative rounding of the logits, plus the sum's.
  np.testing.assert_allclose(lse, expected, rtol=0, atol=2e-6 * (abs(offset) + 4 * spread) + 1e-5)


def test_an_exact_case():
  """Two equal base-2 scores of 3: lse = (3 + log2 2) ln 2 = 4 ln 2."""
  lse = natural_log_sum_exp(jnp.float32(3.0), jnp.float32(2.0))
  np.testing.assert_allclose(float(lse), 4 * math.log(2.0), rtol=1e-7)
