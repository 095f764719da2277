"""`own_group_rows`: each token's column taken from its own key group's block of rows."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.own_group_rows import own_group_rows


@pytest.mark.parametrize(
  "group_size,groups,first", [(32, 4, 0), (32, 4, 4), (64, 2, 1), (128, 1, 2)]
)
def test_each_token_takes_its_groups_rows(group_size, groups, first):
  rows, width = 3, groups * group_size
  blocks = first + groups + 1  # blocks outside [first, first + groups) must not be read
  products = np.random.default_rng(0).normal(size=(blocks * rows, width)).astype(np.float32)
  picked = np.asarray(own_group_rows(jnp.asarray(products), rows, group_size, first, groups))
  for t in range(width):
    block = first + t // group_size
    np.testing.assert_array_equal(picked[:, t], products[block * rows : (block + 1) * rows, t])
