"""Writing tokens per row at each row's own length (rows of a batch differ in length)."""

import jax
import jax.numpy as jnp


def write_token_at_lengths(
  stored: jax.Array,  # [batch, heads, capacity, ...]
  token: jax.Array,  # [batch, heads, ...]
  lengths: jax.Array,  # int32 [batch]: slot written in each row
) -> jax.Array:
  """`stored[b, :, lengths[b]] = token[b]` as one scatter (in place inside a scan carry),
  indexed on batch, head and slot so that its window is one trailing row: on a TPU, a window
  spanning the heads made XLA lay the cache out heads-minor and copy it into the attention
  kernel's layout at every decode step (KERNEL_NOTES v49)."""
  batch, heads = stored.shape[:2]
  batch_index = jnp.arange(batch)[:, None]
  head_index = jnp.arange(heads)[None, :]
  return stored.at[batch_index, head_index, lengths[:, None]].set(
    token.astype(stored.dtype), mode="drop"
  )


def write_tokens_at_lengths(
  stored: jax.Array,  # [batch, heads, capacity, ...]
  tokens: jax.Array,  # [batch, heads, chunk, ...]
  slots: jax.Array,  # int32 [batch, chunk]: slot of each token; >= capacity drops it
) -> jax.Array:
  """`stored[b, :, slots[b, j]] = tokens[b, :, j]` as one scatter (slots of a row distinct)."""
  batch, heads = stored.shape[:2]
  batch_index = jnp.arange(batch)[:, None, None]
  head_index = jnp.arange(heads)[None, :, None]
  return stored.at[batch_index, head_index, slots[:, None, :]].set(
    tokens.astype(stored.dtype), mode="drop"
  )


def slots_after_lengths(
  lengths: jax.Array,  # int32 [batch]: slots already used
  counts: jax.Array,  # int32 [batch]: tokens to write, the first `counts[b]` of the chunk
  chunk: int,
  capacity: int,
) -> jax.Array:  # int32 [batch, chunk]
  """Slots `lengths[b] + j` for the first `counts[b]` tokens; `capacity` (dropped) past them."""
  offsets = jnp.arange(chunk)[None, :]
  return jnp.where(offsets < counts[:, None], lengths[:, None] + offsets, capacity)


def held_then_chunk(
  stored: jax.Array,  # [batch, heads, capacity, ...]: a row's first `held[b]` slots are tokens
  new: jax.Array,  # [batch, heads, chunk, ...]
  held: jax.Array,  # int32 [batch]
  counts: jax.Array,  # int32 [batch]: the chunk's first `counts[b]` tokens are real
) -> jax.Array:  # [batch, heads, capacity + chunk, ...]
  """Each row's held tokens followed, without a gap, by its tokens of a prompt chunk: the
  candidates a cache that compresses as chunks arrive chooses from."""
  chunk = new.shape[2]
  slots = slots_after_lengths(held, counts, chunk, stored.shape[2] + chunk)
  padded = jnp.pad(stored, ((0, 0), (0, 0), (0, chunk)) + ((0, 0),) * (stored.ndim - 3))
  return write_tokens_at_lengths(padded, new, slots)


def cut_or_pad_to(array: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """`array` cut to, or padded with zeros at the end of each axis to, `shape` (a cache re-laid for
  another capacity: what is cut or added lies past every row's length); `array` itself where it
  has that shape already (restoring re-lays every cache, most of them as they are)."""
  array = array[tuple(slice(0, size) for size in shape)]
  padding = [(0, want - have) for have, want in zip(array.shape, shape)]
  return jnp.pad(array, padding) if any(after for _, after in padding) else array


def zero_past_lengths(
  x: jax.Array,  # [batch, heads, tokens, ...]
  lengths: jax.Array,  # int32 [batch]
) -> jax.Array:
  """Zeroes the slots past each row's length, so padding never leaks into stored data."""
  valid = jnp.arange(x.shape[2])[None, :] < lengths[:, None]
  valid = valid.reshape(valid.shape[0], 1, valid.shape[1], *([1] * (x.ndim - 3)))
  return jnp.where(valid, x, jnp.zeros((), x.dtype))


def write_blocks_by_row_slices(
  stored: jax.Array,  # [batch, heads, rows, ...]
  new: jax.Array,  # [batch, heads, given blocks * rows_per_block, ...]
  first_rows: jax.Array,  # int32 [batch]: the row each row's first block goes to
  num_blocks: jax.Array,  # int32 [batch]: blocks each row writes, its first ones
  rows_per_block: int,
  pin=None,
) -> jax.Array:
  """`stored[b, :, first_rows[b] + r] = new[b, :, r]` for `r < num_blocks[b] * rows_per_block`,
  as one dynamic update slice per (row, block) in a loop; a block that would end past the last
  row is dropped whole (a scatter with mode="drop" would write the rows of it that fit; the
  quantized segments this writes hold whole blocks, so none of theirs is partial). On a TPU,
  XLA keeps a layout pinned on the result of these (`jax.experimental.layout.
  with_layout_constraint`) through a decode loop; on the scatter it did not, and it copied the
  whole array at every step (KERNEL_NOTES v50). A loop of small writes costs a launch each on a
  GPU, so the scatter stays there.
  `pin(array)`: applied to the array before, inside and after the loop (a layout constraint:
  pinned after the loop only, XLA chose the loop's own layout for small blocks, two rows of 64
  tokens' key statistics, and copied between the two at every step)."""
  pin = (lambda array: array) if pin is None else pin
  batch, capacity = stored.shape[0], stored.shape[2]
  given = new.shape[2] // rows_per_block
  if capacity < rows_per_block or given == 0:
    return stored  # no block fits: the scatter would drop every one
  trailing = (0,) * (stored.ndim - 3)

  def write_one(step, stored):
    row, block = step // given, step % given
    first = first_rows[row] + block * rows_per_block
    written = (block < num_blocks[row]) & (first + rows_per_block <= capacity)
    # An unwritten block still goes through the update, at a start inside the array, with
    # the rows already there: static shapes, no branch.
    start = (row, 0, jnp.clip(first, 0, capacity - rows_per_block)) + trailing
    size = (1, stored.shape[1], rows_per_block) + stored.shape[3:]
    taken = jax.lax.dynamic_slice(new, (row, 0, block * rows_per_block) + trailing, size)
    held = jax.lax.dynamic_slice(stored, start, size)
    return pin(
      jax.lax.dynamic_update_slice(
        stored, jnp.where(written, taken.astype(stored.dtype), held), start
      )
    )

  return pin(jax.lax.fori_loop(0, batch * given, write_one, pin(stored)))
