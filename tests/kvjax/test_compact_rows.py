import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.compact_rows import cut_or_pad_to, write_blocks_by_row_slices, write_token_at_lengths


def _scattered(stored, new, first_rows, num_blocks, rows_per_block):
  """What the per-row slices write, with numpy: the scatter they replace on a TPU
  (`kivi_cache._write_blocks`) for rows past a row's blocks (not written), except that a block
  ending past the last row is dropped whole (the scatter would write its rows that fit; the
  cache's segments hold whole blocks: `test_kivi_cache` compares the two paths there)."""
  out = np.array(stored)
  capacity = stored.shape[2]
  for row in range(stored.shape[0]):
    for block in range(int(num_blocks[row])):
      first = int(first_rows[row]) + block * rows_per_block
      if first + rows_per_block > capacity or block * rows_per_block >= new.shape[2]:
        continue
      taken = new[row, :, block * rows_per_block : (block + 1) * rows_per_block]
      out[row, :, first : first + rows_per_block] = taken
  return out


_write_jitted = jax.jit(write_blocks_by_row_slices, static_argnames="rows_per_block")


@settings(max_examples=25, deadline=None)
@given(
  rows_per_block=st.sampled_from([1, 2, 4]),
  given_blocks=st.integers(1, 3),
  capacity_blocks=st.integers(1, 4),
  data=st.data(),
)
def test_row_slices_write_what_the_scatter_writes(
  rows_per_block, given_blocks, capacity_blocks, data
):
  batch, heads, trailing = 3, 2, 5
  capacity = capacity_blocks * rows_per_block + data.draw(st.integers(0, rows_per_block - 1))
  first_rows = np.array(
    [data.draw(st.integers(0, capacity_blocks)) * rows_per_block for _ in range(batch)],
    np.int32,
  )
  num_blocks = np.array([data.draw(st.integers(0, given_blocks)) for _ in range(batch)], np.int32)
  key_stored, key_new = jax.random.split(jax.random.key(data.draw(st.integers(0, 2**16))))
  stored = jax.random.normal(key_stored, (batch, heads, capacity, trailing), jnp.float32)
  new = jax.random.normal(key_new, (batch, heads, given_blocks * rows_per_block, trailing))
  written = _write_jitted(
    stored, new, jnp.asarray(first_rows), jnp.asarray(num_blocks), rows_per_block=rows_per_block
  )
  expected = _scattered(np.asarray(stored), np.asarray(new), first_rows, num_blocks, rows_per_block)
  np.testing.assert_array_equal(np.asarray(written), expected)


def test_row_slices_keep_the_stored_dtype_and_a_too_small_array():
  stored = jnp.zeros((2, 1, 3, 4), jnp.uint32)
  new = jnp.full((2, 1, 4, 4), 7, jnp.int32)
  # A block of 4 rows fits nowhere in 3: nothing is written, as the scatter drops it.
  same = write_blocks_by_row_slices(stored, new, jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32), 4)
  assert same.dtype == jnp.uint32
  np.testing.assert_array_equal(np.asarray(same), 0)
  wide = jnp.zeros((2, 1, 8, 4), jnp.uint32)
  written = write_blocks_by_row_slices(
    wide, new, jnp.array([4, 0], jnp.int32), jnp.array([1, 0], jnp.int32), 4
  )
  assert written.dtype == jnp.uint32
  np.testing.assert_array_equal(np.asarray(written[0, :, 4:]), 7)
  np.testing.assert_array_equal(np.asarray(written[0, :, :4]), 0)
  np.testing.assert_array_equal(np.asarray(written[1]), 0)


def test_write_token_at_lengths_writes_each_rows_slot_and_drops_past_the_end():
  stored = jnp.zeros((3, 2, 4, 2))
  token = jnp.arange(12, dtype=jnp.float32).reshape(3, 2, 2) + 1
  written = write_token_at_lengths(stored, token, jnp.array([0, 3, 4], jnp.int32))
  np.testing.assert_array_equal(np.asarray(written[0, :, 0]), np.asarray(token[0]))
  np.testing.assert_array_equal(np.asarray(written[1, :, 3]), np.asarray(token[1]))
  np.testing.assert_array_equal(np.asarray(written[2]), 0)  # slot 4 of 4: dropped
  assert float(jnp.abs(written).sum()) == float(token[:2].sum())


def test_cut_or_pad_to_cuts_pads_with_zeros_and_keeps_an_array_of_that_shape():
  array = jnp.arange(24.0).reshape(2, 3, 4)
  cut = cut_or_pad_to(array, (2, 2, 4))
  np.testing.assert_array_equal(cut, array[:, :2])
  padded = cut_or_pad_to(array, (2, 5, 4))
  np.testing.assert_array_equal(padded[:, :3], array)
  assert not np.asarray(padded[:, 3:]).any()
  np.testing.assert_array_equal(cut_or_pad_to(array, (2, 2, 6))[..., :4], array[:, :2])
  assert cut_or_pad_to(array, (2, 3, 4)) is array  # nothing to cut or add: no copy
