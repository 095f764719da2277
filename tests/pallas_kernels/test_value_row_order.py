"""Which channel each row of the folded kernel's value output holds (`value_row_order`): each
order's map and inverse agree, and the split merge refuses an order it cannot place."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import value_row_order
from pallas_kernels.split_merge_triton import merge_value_slot_partials_triton


@pytest.mark.parametrize("order", value_row_order.VALUE_ROW_ORDERS)
@pytest.mark.parametrize("head_dim,bits", [(128, 2), (128, 4), (64, 4)])
def test_each_channels_row_holds_that_channel(order, head_dim, bits):
  rows = value_row_order.channel_rows(order, head_dim, bits)
  if order == "channel":
    assert rows is None
    return
  assert sorted(rows) == list(range(head_dim))
  np.testing.assert_array_equal(
    value_row_order.channel_of_row(rows, order, head_dim, bits), np.arange(head_dim)
  )
  # jnp integers (what the kernel's epilogue and the Triton merge compute on) give the same
  np.testing.assert_array_equal(
    np.asarray(value_row_order.row_of_channel(jnp.arange(head_dim), order, head_dim, bits)), rows
  )


def test_the_orders_differ():
  word, matrix = (value_row_order.channel_rows(order, 128, 2) for order in ("word", "matrix"))
  assert np.any(word != matrix)


def test_a_bad_order_is_named():
  for function in (
    value_row_order.channel_rows,
    lambda *args: value_row_order.channel_of_row(0, *args),
    lambda *args: value_row_order.row_of_channel(0, *args),
  ):
    with pytest.raises(ValueError, match=r"value_order='rows' is not supported; allowed: \("):
      function("rows", 128, 2)
  partials = jnp.zeros((1, 1, 2, 128, 8)), jnp.zeros((1, 1, 2, 8))
  with pytest.raises(ValueError, match=r"value_order='rows' is not supported"):
    merge_value_slot_partials_triton(
      *partials, group=4, group_size=32, real_rows=4, value_order="rows"
    )
  with pytest.raises(ValueError, match=r"value_order='matrix' needs bits"):
    merge_value_slot_partials_triton(
      *partials, group=4, group_size=32, real_rows=4, value_order="matrix"
    )
