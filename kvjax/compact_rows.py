"""Writing one token per row at each row's own length (rows of a batch differ in length)."""

import jax
import jax.numpy as jnp


def write_token_at_lengths(
  stored: jax.Array,  # [batch, heads, capacity, ...]
  token: jax.Array,  # [batch, heads, ...]
  lengths: jax.Array,  # int32 [batch]: slot written in each row
) -> jax.Array:
  """`stored[b, :, lengths[b]] = token[b]` as one scatter (in place inside a scan carry)."""
  batch_index = jnp.arange(stored.shape[0])
  return stored.at[batch_index, :, lengths].set(token.astype(stored.dtype), mode="drop")


def zero_past_lengths(
  x: jax.Array,  # [batch, heads, tokens, ...]
  lengths: jax.Array,  # int32 [batch]
) -> jax.Array:
  """Zeroes the slots past each row's length, so padding never leaks into stored data."""
  valid = jnp.arange(x.shape[2])[None, :] < lengths[:, None]
  valid = valid.reshape(valid.shape[0], 1, valid.shape[1], *([1] * (x.ndim - 3)))
  return jnp.where(valid, x, jnp.zeros((), x.dtype))
