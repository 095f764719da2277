"""Each token's own key group's rows of a product whose rows stack one block per key group.

The TPU kernels fold the key scales into the queries per key group: a lane tile's codes are
multiplied by the queries scaled by each of the tile's groups ([groups x rows, D], one block of
rows per group), so every token's column holds its score under every group's scales, and the
token keeps its own group's (`_scale_folded_scores`, `token_halves_tpu`)."""

import jax
import jax.numpy as jnp


def own_group_rows(products: jax.Array, rows: int, group_size: int, first: int, groups: int):
  """float32 [rows, width]: column t of row block first + t // group_size of products
  [blocks x rows, width], for the `groups` blocks from `first` (the tile's groups, in token
  order)."""
  if groups == 1:
    return products[first * rows : (first + 1) * rows]
  token_group = jax.lax.broadcasted_iota(jnp.int32, (1, products.shape[1]), 1) // group_size
  scores = None
  for g in range(groups):
    block = products[(first + g) * rows : (first + g + 1) * rows]
    own = jnp.where(token_group == g, block, 0.0)
    scores = own if scores is None else scores + own
  return scores
