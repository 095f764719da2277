"""`bfloat16_halves.product_by_halves`: a float32 operand times a bfloat16-exact one, exact to
2^-16 of each term (one bfloat16 pass would be off by up to 2^-9), either contracting axis."""

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np

from pallas_kernels.bfloat16_halves import product_by_halves


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(
  seed=st.integers(0, 2**16),
  rows=st.integers(1, 9),
  inner=st.integers(1, 40),
  columns=st.integers(1, 17),
  contract_first=st.booleans(),
  one_hot=st.booleans(),
)
def test_the_product_is_exact_to_two_to_the_minus_sixteen(
  seed, rows, inner, columns, contract_first, one_hot
):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(rows, inner)).astype(np.float32)
  if one_hot:  # a 0/1 spread: one nonzero term per output
    b = (rng.integers(0, inner, columns)[None, :] == np.arange(inner)[:, None]).astype(np.float32)
  else:  # values stored in bfloat16
    b = np.asarray(jnp.asarray(rng.normal(size=(inner, columns)), jnp.bfloat16), np.float32)
  operand = b if contract_first else b.T
  out = product_by_halves(
    jnp.asarray(a), jnp.asarray(operand, jnp.bfloat16), (0 if contract_first else 1,)
  )
  exact = a.astype(np.float64) @ b.astype(np.float64)
  bound = 2.0**-16 * (np.abs(a).astype(np.float64) @ np.abs(b)) + 1e-30
  bound += 2.0**-23 * inner * (np.abs(a).astype(np.float64) @ np.abs(b))  # the f32 sums
  assert out.shape == (rows, columns) and out.dtype == jnp.float32
  assert np.all(np.abs(np.asarray(out, np.float64) - exact) <= bound)
  if one_hot:  # exact where a has at most 16 significant bits
    a16 = np.asarray(jnp.asarray(jnp.asarray(a, jnp.bfloat16), jnp.float32))
    a16 = a16 + np.asarray(jnp.asarray(jnp.asarray(a - a16, jnp.bfloat16), jnp.float32))
    halves = product_by_halves(
      jnp.asarray(a16), jnp.asarray(operand), (0 if contract_first else 1,)
    )
    np.testing.assert_array_equal(np.asarray(halves), a16 @ b)


def test_one_bfloat16_pass_would_not_be_that_exact():
  """The bound above is not loose: the high half alone misses it."""
  a = np.float32(1.0 + 2.0**-12)[None, None]
  out = product_by_halves(jnp.asarray(a), jnp.ones((1, 1), jnp.bfloat16), (0,))
  assert float(out[0, 0]) == float(a[0, 0])
  assert float(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)[0, 0]) != float(a[0, 0])
