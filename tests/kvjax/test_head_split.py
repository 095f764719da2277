import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.head_split import join_head_partials, join_heads, split_heads


@pytest.mark.parametrize("first", [(0, 3), (1,), (), (0, 1, 2, 3), (3, 1)])
def test_split_then_join_gives_the_heads_back_in_order(first):
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, 5, 3)), jnp.float32)
  second = tuple(h for h in range(4) if h not in first)
  first_part, second_part = split_heads(x, first, second)
  assert (first_part is None) == (not first) and (second_part is None) == (not second)
  if first:
    np.testing.assert_array_equal(first_part, np.asarray(x)[:, list(first)])
  np.testing.assert_array_equal(join_heads(first_part, second_part, first, second), x)


def test_partials_join_each_of_out_and_lse():
  out = jnp.arange(2 * 3 * 2 * 4, dtype=jnp.float32).reshape(2, 3, 2, 4)
  lse = jnp.arange(2 * 3 * 2, dtype=jnp.float32).reshape(2, 3, 2)
  first, second = (2,), (0, 1)
  parts = [(out[:, list(heads)], lse[:, list(heads)]) for heads in (first, second)]
  got_out, got_lse = join_head_partials(*parts, first, second)
  np.testing.assert_array_equal(got_out, out)
  np.testing.assert_array_equal(got_lse, lse)
  only_first = join_head_partials((out, lse), None, (0, 1, 2), ())
  np.testing.assert_array_equal(only_first[0], out)
