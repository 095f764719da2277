import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.quantization.outliers import (
  extract_outliers,
  outlier_count_per_side,
  scatter_outliers,
)


@settings(max_examples=25, deadline=None)
@given(
  rows=st.sampled_from([1, 3]),
  elements=st.sampled_from([8, 33, 64]),
  fraction=st.sampled_from([0.02, 0.1, 0.3, 0.49]),
  ties=st.booleans(),
  seed=st.integers(0, 2**31 - 1),
)
def test_extraction_keeps_exactly_the_count_and_the_extreme_entries(
  rows, elements, fraction, ties, seed
):
  rng = np.random.default_rng(seed)
  x = rng.standard_t(df=3, size=(rows, elements)).astype(np.float32)
  if ties:  # few distinct values: ties between the ends and the rest
    x = np.round(x)
  per_side = outlier_count_per_side(fraction, elements)
  out = jax.jit(extract_outliers, static_argnums=1)(jnp.asarray(x), per_side)
  indices, values, mask = (np.asarray(a) for a in out)
  assert indices.shape == values.shape == (rows, 2 * per_side) and indices.dtype == np.uint16
  for row in range(rows):
    assert len(set(indices[row].tolist())) == 2 * per_side  # exactly the count, no repeats
    np.testing.assert_array_equal(values[row], x[row, indices[row]])
    np.testing.assert_array_equal(np.flatnonzero(mask[row]), np.sort(indices[row]))
    rest = x[row, ~mask[row]]
    largest, smallest = values[row, :per_side], values[row, per_side:]
    if rest.size:
      assert largest.min() >= rest.max() and smallest.max() <= rest.min()
    # The extracted entries are the largest magnitudes at each end: no remaining entry is
    # farther from the middle than an extracted one on its side.
    np.testing.assert_array_equal(np.sort(largest), np.sort(x[row])[::-1][:per_side][::-1])
    np.testing.assert_array_equal(np.sort(smallest), np.sort(x[row])[:per_side])


def test_scatter_is_the_dense_form_of_the_extraction():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 40)), jnp.float32)
  out = extract_outliers(x, 4)
  dense = scatter_outliers(out.indices, out.values, 40)
  np.testing.assert_array_equal(dense, jnp.where(out.mask, x, 0.0))


def test_count_rounding_is_half_up_with_at_least_one_per_side():
  assert outlier_count_per_side(0.02, 64 * 64) == 41  # 40.96
  assert outlier_count_per_side(0.02, 64 * 16) == 10  # 10.24
  assert outlier_count_per_side(0.25, 4) == 1  # 0.5 rounds up
  assert outlier_count_per_side(1e-6, 64) == 1
  assert outlier_count_per_side(0.0, 64) == 0


@pytest.mark.parametrize("fraction", [-0.1, 0.5, 1.0, False])
def test_fractions_outside_zero_to_half_are_rejected(fraction):
  with pytest.raises(ValueError, match=r"outliers=.* must be a fraction in \[0, 0.5\)"):
    outlier_count_per_side(fraction, 64)


@pytest.mark.parametrize("elements, dtype", [(1 << 16, np.uint16), ((1 << 16) + 1, np.int32)])
def test_indices_are_uint16_while_every_position_fits_and_int32_beyond(elements, dtype):
  # The extreme entries sit at the last positions, so a narrower dtype would wrap them around.
  x = np.zeros((1, elements), np.float32)
  x[0, -1], x[0, -2] = 5.0, -5.0
  indices, values, mask = extract_outliers(jnp.asarray(x), 1)
  assert indices.dtype == dtype
  np.testing.assert_array_equal(indices, [[elements - 1, elements - 2]])
  np.testing.assert_array_equal(values, [[5.0, -5.0]])
  dense = scatter_outliers(indices, values, elements)
  np.testing.assert_array_equal(dense, x)
