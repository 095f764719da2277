"""Which channel each row of the folded Mosaic GPU kernel's value output holds.

The value product's rows are the A operand's: in channel order for codes staged in channel order
or built in registers by byte permutes (`value_operand_registers`); in the "word" operand order
for codes staged in it (`word_operand_order`); in the matrix loads' order for codes built by
`ldmatrix.trans` (`value_operand_matrix_loads`). The kernel's epilogue takes each row's channel
(its scale and value group) from here, and the split merges read each channel at its row.
"""

import numpy as np

from pallas_kernels import value_operand_matrix_loads
from pallas_kernels.word_operand_order import channel_at_position, position_of_channel

VALUE_ROW_ORDERS = ("channel", "word", "matrix")
# (row -> channel, channel -> row) of each order but "channel", where both are the identity;
# each takes (index, head_dim, bits)
_MAPS = {
  "word": (channel_at_position, position_of_channel),
  "matrix": (value_operand_matrix_loads.channel_of_row, value_operand_matrix_loads.row_of_channel),
}


def check_value_row_order(order) -> None:
  """ValueError naming `value_order` and its allowed values."""
  if order not in VALUE_ROW_ORDERS:
    raise ValueError(f"value_order={order!r} is not supported; allowed: {VALUE_ROW_ORDERS}")


def channel_of_row(row, order: str, head_dim: int, bits: int | None):
  """The channel output row `row` holds (ints, numpy or jnp integers)."""
  check_value_row_order(order)
  return row if order == "channel" else _MAPS[order][0](row, head_dim, bits)


def row_of_channel(channel, order: str, head_dim: int, bits: int | None):
  """The output row holding `channel`: `channel_of_row`'s inverse (ints, numpy or jnp)."""
  check_value_row_order(order)
  return channel if order == "channel" else _MAPS[order][1](channel, head_dim, bits)


def channel_rows(order: str, head_dim: int, bits: int | None) -> np.ndarray | None:
  """int [head_dim]: the row of each channel (None in channel order, where it is the channel)."""
  check_value_row_order(order)
  if order == "channel":
    return None
  return np.asarray(row_of_channel(np.arange(head_dim), order, head_dim, bits))
