"""Causal self-attention over a whole prompt, chunked over queries.

Chunking bounds memory at `[batch, heads, query_chunk, prompt]` scores, so an 8k prompt never
builds the prompt x prompt matrix for all heads at once.
"""

import jax
import jax.numpy as jnp

from kvjax.cache_protocol import check_count


def causal_prompt_attention(
  queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim]
  keys: jax.Array,  # [batch, kv_heads, prompt, head_dim]
  values: jax.Array,  # [batch, kv_heads, prompt, head_dim]
  *,
  sm_scale: float,
  sliding_window: int | None = None,
  query_chunk: int = 512,
) -> jax.Array:  # [batch, kv_heads, group, prompt, head_dim], queries' dtype
  """Softmax attention where query i sees keys j <= i (and i - j < sliding_window).

  Rows are compact (padding after each row's length); padding keys are only ever seen by
  padding queries, whose outputs nobody reads.
  """
  if sliding_window is not None:
    check_count("sliding_window", sliding_window, 1)
  check_count("query_chunk", query_chunk, 1)
  prompt_len = queries.shape[3]
  chunk = min(query_chunk, prompt_len)
  num_chunks = -(-prompt_len // chunk)
  padded_len = num_chunks * chunk
  padded_queries = jnp.pad(queries, ((0, 0),) * 3 + ((0, padded_len - prompt_len), (0, 0)))
  key_positions = jnp.arange(prompt_len)
  keys32 = keys.astype(jnp.float32)
  values32 = values.astype(jnp.float32)

  def attend_chunk(start):
    q = jax.lax.dynamic_slice_in_dim(padded_queries, start, chunk, axis=3).astype(jnp.float32)
    scores = jnp.einsum("bhgqd,bhkd->bhgqk", q, keys32) * sm_scale
    query_positions = start + jnp.arange(chunk)
    visible = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
      visible &= query_positions[:, None] - key_positions[None, :] < sliding_window
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhgqk,bhkd->bhgqd", probs, values32)

  if num_chunks == 1:
    out = attend_chunk(0)
  else:
    outs = jax.lax.map(attend_chunk, jnp.arange(num_chunks) * chunk)  # [chunks, b, h, g, c, d]
    out = jnp.moveaxis(outs, 0, 3).reshape(*queries.shape[:3], padded_len, queries.shape[-1])
  return out[..., :prompt_len, :].astype(queries.dtype)
