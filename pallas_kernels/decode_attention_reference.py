"""Pure-jnp decode attention over a full-precision K/V segment (the reference for the kernels)."""

import jax
import jax.numpy as jnp


def decode_attention_reference(
  queries: jax.Array,  # [batch, kv_heads, group, head_dim]
  keys: jax.Array,  # [batch, kv_heads, tokens, head_dim]
  values: jax.Array,  # [batch, kv_heads, tokens, head_dim]
  lengths: jax.Array,  # int32 [batch]: slots [0, length) are valid
  *,
  sm_scale: float,
) -> tuple[jax.Array, jax.Array]:
  """Attention of one query position per row over the valid slots of a segment.

  Slots past a row's length are never used, whatever they hold (NaN included).
  Returns `(out [batch, kv_heads, group, head_dim] float32, lse [batch, kv_heads, group] float32)`,
  `lse` being the natural log-sum-exp of the scaled scores, so partial results over disjoint
  segments merge exactly (`merge_attention_partials`). A row with length 0 gives out 0, lse -inf.
  """
  scores = (
    jnp.einsum("bhgd,bhtd->bhgt", queries.astype(jnp.float32), keys.astype(jnp.float32)) * sm_scale
  )
  valid = jnp.arange(keys.shape[2])[None, :] < lengths[:, None]  # [batch, tokens]
  scores = jnp.where(valid[:, None, None, :], scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)
  safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  probs = jnp.where(valid[:, None, None, :], jnp.exp(scores - safe_lse[..., None]), 0.0)
  # Slots past the length may hold anything, NaN included: zero them so 0 * NaN cannot leak.
  values = jnp.where(valid[:, None, :, None], values.astype(jnp.float32), 0.0)
  out = jnp.einsum("bhgt,bhtd->bhgd", probs, values)
  return out, lse


def merge_attention_partials(
  partials: list[tuple[jax.Array, jax.Array]],
) -> tuple[jax.Array, jax.Array]:
  """Exact softmax attention over the union of disjoint segments from their (out, lse) pairs."""
  lses = jnp.stack([lse for _, lse in partials])  # [parts, batch, kv_heads, group]
  total = jax.nn.logsumexp(lses, axis=0)
  safe_total = jnp.where(jnp.isfinite(total), total, 0.0)
  weights = jnp.where(jnp.isfinite(lses), jnp.exp(lses - safe_total[None]), 0.0)
  out = sum(w[..., None] * o for w, (o, _) in zip(weights, partials, strict=True))
  return out, total
