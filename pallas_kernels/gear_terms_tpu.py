"""GEAR's low-rank and outlier terms by XLA around the TPU decode kernel, laid out for a TPU.

The same two terms as `gear_terms_xla` (the GPU kernels' default, whose docstring has the
algebra): a dense score bias the kernel adds, and the value terms added after the merge from
the scores the kernel wrote. Those functions lay their work out for a GPU: each outlier's query
group as a window of G contiguous floats ([B, H, J s, G]), the GEAR blocks' axis flattened
with the outliers'. A TPU tiles the two most minor dimensions of every array into (8, 128), so
there a [.., G] array is padded from 4 lanes to 128, and the flattening and the [J, s] stored
layout disagree: compiled for a TPU v5e without one, kvjax's decode loop with a GEAR-2 cache
(batch 8, 8 KV heads x 4, 32k tokens) copied 3.36 GB a step around the kernel, 2.75 GB of it one
padded [J s, G] product (KERNEL_NOTES v50). Here everything is kept with tokens or outliers on
lanes:

  outliers  taken as stored, [B, H, J, s], row-major (`OUTLIER_LAYOUT`, pinned by the cache's
            writes on a TPU), never flattened;
  key       q at each outlier's channel gathered to [B, H, R, J, s], scattered onto the bias's
            token lanes;
  value     p at each outlier's token gathered to [B, H, G, J, s], scattered onto channels;
  low rank  A taken as [B, H, r, T] (the tokens last, as XLA lays out the stored [B, H, T, r]),
            the B products as einsums with the blocks last.

Both are exact rewrites of `gear_terms_xla`'s (tests compare them). What this does not remove:
spreading each GEAR block's low-rank row over its 64 tokens is a [.., J, 64] -> [.., T]
relayout on a TPU (64 of 128 lanes), about 0.2 GB a step at the shape above, and nothing here
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


def gear_score_bias(
  lowrank, outliers, scaled_queries: jax.Array, *, tokens: int, block: int
) -> jax.Array:
  """float32 [B, H, R, tokens]: what `gear_terms_xla.gear_score_bias` returns, for a TPU.

  scaled_queries float32 [B, H, R, D] (padding rows give padding rows); lowrank / outliers as
  the reference takes them; either may be None."""
  batch, kv_heads, rows, head_dim = scaled_queries.shape
  bias = jnp.zeros((batch, kv_heads, rows, tokens), jnp.float32)
  if lowrank is not None:
    k_a, k_b = lowrank[0], lowrank[1]  # [B, H, T, r], [B, H, J, D, r]
    q_b = jnp.einsum(
      "bhgd,bhjdr->bhgrj", scaled_queries, k_b.astype(jnp.float32), precision="highest"
    )  # [B, H, R, r, J]
    spread = jnp.repeat(q_b, block, axis=-1)  # [B, H, R, r, T]: block j's row on its tokens
    k_a = jnp.swapaxes(k_a, 2, 3).astype(jnp.float32)  # [B, H, r, T]
    bias = jnp.sum(spread * k_a[:, :, None], axis=3)
  if outliers is not None:
    token, channel = outlier_tokens_and_channels(outliers[0], block, head_dim)  # [B, H, J, s]
    value = outliers[1].astype(jnp.float32)[:, :, None]
    b, h, g = _grid(batch, kv_heads, rows)
    q_at_channel = scaled_queries[b, h, g, channel[:, :, None]]  # [B, H, R, J, s]
    bias = bias.at[b, h, g, token[:, :, None]].add(q_at_channel * value)
  return bias


def gear_value_terms_from_scores(
  lowrank,
  outliers,
  scores: jax.Array,
  lse: jax.Array,
  lengths: jax.Array,
  *,
  block: int,
  head_dim: int,
) -> jax.Array:
  """float32 [B, H, G, D]: what `gear_terms_xla.gear_value_terms_from_scores` returns, for a
  TPU (same arguments; no outlier slots: a TPU's scatter is not made of atomic adds)."""
  batch, kv_heads, group = lse.shape
  blocks = scores.shape[-1] // block
  probs = normalised_probabilities(scores, lse, lengths)  # [B, H, G, T]
  terms = jnp.zeros((batch, kv_heads, group, head_dim), jnp.float32)
  if lowrank is not None:
    v_a, v_b = lowrank[2], lowrank[3]  # [B, H, T, r], [B, H, J, D, r]
    v_a = jnp.swapaxes(v_a, 2, 3).astype(jnp.float32)  # [B, H, r, T]
    weighted = probs[:, :, :, None, :] * v_a[:, :, None]  # [B, H, G, r, T]
    p_a = weighted.reshape(*weighted.shape[:-1], blocks, block).sum(-1)  # [B, H, G, r, J]
    terms = jnp.einsum("bhgrj,bhjdr->bhgd", p_a, v_b.astype(jnp.float32), precision="highest")
  if outliers is not None:
    token, channel = outlier_tokens_and_channels(outliers[2], block, head_dim)  # [B, H, J, s]
    value = outliers[3].astype(jnp.float32)[:, :, None]
    b, h, g = _grid(batch, kv_heads, group)
    weighted = probs[b, h, g, token[:, :, None]] * value  # [B, H, G, J, s]
    terms = terms.at[b, h, g, channel[:, :, None]].add(weighted)
  return terms
