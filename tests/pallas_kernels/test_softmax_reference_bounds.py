"""The score bounds the key statistics give and the per-split softmax references built on them
(`softmax_reference_bounds`): bounds against every dequantized score and against the codes that
reach them, references against hand-worked splits. The folded Mosaic GPU kernel that reads the
references is checked against the jnp reference in
test_quantized_decode_attention_folded_mosaic_gpu.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.bit_packing import unpack_codes
from pallas_kernels.key_bias import KEY_PRODUCTS, key_bias
from pallas_kernels.random_inputs import random_quantized_segment
from pallas_kernels.softmax_reference_bounds import (
  EXCHANGE,
  HEADROOM,
  UNDERFLOW_MARGIN,
  key_score_bounds,
  split_softmax_references,
)


def _dequantized_scores(queries, k_codes, k_scale, k_min, *, bits, group_size):
  """float64 [B, H, T, rows]: q . k for every token (the cache's own dequantization)."""
  codes = np.asarray(unpack_codes(k_codes, bits), np.float64)
  scale = np.repeat(np.asarray(k_scale, np.float64), group_size, axis=2)
  minimum = np.repeat(np.asarray(k_min, np.float64), group_size, axis=2)
  return np.einsum("bhrd,bhtd->bhtr", np.asarray(queries, np.float64), codes * scale + minimum)


@settings(max_examples=15, deadline=None)
@given(
  bits=st.sampled_from([2, 4]),
  head_dim=st.sampled_from([64, 128]),
  group_size=st.sampled_from([16, 32]),
  rows=st.sampled_from([1, 4, 8]),
  seed=st.integers(0, 2**31 - 1),
  key_products=st.sampled_from(KEY_PRODUCTS),
)
def test_every_score_lies_within_its_groups_bounds(
  bits, head_dim, group_size, rows, seed, key_products
):
  rng = np.random.default_rng(seed)
  tokens = 4 * group_size
  segment = random_quantized_segment(
    rng, 2, 2, tokens, head_dim, bits=bits, group_size=group_size, dtype=jnp.bfloat16
  )
  queries = jnp.asarray(rng.standard_normal((2, 2, rows, head_dim)), jnp.float32)
  lower, upper = key_score_bounds(
    queries,
    segment.k_scale,
    key_bias(queries, segment.k_min, key_products=key_products),
    bits=bits,
    key_products=key_products,
  )
  assert lower.shape == upper.shape == (2, 2, tokens // group_size, rows)
  scores = _dequantized_scores(
    queries, segment.k_codes, segment.k_scale, segment.k_min, bits=bits, group_size=group_size
  ).reshape(2, 2, tokens // group_size, group_size, rows)
  # f32 sums of 64-128 products: a relative slack far below any score's spread.
  slack = 1e-5 * (np.asarray(upper) - np.asarray(lower)) + 1e-5
  assert (scores.max(axis=3) <= np.asarray(upper) + slack).all()
  assert (scores.min(axis=3) >= np.asarray(lower) - slack).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_bounds_are_reached_by_the_extreme_codes(bits):
  """The codes 2^bits - 1 where q > 0 and 0 where q < 0 score the upper bound exactly, the
  reverse the lower: the bounds are the tightest the statistics allow, not just bounds."""
  rng = np.random.default_rng(bits)
  head_dim = 64
  queries = rng.standard_normal((1, 1, 1, head_dim)).astype(np.float32)
  k_scale = jnp.asarray(rng.uniform(0.1, 2.0, (1, 1, 1, head_dim)), jnp.bfloat16)
  k_min = jnp.asarray(rng.standard_normal((1, 1, 1, head_dim)), jnp.bfloat16)
  lower, upper = key_score_bounds(
    jnp.asarray(queries), k_scale, key_bias(jnp.asarray(queries), k_min), bits=bits
  )
  top = (2**bits - 1) * (queries[0, 0, 0] > 0)
  for codes, bound in ((top, upper), ((2**bits - 1) - top, lower)):
    key = codes * np.asarray(k_scale, np.float64)[0, 0, 0] + np.asarray(k_min, np.float64)[0, 0, 0]
    score = float(queries[0, 0, 0].astype(np.float64) @ key)
    assert float(bound[0, 0, 0, 0]) == pytest.approx(score, rel=1e-5)


def _bounds(lower_per_group, upper_per_group):
  """f32 [1, 1, G, 1] lower and upper bounds from per-group lists."""
  as_array = lambda values: jnp.asarray(values, jnp.float32)[None, None, :, None]
  return as_array(lower_per_group), as_array(upper_per_group)


def test_reference_is_the_splits_upper_bound_less_the_headroom():
  """Four groups of 32 tokens, splits of 64 tokens: each split's largest upper bound, minus the
  headroom; a split's spread is its largest upper bound less its largest lower bound."""
  limit = HEADROOM + UNDERFLOW_MARGIN
  lower, upper = _bounds([0.0, 5.0, -10.0, 0.0], [30.0, 20.0, limit - 10.0, limit + 0.5])
  references = split_softmax_references(
    lower, upper, jnp.asarray([128]), group_size=32, split_tokens=64, num_splits=2
  )
  # split 0: spread 30 - 5; split 1: max upper limit + 0.5, max lower 0 -> spread > limit
  np.testing.assert_array_equal(np.asarray(references)[0, 0, :, 0], [30.0 - HEADROOM, EXCHANGE])
  # the spread exactly at the limit is still served
  lower, upper = _bounds([0.0, 0.0], [limit, 1.0])
  references = split_softmax_references(
    lower, upper, jnp.asarray([64]), group_size=32, split_tokens=64, num_splits=1
  )
  assert float(references[0, 0, 0, 0]) == limit - HEADROOM


def test_groups_past_the_length_are_left_out_and_nan_within_it_is_not():
  """A group starting at or past the row's length is ignored (NaN statistics there are the
  cache's poison); a NaN bound of a valid group, and a split with no valid group, take the
  exact path."""
  lower, upper = _bounds([0.0, np.nan, 1.0, 1.0], [10.0, np.nan, 12.0, 12.0])
  references = split_softmax_references(
    lower, upper, jnp.asarray([32]), group_size=32, split_tokens=64, num_splits=2
  )
  # length 32: group 0 alone is valid; split 1 is empty
  np.testing.assert_array_equal(np.asarray(references)[0, 0, :, 0], [10.0 - HEADROOM, EXCHANGE])
  references = split_softmax_references(
    lower, upper, jnp.asarray([33]), group_size=32, split_tokens=64, num_splits=2
  )
  np.testing.assert_array_equal(np.asarray(references)[0, 0, :, 0], [EXCHANGE, EXCHANGE])


def test_one_row_the_bounds_cannot_serve_sends_its_whole_split_to_the_exact_path():
  """The rows of a program share one loop: if any row's spread is too wide, every row of that
  split gets EXCHANGE; other splits keep their references. Infinite bounds too."""
  lower = jnp.zeros((1, 1, 3, 2), jnp.float32)
  upper = jnp.asarray([[[[10.0, 10.0], [10.0, 500.0], [10.0, np.inf]]]], jnp.float32)
  references = split_softmax_references(
    lower, upper, jnp.asarray([96]), group_size=32, split_tokens=32, num_splits=3
  )
  np.testing.assert_array_equal(
    np.asarray(references)[0, 0],
    [[10.0 - HEADROOM] * 2, [EXCHANGE] * 2, [EXCHANGE] * 2],
  )


def test_splits_past_the_groups_are_padded_not_refused():
  """The plan's splits may cover more tokens than the capacity (whole blocks): the last split's
  missing groups count as past the length."""
  lower, upper = _bounds([0.0, 0.0, 0.0], [1.0, 2.0, 3.0])
  references = split_softmax_references(
    lower, upper, jnp.asarray([96]), group_size=32, split_tokens=64, num_splits=2
  )
  np.testing.assert_array_equal(
    np.asarray(references)[0, 0, :, 0], [2.0 - HEADROOM, 3.0 - HEADROOM]
  )


def test_split_tokens_must_be_whole_groups():
  lower, upper = _bounds([0.0], [1.0])
  with pytest.raises(ValueError, match="split_tokens=48 must be a multiple of group_size=32"):
    split_softmax_references(
      lower, upper, jnp.asarray([32]), group_size=32, split_tokens=48, num_splits=1
    )
