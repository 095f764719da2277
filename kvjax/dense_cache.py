"""The full-precision cache: every token's K/V as computed (the baseline of every comparison)."""

import dataclasses

import jax
import jax.numpy as jnp

from kvjax import attention_dispatch
from kvjax.cache_protocol import KeyValueArrays, ModelCacheShape, check_count
from kvjax.chunk_attention import attend_chunk_over_slots
from kvjax.compact_rows import (
  cut_or_pad_to,
  slots_after_lengths,
  write_token_at_lengths,
  zero_past_lengths,
)
from kvjax.kernel_settings import DEFAULT_KERNEL_SETTINGS, KernelSettings, check_kernel_settings
from kvjax.method_registry import register_method
from pallas_kernels import decode_attention_tpu


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseLayerCache(KeyValueArrays):
  keys: jax.Array  # [batch, kv_heads, capacity, head_dim]
  values: jax.Array  # [batch, kv_heads, capacity, head_dim]
  lengths: jax.Array  # int32 [batch]
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
    capacity,
    head_dim,
    dtype,
    implementation="auto",
    kernel_settings=DEFAULT_KERNEL_SETTINGS,
  ):
    shape = (batch, kv_heads, capacity, head_dim)
    return cls(
      keys=jnp.zeros(shape, dtype),
      values=jnp.zeros(shape, dtype),
      lengths=jnp.zeros((batch,), jnp.int32),
      implementation=implementation,
      kernel_settings=kernel_settings,
    )

  @property
  def capacity(self) -> int:
    return self.keys.shape[2]

  @property
  def room(self) -> jax.Array:  # int32 [batch]: tokens each row can still take
    return self.capacity - self.lengths

  def capacity_on_tpu(self, tokens: int) -> int:
    """The capacity `FullCache.allocate` gives a cache asked for `tokens`, where the compiled TPU
    kernel reads it (whole tiles of tokens: `decode_attention_tpu.cache_token_granule`)."""
    granule = decode_attention_tpu.cache_token_granule(self.keys.shape[-1])
    return -(-tokens // granule) * granule

  def with_capacity(self, tokens: int) -> "DenseLayerCache":
    """This cache with `tokens` slots a row (another backend's layout: `FullCache.allocate`
    rounds a TPU's capacity up): slots past `tokens` cut off, or zeros added (what a slot past a
    row's length holds). The caller checks that no row holds more than `tokens` tokens."""
    check_count("tokens", tokens, 0)
    batch, kv_heads, _, head_dim = self.keys.shape
    shape = (batch, kv_heads, tokens, head_dim)
    return dataclasses.replace(
      self, keys=cut_or_pad_to(self.keys, shape), values=cut_or_pad_to(self.values, shape)
    )

  @property
  def tokens_seen(self) -> jax.Array:  # int32 [batch]: the position of each row's next token
    return self.lengths

  def ingest(self, keys, values, queries, lengths):
    del queries  # a dense cache keeps every token
    prompt_len = keys.shape[2]
    if prompt_len > self.capacity:
      raise ValueError(f"prompt of {prompt_len} tokens exceeds cache capacity {self.capacity}")
    lengths = lengths.astype(jnp.int32)
    return dataclasses.replace(
      self,
      keys=self.keys.at[:, :, :prompt_len].set(
        zero_past_lengths(keys, lengths).astype(self.keys.dtype)
      ),
      values=self.values.at[:, :, :prompt_len].set(
        zero_past_lengths(values, lengths).astype(self.values.dtype)
      ),
      lengths=lengths,
    )

  def append(self, keys, values):
    return dataclasses.replace(
      self,
      keys=write_token_at_lengths(self.keys, keys, self.lengths),
      values=write_token_at_lengths(self.values, values, self.lengths),
      lengths=self.lengths + 1,
    )

  def ingest_chunk(self, keys, values, queries, counts):
    """Stores the first `counts[b]` tokens of a prompt chunk after each row's tokens."""
    del queries
    slots = slots_after_lengths(self.lengths, counts, keys.shape[2], self.capacity)
    return self.with_chunk_written(keys, values, slots, counts)

  def attend_chunk(self, queries, *, sm_scale):
    """(out, lse) of a prompt chunk's queries over every token held (all precede the chunk)."""
    return attend_chunk_over_slots(queries, self.keys, self.values, self.lengths, sm_scale=sm_scale)

  def attend_with_lse(self, queries, *, sm_scale):
    """(out, lse) of one query position per row over every token held."""
    return attention_dispatch.decode_attention(
      queries,
      self.keys,
      self.values,
      self.lengths,
      sm_scale=sm_scale,
      implementation=self.implementation,
      kernel_config=self.kernel_settings.full_config(),
      kernel_backend=self.kernel_settings.kernel_backend,
    )

  def attend(self, queries, *, sm_scale):
    return self.attend_with_lse(queries, sm_scale=sm_scale)[0]


@register_method("full", kind="storage")
@dataclasses.dataclass(frozen=True)
class FullCache:
  """Cache method `full`: every token in the cache dtype.

  For a model with a sliding window shorter than the capacity, the full cache is the window's
  ring buffer (`SlidingWindowLayerCache`): exactly what the model attends to, nothing more.
  Where the compiled TPU kernel reads it, its capacity is rounded up to a multiple of 16 tokens
  (128 below 128 channels: `attention_dispatch.full_precision_cache_granule`), so that a TPU's
  default layout of K and V is the one the kernel reads, however the decode step is jitted.
  (`allocate_storage`, what selection methods keep their budget in, is not rounded.)
  """

  implementation: str = "auto"
  kernel_settings: KernelSettings = DEFAULT_KERNEL_SETTINGS

  def __post_init__(self):
    attention_dispatch.check_implementation(self.implementation)
    check_kernel_settings(self.kernel_settings)

  def allocate_storage(self, *, batch, kv_heads, capacity, head_dim, dtype) -> "DenseLayerCache":
    """A cache of `capacity` slots (what selection methods store their survivors in)."""
    check_count("capacity", capacity, 0)
    return DenseLayerCache.zeros(
      batch=batch,
      kv_heads=kv_heads,
      capacity=capacity,
      head_dim=head_dim,
      dtype=dtype,
      implementation=self.implementation,
      kernel_settings=self.kernel_settings,
    )

  def allocate(self, shape: ModelCacheShape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    del layer
    capacity = prompt_len + max_new_tokens
    if shape.sliding_window is not None and shape.sliding_window < capacity:
      from kvjax.sliding_window_cache import SlidingWindowLayerCache

      return SlidingWindowLayerCache.zeros(
        batch=batch,
        kv_heads=shape.num_kv_heads,
        window=shape.sliding_window,
        head_dim=shape.head_dim,
        dtype=dtype,
        implementation=self.implementation,
        kernel_settings=self.kernel_settings,
      )
    granule = attention_dispatch.full_precision_cache_granule(
      self.implementation, shape.head_dim, self.kernel_settings.kernel_backend
    )
    return self.allocate_storage(
      batch=batch,
      kv_heads=shape.num_kv_heads,
      capacity=-(-capacity // granule) * granule,
      head_dim=shape.head_dim,
      dtype=dtype,
    )
