"""The key minimums' share of every score, q . k_min per key group, computed before the folded
kernels instead of inside them.

A KIVI key is k_scale[g, c] * code[t, c] + k_min[g, c] for the tokens t of key group g, so each
score is (q * k_scale[g]) . code[t] + q . k_min[g]. The second term is the same for every token
of the group: one number per key group and query row. The folded kernels used to compute it per
block, a product and a sum over the channels. With the channels spread over the four warps (the
Mosaic GPU kernel) or the tokens (Triton), every block paid for cross-warp sums through shared
memory, where the folded Mosaic GPU kernel measured its stalls (KERNEL_NOTES v18). Computed here
by XLA in one pass over k_min (8 bytes per token and head at head_dim 128, group 32), each block
reads [key groups, rows] f32 instead of k_min's [key groups, D]: 1 byte per token and head at
8 rows, against 8 for k_min.

How XLA computes such a product of the queries with a per-group key statistic (here k_min; the
score bounds of `softmax_reference_bounds` take k_scale) is `KEY_PRODUCTS`: "einsum", a batched
f32 matrix product, which XLA's GPU backend makes a GEMM fusion (41 us under Nsight Compute on the
H200 at 32k, batch 8, 8 KV heads, reading 17 MB: a quarter of the time the folded Mosaic kernel
itself took, KERNEL_NOTES v34), or "reduction", the broadcast product summed over the channels,
which it makes a reduction fusion reading the same 17 MB (not yet timed on a GPU).
"""

import jax
import jax.numpy as jnp
from jax import lax

KEY_PRODUCTS = ("einsum", "reduction")
DEFAULT_KEY_PRODUCT = "einsum"


def check_key_product(key_products: str) -> None:
  """ValueError naming the setting and its allowed values."""
  if key_products not in KEY_PRODUCTS:
    raise ValueError(f"key_products={key_products!r} is not supported; allowed: {KEY_PRODUCTS}")


def query_group_products(
  queries: jax.Array,  # f32 [B, H, rows, D]
  statistic: jax.Array,  # [B, H, G, D]: one row per key group
  *,
  key_products: str = DEFAULT_KEY_PRODUCT,
) -> jax.Array:
  """f32 [B, H, G, rows]: queries[r] . statistic[g], with f32 products and sums either way
  (`KEY_PRODUCTS`)."""
  check_key_product(key_products)
  queries, statistic = queries.astype(jnp.float32), statistic.astype(jnp.float32)
  if key_products == "reduction":
    return jnp.sum(queries[:, :, None, :, :] * statistic[:, :, :, None, :], axis=-1)
  return jnp.einsum(
    "bhrd,bhgd->bhgr",
    queries,
    statistic,
    # f32 throughout: XLA on GPU would otherwise take a TF32 product (10-bit mantissas).
    precision=lax.Precision.HIGHEST,
  )


def key_bias(
  queries: jax.Array, k_min: jax.Array, *, key_products: str = DEFAULT_KEY_PRODUCT
) -> jax.Array:
  """f32 [B, H, rows, D] queries (scaled as the kernel's are, by sm_scale log2(e): the bias is a
  base-2 logit like the scores, `base_two_softmax`; rows padded as the kernel pads them) and
  [B, H, T / group_size, D] minimums -> f32 [B, H, T / group_size, rows]: q . k_min[g].

  Minimums past a row's length may be NaN; their groups' biases are then NaN, and the kernels
  pick no token of such a group (selects, not products)."""
  return query_group_products(queries, k_min, key_products=key_products)
