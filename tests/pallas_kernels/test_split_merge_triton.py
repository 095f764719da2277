"""The split-merge kernel against its jnp reference (XLA's merge and value-slot pick).

Interpret mode on CPU (compiled with KVJAX_NATIVE_KERNELS=1 on a GPU machine), where the
kernel's outputs start as NaN, so an element it does not write fails the check."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import own_slot_partials
from pallas_kernels import split_merge_triton as merge
from pallas_kernels.value_row_order import channel_rows
from pallas_kernels.word_operand_order import word_order_channels
from tests.pallas_kernels.kernel_checks import triton_interpret

pytestmark = pytest.mark.filterwarnings(
  "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)


def _partials(rng, batch, heads, splits, head_dim, rows):
  """Normalised partial outputs and log-sum-exps spread over a few units, with empty splits
  (lse -inf, output 0, as the kernels write them): one whole row of one head empty, and one
  split of another."""
  out = rng.standard_normal((batch, heads, splits, head_dim, rows)).astype(np.float32)
  lse = (3 * rng.standard_normal((batch, heads, splits, rows))).astype(np.float32)
  lse[0, 0, :, 0] = -np.inf
  out[0, 0, :, :, 0] = 0.0
  if splits > 1:
    lse[-1, -1, 1] = -np.inf
    out[-1, -1, 1] = 0.0
  return out, lse


def _both(out, lse, *, group, group_size, real_rows, bits, order=None):
  order = order or ("channel" if bits is None else "word")
  positions = channel_rows(order, out.shape[3], bits)
  reference = merge.merge_value_slot_partials_reference(
    jnp.asarray(out),
    jnp.asarray(lse),
    group=group,
    group_size=group_size,
    real_rows=real_rows,
    positions=positions,
  )
  kernel = merge.merge_value_slot_partials_triton(
    jnp.asarray(out),
    jnp.asarray(lse),
    group=group,
    group_size=group_size,
    real_rows=real_rows,
    value_order=order,
    bits=bits,
    interpret=triton_interpret(),
  )
  return [np.asarray(x) for x in reference], [np.asarray(x) for x in kernel]


@pytest.mark.parametrize(
  "splits,head_dim,rows,real_rows,group,group_size,bits",
  [
    (32, 128, 8, 4, 4, 32, None),  # the shapes of record, register value codes (channel order)
    (32, 128, 8, 4, 4, 32, 2),  # ... and the word order of the v34 default
    (24, 128, 8, 4, 3, 32, 4),  # a split count that is not a power of two, 3 of 4 rows
    (1, 64, 8, 1, 1, 16, None),  # one split, one query head in 8 slots
    (5, 64, 16, 8, 8, 64, 4),  # a tile of two slots of 8 rows, word order at head_dim 64
    (3, 128, 8, 8, 5, 128, None),  # one slot, a single value group
    (70, 128, 8, 4, 4, 32, 2),  # three steps of 32 splits, the last partly empty
  ],
)
def test_kernel_matches_xlas_merge_and_pick(
  splits, head_dim, rows, real_rows, group, group_size, bits
):
  out, lse = _partials(np.random.default_rng(splits + head_dim), 2, 3, splits, head_dim, rows)
  if splits > merge.SPLITS_PER_STEP:
    # one head's largest log-sum-exp in the last step, another's in the first, far above the
    # rest: the reference point of the exponentials must be the max over every step
    lse[1, 2, -1] += 10.0
    lse[0, 1, 0] += 120.0
  (ref_out, ref_lse), (got_out, got_lse) = _both(
    out, lse, group=group, group_size=group_size, real_rows=real_rows, bits=bits
  )
  assert got_out.shape == ref_out.shape == (2, 3, group, head_dim)
  assert got_lse.shape == ref_lse.shape == (2, 3, group)
  assert np.all(np.isfinite(got_out)), "unwritten or non-finite output"
  np.testing.assert_allclose(got_out, ref_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))
  np.testing.assert_allclose(got_lse, ref_lse, rtol=1e-6, atol=1e-6)
  # the empty row: output 0 and lse -inf exactly
  assert np.isneginf(got_lse[0, 0, 0]) and np.all(got_out[0, 0, 0] == 0.0)


@pytest.mark.parametrize("head_dim,bits", [(128, 2), (128, 4), (64, 2)])
def test_kernel_reads_each_channel_at_its_matrix_load_row(head_dim, bits):
  """Partials in the matrix loads' row order (`value_operand_matrix_loads`): both merges read
  channel c at row `row_of_channel(c)`, and agree with merging the partials put back in channel
  order first."""
  out, lse = _partials(np.random.default_rng(head_dim + bits), 2, 3, 7, head_dim, 8)
  settings = dict(group=4, group_size=32, real_rows=4, bits=bits)
  (ref_out, ref_lse), (got_out, got_lse) = _both(out, lse, order="matrix", **settings)
  rows = channel_rows("matrix", head_dim, bits)
  assert sorted(rows) == list(range(head_dim)) and np.any(rows != np.arange(head_dim))
  (channel_out, channel_lse), _ = _both(out[:, :, :, rows], lse, **{**settings, "bits": None})
  np.testing.assert_allclose(ref_out, channel_out, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(got_out, channel_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got_lse, ref_lse)
  np.testing.assert_array_equal(ref_lse, channel_lse)


@pytest.mark.parametrize(
  "splits,head_dim,rows,real_rows,group,group_size,bits",
  [
    (32, 128, 8, 4, 4, 32, None),  # the shapes of record, channel order
    (24, 128, 8, 4, 3, 32, 2),  # the word order, 3 of 4 rows
    (3, 64, 8, 1, 1, 16, 4),  # one query head in 8 slots, word order at head_dim 64
    (70, 128, 8, 8, 5, 128, None),  # one slot; three steps of 32 splits
  ],
)
def test_own_slot_partials_merge_to_the_every_slot_merge(
  splits, head_dim, rows, real_rows, group, group_size, bits
):
  """Partials holding each channel's own slot alone, [B, H, S, real_rows, D]
  (`own_slot_partials`, what the folded kernel writes with partial_slots="own"), merged by
  either merge, give the every-slot partials' merge: every other column ignored, each channel
  read at its position."""
  out, lse = _partials(np.random.default_rng(splits), 2, 3, splits, head_dim, rows)
  channels = np.arange(head_dim) if bits is None else word_order_channels(head_dim, bits)
  first_columns = own_slot_partials.slot_first_column(
    channels, group_size, real_rows, rows // real_rows
  )
  own = np.asarray(own_slot_partials.own_slot_columns(jnp.asarray(out), first_columns, real_rows))
  (ref_out, ref_lse), _ = _both(
    out, lse, group=group, group_size=group_size, real_rows=real_rows, bits=bits
  )
  positions = None if bits is None else np.argsort(word_order_channels(head_dim, bits))
  settings = dict(group=group, group_size=group_size, real_rows=real_rows, own_slot=True)
  merged = [
    merge.merge_value_slot_partials_reference(
      jnp.asarray(own), jnp.asarray(lse), positions=positions, **settings
    ),
    merge.merge_value_slot_partials_triton(
      jnp.asarray(own),
      jnp.asarray(lse),
      value_order="channel" if bits is None else "word",
      bits=bits,
      interpret=triton_interpret(),
      **settings,
    ),
  ]
  for got_out, got_lse in merged:
    assert got_out.shape == ref_out.shape and got_lse.shape == ref_lse.shape
    assert np.all(np.isfinite(np.asarray(got_out))), "unwritten or non-finite output"
    np.testing.assert_allclose(np.asarray(got_out), ref_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_lse), ref_lse, rtol=1e-6, atol=1e-6)


def test_each_channel_reads_its_own_slot_at_its_own_position():
  """A partial that is nonzero at one (position, column) only reaches the one (row, channel)
  whose slot and operand position those are, so a wrong slot or position cannot cancel out."""
  splits, head_dim, rows, real_rows, group_size, bits = 2, 128, 8, 4, 32, 2
  out = np.zeros((1, 1, splits, head_dim, rows), np.float32)
  lse = np.zeros((1, 1, splits, rows), np.float32)
  position = np.argsort(word_order_channels(head_dim, bits))
  channel, row = 77, 2
  slot = channel // group_size % (rows // real_rows)
  out[0, 0, :, position[channel], slot * real_rows + row] = 1.0
  (ref_out, _), (got_out, _) = _both(
    out, lse, group=4, group_size=group_size, real_rows=real_rows, bits=bits
  )
  expected = np.zeros_like(ref_out)
  expected[0, 0, row, channel] = 1.0
  np.testing.assert_allclose(ref_out, expected, atol=1e-7)
  np.testing.assert_allclose(got_out, expected, atol=1e-7)


def test_nan_in_a_split_makes_its_row_nan():
  """NaN never passes as a number: a NaN log-sum-exp makes its row's merge NaN, as XLA's does."""
  out, lse = _partials(np.random.default_rng(1), 1, 2, 4, 64, 8)
  lse[0, 1, 2, 3] = np.nan
  (ref_out, ref_lse), (got_out, got_lse) = _both(
    out, lse, group=4, group_size=32, real_rows=4, bits=None
  )
  for merged, total in ((ref_out, ref_lse), (got_out, got_lse)):
    assert np.isnan(total[0, 1, 3]) and np.all(np.isnan(merged[0, 1, 3]))
    assert not np.any(np.isnan(np.delete(total.reshape(-1), 4 + 3)))


def test_head_dim_not_a_multiple_of_a_programs_channels_is_refused():
  out = jnp.zeros((1, 1, 2, 48, 8), jnp.float32)
  lse = jnp.zeros((1, 1, 2, 8), jnp.float32)
  with pytest.raises(ValueError, match=r"head_dim=48 is not supported .* multiples of 32"):
    merge.merge_value_slot_partials_triton(out, lse, group=4, group_size=16, real_rows=4)


def test_a_bad_split_merge_is_named():
  with pytest.raises(ValueError, match=r"split_merge='kernel' is not supported; allowed: \("):
    merge.check_split_merge("kernel")
