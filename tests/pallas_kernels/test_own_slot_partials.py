"""The own-slot partials' helpers (`own_slot_partials`): the bad setting named, each channel's
slot's first column, and the jnp reference of the kernel's pick against the merge's own pick
(`pick_value_slots`). The kernel's pick itself is checked against this reference in
test_quantized_decode_attention_folded_mosaic_gpu.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import own_slot_partials
from pallas_kernels.split_merge_triton import pick_value_slots


def test_a_bad_partial_slots_is_named():
  with pytest.raises(ValueError, match=r"partial_slots='both' is not supported; allowed: \("):
    own_slot_partials.check_partial_slots("both")
  for value in own_slot_partials.PARTIAL_SLOTS:
    own_slot_partials.check_partial_slots(value)


def test_each_channels_slot_starts_at_its_groups_slot():
  channels = np.arange(128)
  first = own_slot_partials.slot_first_column(channels, 32, 4, 2)
  np.testing.assert_array_equal(first, np.repeat([0, 4, 0, 4], 32))
  first = own_slot_partials.slot_first_column(channels, 16, 1, 8)
  np.testing.assert_array_equal(first, np.arange(8).repeat(16))
  assert not own_slot_partials.slot_first_column(channels, 128, 8, 1).any()


@pytest.mark.parametrize("real_rows,group_size", [(4, 32), (1, 16), (2, 64), (8, 32)])
def test_the_reference_pick_is_the_merges_pick_transposed(real_rows, group_size):
  """Row j of channel c is column first(c) + j: what `pick_value_slots` takes for channel c,
  with the head dim last; with positions, the channel at each position decides the slot."""
  rows, head_dim = 8, 128
  out = jnp.asarray(np.random.default_rng(real_rows).standard_normal((2, 3, head_dim, rows)))
  first = own_slot_partials.slot_first_column(
    np.arange(head_dim), group_size, real_rows, rows // real_rows
  )
  own = own_slot_partials.own_slot_columns(out, first, real_rows)
  assert own.shape == (2, 3, real_rows, head_dim)
  picked = pick_value_slots(out, group_size, real_rows)
  np.testing.assert_array_equal(np.asarray(own), np.asarray(jnp.swapaxes(picked, -1, -2)))
  # partials in a permuted order: position p holds channel channels[p] and its slot's columns
  channels = np.random.default_rng(0).permutation(head_dim)
  permuted = own_slot_partials.own_slot_columns(
    out[..., channels, :],
    own_slot_partials.slot_first_column(channels, group_size, real_rows, rows // real_rows),
    real_rows,
  )
  np.testing.assert_array_equal(np.asarray(permuted), np.asarray(own)[..., channels])
