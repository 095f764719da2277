"""GEAR's outlier terms by XLA around the TPU decode kernel, laid out for a TPU.

The TPU kernel computes GEAR's low-rank terms itself (`quantized_decode_attention_tpu`); the
sparse outliers stay XLA's, as `gear_terms_xla`'s for the GPU kernels (whose docstring has the
algebra): a dense score bias the kernel adds, and value terms added after the merge from the
scores the kernel wrote. `gear_terms_xla` lays its work out for a GPU: each outlier's query
group as a window of G contiguous floats ([B, H, J s, G]), the GEAR blocks' axis flattened with
the outliers'. A TPU tiles the two most minor dimensions of every array into (8, 128), so there
a [.., G] array is padded from 4 lanes to 128, and the flattening and the [J, s] stored layout
disagree: compiled for a TPU v5e without one, kvjax's decode loop with a GEAR-2 cache (batch 8,
8 KV heads x 4, 32k tokens) copied 3.36 GB a step around the kernel, 2.75 GB of it one padded
[J s, G] product (KERNEL_NOTES v50). Here the outliers are taken as stored, [B, H, J, s],
row-major (`OUTLIER_LAYOUT`, pinned by the cache's writes on a TPU), never flattened:

  key    q at each outlier's channel gathered to [B, H, R, J, s], scattered onto the bias's
         token lanes;
  value  p at each outlier's token gathered to [B, H, G, J, s], scattered onto channels.

Both are exact rewrites of `gear_terms_xla`'s outlier parts (tests compare them); nothing here
has been timed on a TPU.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.gear_terms_xla import normalised_probabilities, outlier_tokens_and_channels

# The layout the outlier arrays are read in: row-major, [B, H, J, s] as stored (a cache that
# writes them inside a TPU decode loop pins it: `kivi_cache._write_blocks`).
OUTLIER_LAYOUT = (0, 1, 2, 3)


def _grid(batch: int, kv_heads: int, rows: int):
  """Index arrays [B, 1, 1, 1, 1], [1, H, 1, 1, 1], [1, 1, R, 1, 1] for [B, H, R, J, s] gathers
  and scatters."""
  return tuple(axis[..., None, None] for axis in jnp.ogrid[:batch, :kv_heads, :rows])


def outlier_score_bias(outliers, scaled_queries: jax.Array, *, tokens: int, block: int):
  """float32 [B, H, R, tokens]: `gear_terms_xla.gear_score_bias` without a low-rank part, for
  a TPU. scaled_queries float32 [B, H, R, D] (padding rows give padding rows); outliers as the
  reference takes them."""
  batch, kv_heads, rows, head_dim = scaled_queries.shape
  token, channel = outlier_tokens_and_channels(outliers[0], block, head_dim)  # [B, H, J, s]
  value = outliers[1].astype(jnp.float32)[:, :, None]
  b, h, g = _grid(batch, kv_heads, rows)
  q_at_channel = scaled_queries[b, h, g, channel[:, :, None]]  # [B, H, R, J, s]
  bias = jnp.zeros((batch, kv_heads, rows, tokens), jnp.float32)
  return bias.at[b, h, g, token[:, :, None]].add(q_at_channel * value)


def outlier_value_terms_from_scores(
  outliers,
  scores: jax.Array,
  lse: jax.Array,
  lengths: jax.Array,
  *,
  block: int,
  head_dim: int,
) -> jax.Array:
  """float32 [B, H, G, D]: `gear_terms_xla.gear_value_terms_from_scores` without a low-rank
  part, for a TPU (same other arguments; no outlier slots: a TPU's scatter is not made of
  atomic adds). Outliers at or past a row's length add nothing, whatever they hold."""
  batch, kv_heads, group = lse.shape
  probs = normalised_probabilities(scores, lse, lengths)  # [B, H, G, T]
  token, channel = outlier_tokens_and_channels(outliers[2], block, head_dim)  # [B, H, J, s]
  value = outliers[3].astype(jnp.float32)[:, :, None]
  b, h, g = _grid(batch, kv_heads, group)
  weighted = probs[b, h, g, token[:, :, None]] * value  # [B, H, G, J, s]
  # p = 0 past the length, but a block past it may hold NaN values (0 times NaN is NaN) and
  # indices pointing anywhere.
  weighted = jnp.where((token < lengths[:, None, None, None])[:, :, None], weighted, 0.0)
  terms = jnp.zeros((batch, kv_heads, group, head_dim), jnp.float32)
  return terms.at[b, h, g, channel[:, :, None]].add(weighted)
