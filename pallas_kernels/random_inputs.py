"""Random decode-attention inputs in the kernels' layouts (tests and benchmarks).

Every draw is fresh random data, never zeros: zeros hide unwritten outputs and wrong indexing.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.bit_packing import pack_codes
from pallas_kernels.quantized_decode_attention_reference import outlier_index_dtype


class QuantizedSegment(NamedTuple):
  k_codes: jax.Array  # uint32 [B, H, T, D*bits/32]
  k_scale: jax.Array  # [B, H, T/group_size, D]
  k_min: jax.Array
  v_codes: jax.Array  # uint32 [B, H, T, D*bits/32]
  v_scale: jax.Array  # [B, H, T, D/group_size]
  v_min: jax.Array
  lowrank: tuple | None  # (k_a, k_b, v_a, v_b)
  outliers: tuple | None  # (k_index, k_value, v_index, v_value)


def random_queries(key, batch, kv_heads, group, head_dim, dtype=jnp.float32) -> jax.Array:
  """`key`: a jax PRNG key (on-device generation) or a numpy Generator (no compilation: the
  fast choice for small test inputs on CPU)."""
  if isinstance(key, np.random.Generator):
    return jnp.asarray(key.standard_normal((batch, kv_heads, group, head_dim)), dtype)
  return _random_queries(key, batch, kv_heads, group, head_dim, dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _random_queries(key, batch, kv_heads, group, head_dim, dtype):
  return jax.random.normal(key, (batch, kv_heads, group, head_dim), jnp.float32).astype(dtype)


def random_lengths(key, batch: int, tokens: int, multiple: int = 1, include_empty=False):
  """int32 [batch] in [1, tokens] (multiples of `multiple`); the first row is full, one is 0
  when include_empty."""
  draws = np.asarray(jax.random.randint(key, (batch,), 1, tokens // multiple + 1)) * multiple
  draws[0] = tokens
  if include_empty and batch > 1:
    draws[-1] = 0
  return jnp.asarray(draws, jnp.int32)


def random_full_segment(key, batch, kv_heads, tokens, head_dim, dtype=jnp.float32):
  """(keys, values) [B, H, T, D]; `key` as in `random_queries`."""
  if isinstance(key, np.random.Generator):
    shape = (batch, kv_heads, tokens, head_dim)
    return (
      jnp.asarray(key.standard_normal(shape), dtype),
      jnp.asarray(key.standard_normal(shape), dtype),
    )
  return _random_full_segment(key, batch, kv_heads, tokens, head_dim, dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _random_full_segment(key, batch, kv_heads, tokens, head_dim, dtype):
  k_key, v_key = jax.random.split(key)
  shape = (batch, kv_heads, tokens, head_dim)
  return (
    jax.random.normal(k_key, shape, jnp.float32).astype(dtype),
    jax.random.normal(v_key, shape, jnp.float32).astype(dtype),
  )


def random_quantized_segment(
  key,
  batch,
  kv_heads,
  tokens,
  head_dim,
  *,
  bits,
  group_size,
  dtype=jnp.float32,
  rank: int = 0,
  outliers_per_block: int = 0,
  block: int = 64,
) -> QuantizedSegment:
  """Random codes, positive scales, signed minimums, and optional GEAR terms.

  `key`: a jax PRNG key (one jitted on-device program) or a numpy Generator (host arrays, no
  compilation).
  """
  sizes = (batch, kv_heads, tokens, head_dim)
  options = dict(
    bits=bits, group_size=group_size, rank=rank, outliers_per_block=outliers_per_block, block=block
  )
  if isinstance(key, np.random.Generator):
    return _random_quantized_segment(_NumpyRandom(key), None, *sizes, dtype=dtype, **options)
  return _random_quantized_segment_jit(key, *sizes, dtype=dtype, **options)


def segment_kwargs(segment: QuantizedSegment, *, bits: int, group_size: int) -> dict:
  """The keyword arguments of a quantized kernel call (or of its reference) on `segment`: its
  bits and group size, the softmax scale head_dim ** -0.5 and GEAR's terms (None without)."""
  return dict(
    bits=bits,
    group_size=group_size,
    sm_scale=segment.k_scale.shape[-1] ** -0.5,
    lowrank=segment.lowrank,
    outliers=segment.outliers,
  )


