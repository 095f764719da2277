"""Attention-based token scores at the end of prefill, never materialising prompt x prompt.

Rows are compact: row b's valid tokens are slots [0, lengths[b]). Queries and keys arrive
RoPE-rotated at their original positions, exactly as the model attended with them.
"""

import jax
import jax.numpy as jnp


def observation_window_attention(
  queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim], rotated
  keys: jax.Array,  # [batch, kv_heads, prompt, head_dim], rotated
  lengths: jax.Array,  # int32 [batch]
  *,
  window: int,
  sm_scale: float,
  first_query: jax.Array | None = None,  # int32 [batch]: no queries before this position
) -> jax.Array:  # float32 [batch, kv_heads, group, prompt]
  """Attention the last `window` queries of each row pay to every key, summed over those queries.

  Only `[window, prompt]` scores per head exist (SnapKV's observation window): query i of the
  window sits at position lengths[b] - window + i, sees keys j <= its position (causal inside
  the window, padding keys never), softmax in float32. A row shorter than the window uses the
  queries it has; so does a row whose queries start at `first_query` (chunked prefill: tokens
  held from earlier chunks have keys but no queries left).
  """
  prompt_len = keys.shape[2]
  window = min(window, prompt_len)
  query_positions = lengths[:, None] + (jnp.arange(window) - window)[None, :]  # [batch, window]
  query_exists = query_positions >= (0 if first_query is None else first_query[:, None])
  gather_at = jnp.clip(query_positions, 0, prompt_len - 1)
  window_queries = jnp.take_along_axis(
    queries, gather_at[:, None, None, :, None], axis=3
  )  # [batch, kv_heads, group, window, head_dim]
  scores = (
    jnp.einsum("bhgwd,bhtd->bhgwt", window_queries.astype(jnp.float32), keys.astype(jnp.float32))
    * sm_scale
  )
  key_positions = jnp.arange(prompt_len)
  # Causal visibility also hides padding keys: a real query's position is < its row's length.
  # A missing query (short row) sees everything, to keep its softmax finite; it is zeroed below.
  visible = key_positions[None, None, :] <= query_positions[:, :, None]
  visible = visible | ~query_exists[:, :, None]
  scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(query_exists[:, None, None, :, None], probs, 0.0)
  return probs.sum(axis=3)


def accumulated_prompt_attention(
  queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim], rotated
  keys: jax.Array,  # [batch, kv_heads, prompt, head_dim], rotated
  lengths: jax.Array,  # int32 [batch]
  *,
  sm_scale: float,
  query_chunk: int = 512,
) -> jax.Array:  # float32 [batch, kv_heads, group, prompt]
  """Attention each key receives summed over *all* valid prompt queries (H2O's heavy-hitter score).

  Computed in chunks of `query_chunk` queries under `lax.scan`, so at most
  `[batch, kv_heads, group, query_chunk, prompt]` scores exist at once.
  """
  prompt_len = keys.shape[2]
  chunk = min(query_chunk, prompt_len)
  num_chunks = -(-prompt_len // chunk)
  padded_queries = jnp.pad(queries, ((0, 0),) * 3 + ((0, num_chunks * chunk - prompt_len), (0, 0)))
  keys32 = keys.astype(jnp.float32)
  key_positions = jnp.arange(prompt_len)

  def add_chunk(total, start):
    q = jax.lax.dynamic_slice_in_dim(padded_queries, start, chunk, axis=3).astype(jnp.float32)
    scores = jnp.einsum("bhgcd,bhtd->bhgct", q, keys32) * sm_scale
    query_positions = start + jnp.arange(chunk)
    # Causal; a padding query (position >= length, or past the prompt) contributes nothing.
    visible = key_positions[None, :] <= query_positions[:, None]  # [chunk, prompt]
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    query_is_real = query_positions[None, :] < lengths[:, None]  # [batch, chunk]
    probs = jnp.where(query_is_real[:, None, None, :, None], probs, 0.0)
    return total + probs.sum(axis=3), None

  total = jnp.zeros((*queries.shape[:3], prompt_len), jnp.float32)
  total, _ = jax.lax.scan(add_chunk, total, jnp.arange(num_chunks) * chunk)
  return total
