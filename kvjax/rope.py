"""Rotary position embeddings (Hugging Face "rotate half" layout), with Llama-3 scaling.

The one RoPE implementation: the models rotate queries and keys with it, and caches that move
keys to other positions (StreamingLLM's in-cache positions) rotate them with it too.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 frequency scaling (`rope_type="llama3"`)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


def rope_inverse_frequencies(
  head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> np.ndarray:  # float32 [head_dim // 2]
  # float32 throughout, as the reference implementation computes it, so positions in the
  # thousands rotate identically.
  exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
  inv_freq = np.float32(1.0) / (np.float32(theta) ** exponents)
  if scaling is None:
    return inv_freq.astype(np.float32)
  # Llama 3: long wavelengths are divided by `factor`, short ones kept, the band between
  # interpolated smoothly.
  low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
  high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
    scaling.high_freq_factor - scaling.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rotate(x: jax.Array, angles: jax.Array) -> jax.Array:
  """Rotates the last axis of `x` by `angles` [..., head_dim // 2] (broadcast); float32 out."""
  angles = jnp.concatenate([angles, angles], axis=-1)
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated_half = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return x32 * jnp.cos(angles) + rotated_half * jnp.sin(angles)


def apply_rope(
  x: jax.Array,  # [batch, tokens, heads, head_dim]
  positions: jax.Array,  # int32 [batch, tokens]
  inv_freq: np.ndarray,  # [head_dim // 2]
) -> jax.Array:
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [b, t, d/2]
  return rotate(x, angles[:, :, None, :]).astype(x.dtype)


def rotate_by_positions(
  x: jax.Array,  # [batch, heads, tokens, head_dim]
  shift: jax.Array,  # int32 [batch]: positions to rotate forward by
  inv_freq: np.ndarray,  # float32 [head_dim // 2]
) -> jax.Array:  # float32, same shape
  """A key rotated at position p becomes the key rotated at p + shift."""
  angles = shift.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [batch, d/2]
  return rotate(x, angles[:, None, None, :])
