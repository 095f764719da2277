"""q . k_min per key group (`key_bias`), which the folded kernels take instead of k_min: against a
float64 sum, at full f32 precision, with NaN minimums kept to their own group, each way XLA may
compute it (`KEY_PRODUCTS`). The kernels with it are checked against the reference in
test_quantized_kernels.py and test_quantized_decode_attention_folded_mosaic_gpu.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.key_bias import KEY_PRODUCTS, key_bias, query_group_products


@settings(max_examples=20, deadline=None)
@given(
  rows=st.sampled_from([1, 4, 8]),
  head_dim=st.sampled_from([64, 128]),
  groups=st.integers(1, 9),
  seed=st.integers(0, 2**31 - 1),
  key_products=st.sampled_from(KEY_PRODUCTS),
)
def test_key_bias_is_the_float64_dot_per_group(rows, head_dim, groups, seed, key_products):
  rng = np.random.default_rng(seed)
  queries = rng.standard_normal((2, 3, rows, head_dim)).astype(np.float32)
  k_min = jnp.asarray(rng.standard_normal((2, 3, groups, head_dim)), jnp.bfloat16)
  bias = key_bias(jnp.asarray(queries), k_min, key_products=key_products)
  assert bias.shape == (2, 3, groups, rows) and bias.dtype == jnp.float32
  expected = np.einsum("bhrd,bhgd->bhgr", queries.astype(np.float64), np.asarray(k_min, np.float64))
  # f32 products and sums of 64-128 terms: far tighter than a TF32 or bf16 product would be.
  np.testing.assert_allclose(np.asarray(bias), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("key_products", KEY_PRODUCTS)
def test_nan_minimums_stay_in_their_group(key_products):
  """Minimums past a row's length may be NaN; only their own group's bias may be."""
  queries = jnp.ones((1, 1, 4, 64), jnp.float32)
  k_min = jnp.ones((1, 1, 5, 64), jnp.bfloat16).at[0, 0, 3:].set(jnp.nan)
  bias = np.asarray(key_bias(queries, k_min, key_products=key_products))[0, 0]
  np.testing.assert_array_equal(bias[:3], 64.0)
  assert np.isnan(bias[3:]).all()


@pytest.mark.parametrize("key_products", KEY_PRODUCTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_queries_are_not_rounded_below_f32(dtype, key_products):
  """Queries of 1 + 2^-20 against minimums of 1: bf16 or TF32 queries (8 or 11 significant bits)
  would round to 1 and give exactly 128."""
  queries = jnp.full((1, 1, 1, 128), 1.0 + 2.0**-20, jnp.float32)
  k_min = jnp.ones((1, 1, 1, 128), dtype)
  bias = float(key_bias(queries, k_min, key_products=key_products)[0, 0, 0, 0])
  assert bias > 128.0 + 2.0**-15
  assert bias == pytest.approx(128 * (1.0 + 2.0**-20), rel=2e-6)


def test_both_products_agree_to_f32_rounding():
  """The same products, summed in different orders: equal to a few f32 ulps of their magnitude,
  rows and groups in the same places."""
  rng = np.random.default_rng(5)
  queries = jnp.asarray(rng.standard_normal((2, 2, 8, 128)), jnp.float32)
  statistic = jnp.asarray(rng.standard_normal((2, 2, 7, 128)), jnp.bfloat16)
  einsum, reduction = (
    np.asarray(query_group_products(queries, statistic, key_products=way)) for way in KEY_PRODUCTS
  )
  np.testing.assert_allclose(reduction, einsum, rtol=0, atol=1e-4)


def test_an_unknown_key_product_is_named():
  queries, k_min = jnp.ones((1, 1, 1, 64)), jnp.ones((1, 1, 1, 64))
  with pytest.raises(ValueError, match=r"key_products='matmul' is not supported; allowed: \("):
    key_bias(queries, k_min, key_products="matmul")
