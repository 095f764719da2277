"""The codes as bfloat16 pairs where a token's words fill half a register (2-bit codes at
head_dim 64, 4 words a token), as a virtual head of twice the channels.

The TPU kernel stacks a block's two token halves on sublanes (`token_halves_tpu`): [4, n] words
become [8, n / 2], whole registers, which `bfloat16_code_pairs.code_pairs` turns into the pairs
of a head of 2 D channels and 8 words a token: virtual channel C = f * 8 + w' is field f of
stacked row w', which is word w' % 4 of token half w' // 4, i.e. real channel f * 4 + w' % 4
(`bit_packing`'s planar layout) of the tokens in half w' // 4. Each half's products are then
those of head_dim 2 D (`code_pair_products_tpu`) with the other half's virtual channels zero:

  keys    each half's queries embedded in the virtual channels of that half, zero on the
          other's (`half_pair_queries`): a product over all 2 D rows picks up that half's
          tokens only; the scores of the two halves, [rows, n / 2] each, side by side are the
          block's. The key scales, folded into those queries, go into the half's pair rows
          by one product with the half's rows of `half_value_matrix` (real channels to the
          virtual pair rows, times the factors); the groups' constants (q . k_min less the
          1s) need no virtual channels (each real channel's factor is its virtual one's) and
          come from the real queries (`code_pair_products_tpu.group_constants`);
  values  each half's P' times the pairs gives [rows, 2 D] over both halves' rows, of which
          the half's own are its tokens' (the other's are finite and multiplied by zeros): both
          halves' parts side by side, one product with `half_value_matrix` ([4 D, D]: the
          pairs' row order to virtual channels, times the factors, to real channels, the other
          half's rows zero) sums them into real channels.

Both halves' rows go into one product with the pairs (`key_scores_sharing_pairs`,
`value_partials_sharing_pairs`), so that the pairs are pushed into the MXU once for both (the
step's static bundles on a v5e, 8192 tokens: 2252 -> 1916, KERNEL_NOTES v63). The key
statistics embedded into virtual channels by products in the kernel (v58) cost 215 of those
1916 bundles. All embeddings are 0/1 products: exact. At v57 the pairs on half-full registers
([4, n]) were no faster than unpacking the token halves (KERNEL_NOTES v57); stacked, the masks
and ORs work on whole registers (KERNEL_NOTES v58).
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bfloat16_code_pairs, code_pair_products_tpu, token_halves_tpu


def applies(bits: int, head_dim: int, stats_dtype, words_block: int, group_size: int) -> bool:
  """Whether the kernel takes this path: 2- or 4-bit codes of 4 words a token (half a
  register: 2 bits at head_dim 64) with bfloat16 statistics, in blocks whose halves are whole
  lane tiles of whole key groups (`token_halves_tpu.applies`)."""
  return (
    bits in bfloat16_code_pairs.PAIR_BITS
    and head_dim * bits // 32 == token_halves_tpu.WORDS
    and jnp.dtype(stats_dtype) == jnp.bfloat16
    and token_halves_tpu.applies(token_halves_tpu.WORDS, words_block, group_size)
  )


def virtual_channels(head_dim: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
  """(half int32 [2 D], real channel int32 [2 D]) of each virtual channel."""
  words = head_dim * bits // 32
  virtual = np.arange(2 * head_dim)
  row = virtual % (2 * words)  # the stacked row w'
  return (row // words).astype(np.int32), (virtual // (2 * words) * words + row % words).astype(
    np.int32
  )


def half_embeddings(head_dim: int, bits: int) -> np.ndarray:
  """float32 [2, 2 D, D]: entry (h, C, c) 1 where virtual channel C is real channel c of half h."""
  half, channel = virtual_channels(head_dim, bits)
  embeddings = np.zeros((2, 2 * head_dim, head_dim), np.float32)
  embeddings[half, np.arange(2 * head_dim), channel] = 1.0
  return embeddings


def half_queries(queries: jax.Array, bits: int) -> jax.Array:
  """[..., 2, rows, 2 D]: queries [..., rows, D] (bfloat16) in each half's virtual channels,
  zero in the other's (exact: one nonzero term)."""
  embeddings = jnp.asarray(half_embeddings(queries.shape[-1], bits), queries.dtype)
  return jnp.einsum(
    "...rc,hvc->...hrv", queries, embeddings, preferred_element_type=jnp.float32
  ).astype(queries.dtype)


def half_pair_queries(queries: jax.Array, bits: int) -> jax.Array:
  """[..., 2, rows, 2 D]: each half's virtual queries (`half_queries`) in the virtual head's
  pairs' row order (`code_pair_products_tpu.pair_query_rows`' first rows)."""
  rows = queries.shape[-2]
  return code_pair_products_tpu.pair_query_rows(half_queries(queries, bits), bits)[..., :rows, :]


def half_value_matrix(head_dim: int, bits: int) -> np.ndarray:
  """float32 [4 D, D]: both halves' pair rows (half 0's 2 D, then half 1's) to real channels,
  times the rows' factors; the other half's rows zero (exact in bfloat16). Half h's [2 D, D]
  serves its keys too: `code_pair_products_tpu.pair_ordered_scales` of the half's key scales
  [D, G / 2] by it puts them in its virtual pair rows, zero on the other half's."""
  pairs_to_virtual = bfloat16_code_pairs.pair_matrix(2 * head_dim, bits)  # [2 D, 2 D]
  embeddings = half_embeddings(head_dim, bits)
  return np.concatenate([pairs_to_virtual @ embeddings[h] for h in range(2)])
