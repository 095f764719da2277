"""Pure-jnp decode attention over a full-precision K/V segment (the reference for the kernels)."""

import jax
import jax.numpy as jnp


def check_decode_inputs(queries, keys, values, lengths) -> None:
  """Raises ValueError naming the array whose shape does not fit the queries' (shapes only, so
  it runs on tracers; mismatched heads would otherwise broadcast silently)."""
  if queries.ndim != 4:
    raise ValueError(
      f"queries must be [batch, kv_heads, group, head_dim], got shape {queries.shape}"
    )
  batch, kv_heads, _, head_dim = queries.shape
  for name, array in (("keys", keys), ("values", values)):
    if array.ndim != 4 or array.shape[:2] != (batch, kv_heads) or array.shape[3] != head_dim:
      raise ValueError(
        f"{name} must be [{batch}, {kv_heads}, tokens, {head_dim}] to match the queries "
        f"{queries.shape}; got {array.shape}"
      )
  if values.shape != keys.shape:
    raise ValueError(f"values shape {values.shape} must equal keys shape {keys.shape}")
  if lengths.shape != (batch,):
    raise ValueError(f"lengths must be [{batch}], got shape {lengths.shape}")


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
  # Only an empty segment (lse -inf) drops out; a NaN one makes the merge NaN.
  safe_total = jnp.where(total == -jnp.inf, 0.0, total)
  weights = jnp.where(lses == -jnp.inf, 0.0, jnp.exp(lses - safe_total[None]))
  out = sum(w[..., None] * o for w, (o, _) in zip(weights, partials, strict=True))
  return out, total
