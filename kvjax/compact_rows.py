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


def zero_past_lengths(
  x: jax.Array,  # [batch, heads, tokens, ...]
  lengths: jax.Array,  # int32 [batch]
) -> jax.Array:
  """Zeroes the slots past each row's length, so padding never leaks into stored data."""
  valid = jnp.arange(x.shape[2])[None, :] < lengths[:, None]
  valid = valid.reshape(valid.shape[0], 1, valid.shape[1], *([1] * (x.ndim - 3)))
  return jnp.where(valid, x, jnp.zeros((), x.dtype))
