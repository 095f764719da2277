"""Choosing each KV head's kept tokens (top scores + a protected recent window), gathering them."""

import jax
import jax.numpy as jnp


def keep_top_tokens_and_window(
  scores: jax.Array,  # float32 [batch, kv_heads, prompt], finite
  lengths: jax.Array,  # int32 [batch]
  *,
  budget: int,
  window: int,
) -> tuple[jax.Array, jax.Array]:
  """Per KV head: the last `window` tokens of the row plus its top-(budget - window) older tokens.

  Returns `(indices int32 [batch, kv_heads, budget], kept_lengths int32 [batch])`. Indices are in
  ascending (original) order; the first `kept_lengths[b] = min(budget, lengths[b])` are the kept
  tokens of row b, the rest point at padding. A row of at most `budget` tokens keeps them all.
  Ties go to the earlier token (`lax.top_k` is stable).
  """
  prompt_len = scores.shape[-1]
  if not window <= budget <= prompt_len:
    raise ValueError(f"need window={window} <= budget={budget} <= prompt length {prompt_len}")
  positions = jnp.arange(prompt_len)[None, None, :]
  row_lengths = lengths[:, None, None]
  in_window = positions >= row_lengths - window
  is_padding = positions >= row_lengths
  # Window tokens outrank every scored token; padding ranks below all, so it is only picked
  # (after every real token) when a row is shorter than the budget.
  priority = jnp.where(is_padding, -jnp.inf, jnp.where(in_window, jnp.inf, scores))
  _, chosen = jax.lax.top_k(priority, budget)
  indices = jnp.sort(chosen, axis=-1).astype(jnp.int32)
  return indices, jnp.minimum(lengths, budget).astype(jnp.int32)


def gather_tokens(
  x: jax.Array,  # [batch, kv_heads, prompt, head_dim]
  indices: jax.Array,  # int32 [batch, kv_heads, kept]
) -> jax.Array:  # [batch, kv_heads, kept, head_dim]
  return jnp.take_along_axis(x, indices[..., None], axis=2)
