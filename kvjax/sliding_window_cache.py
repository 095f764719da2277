"""Ring-buffer cache of a sliding-window model (Mistral): only the last `window` tokens exist.

Token at position p lives in slot `p % window`. Keys are stored rotated at their original
positions, and attention does not depend on slot order, so the ring needs no re-ordering.
"""

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import attention_dispatch
from kvjax.cache_protocol import KeyValueArrays, check_count
from kvjax.chunk_attention import masked_attention
from kvjax.compact_rows import write_token_at_lengths
from kvjax.kernel_settings import DEFAULT_KERNEL_SETTINGS, KernelSettings


def ring_source_positions(lengths: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
  """For each ring slot, the prompt position it holds after ingesting `lengths` tokens.

  Returns `(positions [batch, window], valid [batch, window])`: slot s holds the latest
  position p < length with p % window == s.
  """
  slots = jnp.arange(window)[None, :]
  last = lengths[:, None] - 1
  positions = last - jnp.mod(last - slots, window)
  return jnp.maximum(positions, 0), positions >= 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlidingWindowLayerCache(KeyValueArrays):
  keys: jax.Array  # [batch, kv_heads, window, head_dim]
  values: jax.Array  # [batch, kv_heads, window, head_dim]
  lengths: jax.Array  # int32 [batch]: tokens seen so far (may exceed the window)
  implementation: str = dataclasses.field(default="auto", metadata=dict(static=True))
  kernel_settings: KernelSettings = dataclasses.field(
    default=DEFAULT_KERNEL_SETTINGS, metadata=dict(static=True)
  )

  @classmethod
  def zeros(
    cls,
    *,
    batch,
    kv_heads,
    window,
    head_dim,
    dtype,
    implementation="auto",
    kernel_settings=DEFAULT_KERNEL_SETTINGS,
  ):
    check_count("window", window, 1)
    shape = (batch, kv_heads, window, head_dim)
    return cls(
      keys=jnp.zeros(shape, dtype),
      values=jnp.zeros(shape, dtype),
      lengths=jnp.zeros((batch,), jnp.int32),
      implementation=implementation,
      kernel_settings=kernel_settings,
    )

  @property
  def window(self) -> int:
    return self.keys.shape[2]

  @property
  def tokens_seen(self) -> jax.Array:  # int32 [batch]: the position of each row's next token
    return self.lengths

  def ingest(self, keys, values, queries, lengths):
    del queries
    lengths = lengths.astype(jnp.int32)
    positions, valid = ring_source_positions(lengths, self.window)

    def gather(x):
      taken = jnp.take_along_axis(x, positions[:, None, :, None], axis=2)
      return jnp.where(valid[:, None, :, None], taken, 0).astype(self.keys.dtype)

    return dataclasses.replace(self, keys=gather(keys), values=gather(values), lengths=lengths)

  def append(self, keys, values):
    slot = jnp.mod(self.lengths, self.window)
    return dataclasses.replace(
      self,
      keys=write_token_at_lengths(self.keys, keys, slot),
      values=write_token_at_lengths(self.values, values, slot),
      lengths=self.lengths + 1,
    )

  def ingest_chunk(self, keys, values, queries, counts):
    """Stores the first `counts[b]` tokens of a prompt chunk; of those, only the last
    `window` can still be seen, and only they are written (one write per slot)."""
    del queries
    offsets = jnp.arange(keys.shape[2])[None, :]
    written = (offsets < counts[:, None]) & (offsets >= counts[:, None] - self.window)
    slots = jnp.where(written, jnp.mod(self.lengths[:, None] + offsets, self.window), self.window)
    return self.with_chunk_written(keys, values, slots, counts)

  def attend_chunk(self, queries, *, sm_scale):
    """(out, lse) of a prompt chunk's queries over the ring: the query at position
    `lengths + i` sees the held tokens less than `window` positions back."""
    positions, valid = ring_source_positions(self.lengths, self.window)  # [batch, window]
    query_positions = self.lengths[:, None] + jnp.arange(queries.shape[3])  # [batch, chunk]
    visible = valid[:, None, :] & (
      query_positions[:, :, None] - positions[:, None, :] < self.window
    )
    return masked_attention(queries, self.keys, self.values, visible, sm_scale=sm_scale)

  def attend_with_lse(self, queries, *, sm_scale):
    """(out, lse) of one query position per row over the tokens the ring holds."""
    return attention_dispatch.decode_attention(
      queries,
      self.keys,
      self.values,
      jnp.minimum(self.lengths, self.window),
      sm_scale=sm_scale,
      implementation=self.implementation,
      kernel_config=self.kernel_settings.full_config(),
      kernel_backend=self.kernel_settings.kernel_backend,
    )

  def attend(self, queries, *, sm_scale):
    return self.attend_with_lse(queries, sm_scale=sm_scale)[0]
