"""A fixed softmax reference per split, from bounds on the scores that the key statistics give,
so that a kernel can run its softmax without a running row max.

An online softmax keeps a running max m and computes p = exp2(s - m), rescaling what it carries
whenever m grows. Any other reference gives the same softmax as long as p neither overflows nor
underflows: the max is what guarantees that, not what the result needs. In the folded Mosaic GPU
kernel the row max is the one reduction over tokens left in the loop, and tokens are spread over
the four warps, so it crosses them through shared memory at every block (v30's profile on an
H200: the largest single stall, FMNMX waiting on its loads; KERNEL_NOTES v31, item 3).

A KIVI key is k_scale[g, c] code[t, c] + k_min[g, c] with code in [0, 2^bits - 1] and the scale
non-negative (the codec's invariant), so every score of a token of key group g lies in

  lower[g] = (2^bits - 1) sum_c min(q_c, 0) k_scale[g, c] + q . k_min[g]
  upper[g] = (2^bits - 1) sum_c max(q_c, 0) k_scale[g, c] + q . k_min[g]

(`key_score_bounds`; q . k_min[g] is `key_bias`, which the kernel adds anyway). Over a split's
valid key groups, with U the largest upper bound and L the largest lower bound (the split's true
max M is at least L, and at most U), the split's reference is m = U - HEADROOM:

- overflow: every score is at most U, so p <= 2^HEADROOM;
- underflow: m - M <= U - HEADROOM - L, so when U - L <= HEADROOM + UNDERFLOW_MARGIN the split's
  largest p is at least 2^-UNDERFLOW_MARGIN, a normal float32 whose softmax keeps every token
  within 2^-30 of it (below that f32 loses them; the exact max loses those under 2^-126).

A split where U - L exceeds that, or where a bound is not finite (NaN statistics of a valid
group, an empty split), gets the reference +inf, which tells the kernel to run the exact online
softmax for that program instead (`EXCHANGE`).

On SmolLM2-135M's own keys and queries (30 layers, a 2100-token prompt, queries at two
positions, KIVI-2 and KIVI-4 with group 32; `benchmarks/softmax_reference_spread.py`) the true
max of a served split sat 22-24 below U at the median and at most 57 below it (m - M <= 25), and
1.5-2.0% of splits of 2 to 32 key groups, or of the whole context, take the exact path.

Preconditions beyond the exact path's: key scales >= 0 (every KIVI cache kvjax writes), and in the
folded Mosaic GPU kernel value scales < 2^31 (P' carries p v_scale 2^64 in bf16, so p <= 2^32
leaves 2^31 of bf16's range; the exact path's p <= 1 leaves 2^63).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.key_bias import DEFAULT_KEY_PRODUCT, query_group_products

# m sits this far (base 2) below the split's upper bound: p <= 2^HEADROOM.
HEADROOM = 32.0
# The most (base 2) the reference may sit above the split's true max: its largest p >= 2^-96.
UNDERFLOW_MARGIN = 96.0
# The reference of a split the bounds cannot serve: its program runs the exact online softmax.
EXCHANGE = float("inf")


def key_score_bounds(
  queries: jax.Array,  # f32 [B, H, rows, D], scaled as the kernel's are (`key_bias`)
  k_scale: jax.Array,  # [B, H, G, D], G = T / group_size
  bias: jax.Array,  # f32 [B, H, G, rows]: q . k_min[g] (`key_bias`)
  *,
  bits: int,
  key_products: str = DEFAULT_KEY_PRODUCT,
) -> tuple[jax.Array, jax.Array]:
  """(lower, upper) f32 [B, H, G, rows]: bounds on every score of key group g (base 2, like the
  scores). One product over the key scales, the queries split by sign; f32 throughout either way
  (`KEY_PRODUCTS`): a TF32 product's rounding could put a score above its bound."""
  levels = float(2**bits - 1)
  queries = queries.astype(jnp.float32)
  rows = queries.shape[2]
  by_sign = jnp.concatenate([jnp.minimum(queries, 0.0), jnp.maximum(queries, 0.0)], axis=2)
  products = levels * query_group_products(by_sign, k_scale, key_products=key_products)
  return products[..., :rows] + bias, products[..., rows:] + bias


def split_softmax_references(
  lower: jax.Array,  # f32 [B, H, G, rows] (`key_score_bounds`)
  upper: jax.Array,
  lengths: jax.Array,  # int32 [B]: each row's tokens
  *,
  group_size: int,
  split_tokens: int,  # tokens per split, a multiple of group_size
  num_splits: int,
) -> jax.Array:
  """f32 [B, H, num_splits, rows]: each split's softmax reference U - HEADROOM, or EXCHANGE in
  every row of a split whose bounds cannot serve any one of its rows (see the module text).
  Key groups that start at or past a row's length are left out (their statistics may be NaN)."""
  if split_tokens % group_size:
    raise ValueError(f"split_tokens={split_tokens} must be a multiple of group_size={group_size}")
  batch, heads, groups, rows = upper.shape
  per_split = split_tokens // group_size
  valid = jnp.arange(groups)[None, :] * group_size < lengths[:, None]  # [B, G]
  valid = valid[:, None, :, None]
  padding = ((0, 0), (0, 0), (0, num_splits * per_split - groups), (0, 0))

  def split_max(bound):
    bound = jnp.pad(jnp.where(valid, bound, -jnp.inf), padding, constant_values=-jnp.inf)
    return bound.reshape(batch, heads, num_splits, per_split, rows).max(axis=3)

  top, floor = split_max(upper), split_max(lower)
  # NaN (an empty split's -inf - -inf, NaN statistics) and inf compare False: exact path.
  served = (top - floor <= HEADROOM + UNDERFLOW_MARGIN).all(axis=3, keepdims=True)
  return jnp.where(served, top - HEADROOM, EXCHANGE)