class _NumpyRandom:
  """The three jax.random draws used below, from a numpy Generator (keys are ignored)."""

  def __init__(self, generator):
    self.generator = generator

  def split(self, _, count):
    return [None] * count

  def randint(self, _, shape, low, high, dtype=jnp.int32):
    return jnp.asarray(self.generator.integers(low, high, size=shape), dtype)

  def uniform(self, _, shape, minval, maxval):
    return jnp.asarray(self.generator.uniform(minval, maxval, size=shape), jnp.float32)

  def normal(self, _, shape, dtype=jnp.float32):
    return jnp.asarray(self.generator.standard_normal(shape), dtype)


@functools.partial(
  jax.jit,
  static_argnums=(1, 2, 3, 4),
  static_argnames=("bits", "group_size", "dtype", "rank", "outliers_per_block", "block"),
)
def _random_quantized_segment_jit(key, *sizes, **options):
  return _random_quantized_segment(jax.random, key, *sizes, **options)


def _random_quantized_segment(
  random,
  key,
  batch,
  kv_heads,
  tokens,
  head_dim,
  *,
  bits,
  group_size,
  dtype,
  rank,
  outliers_per_block,
  block,
):
  keys = random.split(key, 12)
  levels = 2**bits
  code_shape = (batch, kv_heads, tokens, head_dim)
  k_codes = pack_codes(random.randint(keys[0], code_shape, 0, levels), bits)
  v_codes = pack_codes(random.randint(keys[1], code_shape, 0, levels), bits)
  # Scales ~ range/levels of unit-variance data, so dequantized values are O(1).
  k_stat = (batch, kv_heads, tokens // group_size, head_dim)
  v_stat = (batch, kv_heads, tokens, head_dim // group_size)
  spread = 4.0 / (levels - 1)
  k_scale = (random.uniform(keys[2], k_stat, minval=0.5, maxval=1.5) * spread).astype(dtype)
  k_min = (random.uniform(keys[3], k_stat, minval=-2.5, maxval=-1.5)).astype(dtype)
  v_scale = (random.uniform(keys[4], v_stat, minval=0.5, maxval=1.5) * spread).astype(dtype)
  v_min = (random.uniform(keys[5], v_stat, minval=-2.5, maxval=-1.5)).astype(dtype)
  lowrank = None
  if rank:
    a_shape = (batch, kv_heads, tokens, rank)
    b_shape = (batch, kv_heads, tokens // block, head_dim, rank)
    lowrank = tuple(
      (0.3 * random.normal(k, s, jnp.float32)).astype(dtype)
      for k, s in zip(keys[6:10], (a_shape, b_shape, a_shape, b_shape), strict=True)
    )
  outliers = None
  if outliers_per_block:
    shape = (batch, kv_heads, tokens // block, outliers_per_block)
    # In the caches' index dtype, so kernels and benchmarks read what a GEAR cache stores.
    index_dtype = outlier_index_dtype(block * head_dim)
    k_index = random.randint(keys[10], shape, 0, block * head_dim, jnp.int32).astype(index_dtype)
    v_index = random.randint(keys[11], shape, 0, block * head_dim, jnp.int32).astype(index_dtype)
    value_keys = random.split(keys[9], 2)
    k_value = (3.0 * random.normal(value_keys[0], shape, jnp.float32)).astype(dtype)
    v_value = (3.0 * random.normal(value_keys[1], shape, jnp.float32)).astype(dtype)
    outliers = (k_index, k_value, v_index, v_value)
  return QuantizedSegment(k_codes, k_scale, k_min, v_codes, v_scale, v_min, lowrank, outliers)
