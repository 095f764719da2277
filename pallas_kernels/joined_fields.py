"""Joining bit fields in registers, and the channel orders that joining produces.

The planar packing (`bit_packing`) gives n = 32 // bits bit fields per word, field k holding
channels [k*W, (k+1)*W). A GPU kernel that unpacks the fields and reassembles them in natural
channel order needs a reshape that Triton implements as a layout conversion through shared
memory. Joining them with `stack(axis=-1)` instead only adds a per-thread minor dimension (a
register renaming); the price is a fixed channel permutation, applied to the queries (keys) or
undone on the small output (values). These functions compute both, on jnp or numpy arrays.
"""

import jax
import jax.numpy as jnp
import numpy as np


def join_fields(fields: list) -> jax.Array:
  """Joins n = 2^k tensors [..., W] into one [..., n*W] with a tree of `stack(axis=-1)` + merge.

  Each join adds a per-thread minor dimension in Triton, so this is a register renaming, not a
  layout conversion (unlike a reshape of a broadcast [R, n, W]). The resulting channel order is
  a fixed permutation (`joined_channel_order`), applied to the queries/outputs instead.
  Works on jnp and numpy arrays alike.
  """
  stack = jnp.stack if isinstance(fields[0], jax.Array) else np.stack
  while len(fields) > 1:
    fields = [
      stack([fields[2 * i], fields[2 * i + 1]], axis=-1).reshape(*fields[0].shape[:-1], -1)
      for i in range(len(fields) // 2)
    ]
  return fields[0]


def joined_channel_order(first_field: int, num_fields: int, width: int):
  """numpy int32 [num_fields * width]: channel at each position of `join_fields` over the bit
  fields first_field .. first_field + num_fields - 1 (field k holds channels [k*W, (k+1)*W))."""
  fields = [
    np.arange(k * width, (k + 1) * width, dtype=np.int32)[None, :]
    for k in range(first_field, first_field + num_fields)
  ]
  return join_fields(fields)[0]


def _value_group_orders(head_dim: int, bits: int, value_group: int) -> list:
  """Per value channel group, the channel order of its own bit fields joined."""
  fields = 32 // bits
  width = head_dim // fields
  per_group = value_group // width
  return [
    joined_channel_order(group * per_group, per_group, width)
    for group in range(head_dim // value_group)
  ]


def channel_orders(head_dim: int, bits: int, value_group: int):
  """(key order [D], value order [D]): keys join all fields; values join the fields of each
  channel group, groups side by side, so a group's channels are contiguous positions."""
  key_order = joined_channel_order(0, 32 // bits, head_dim * bits // 32)
  return key_order, np.concatenate(_value_group_orders(head_dim, bits, value_group))


def joined_value_order(head_dim: int, bits: int, group_size: int):
  """numpy int32 [D]: channel at each position of the "joined" variant's values (each channel
  group's bit fields joined, then the groups joined)."""
  orders = _value_group_orders(head_dim, bits, group_size)
  return join_fields([order[None, :] for order in orders])[0]
