"""Causal self-attention over a whole prompt, chunked over queries.

Chunking bounds memory at `[batch, heads, query_chunk, prompt]` scores, so an 8k prompt never
builds the prompt x prompt matrix for all heads at once.
"""

import jax
import jax.numpy as jnp

from kvjax.cache_protocol import check_count


def over_query_chunks(
  attend_chunk,  # (queries [batch, kv_heads, group, chunk, head_dim], start) -> the same shape
  queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim]
  *,
  query_chunk: int,
) -> jax.Array:  # [batch, kv_heads, group, prompt, head_dim]
  """`attend_chunk` over the prompt's queries `query_chunk` at a time (the last chunk padded),
  joined back in order."""
  prompt_len = queries.shape[3]
  chunk = min(query_chunk, prompt_len)
  num_chunks = -(-prompt_len // chunk)
  padded_len = num_chunks * chunk
  padded_queries = jnp.pad(queries, ((0, 0),) * 3 + ((0, padded_len - prompt_len), (0, 0)))

  def run(start):
    return attend_chunk(jax.lax.dynamic_slice_in_dim(padded_queries, start, chunk, axis=3), start)

  if num_chunks == 1:
    out = run(0)
  else:
    outs = jax.lax.map(run, jnp.arange(num_chunks) * chunk)  # [chunks, b, h, g, c, d]
    out = jnp.moveaxis(outs, 0, 3).reshape(*queries.shape[:3], padded_len, queries.shape[-1])
  return out[..., :prompt_len, :]


def causal_prompt_attention(
  queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim]
  keys: jax.Array,  # [batch, kv_heads, prompt, head_dim]
  values: jax.Array,  # [batch, kv_heads, prompt, head_dim]
  *,
  sm_scale: float,
  sliding_window: int | None = None,
  query_chunk: int = 512,
  streaming_heads: tuple[bool, ...] | None = None,
  sinks: int = 0,
  recent: int | None = None,
) -> jax.Array:  # [batch, kv_heads, group, prompt, head_dim], queries' dtype
  """Softmax attention where query i sees keys j <= i (and i - j < sliding_window); on the KV
  heads flagged in `streaming_heads` only the first `sinks` of those and the last `recent`
  (i - j < recent: DuoAttention's streaming heads).

  Rows are compact (padding after each row's length); padding keys are only ever seen by
  padding queries, whose outputs nobody reads.
  """
  if sliding_window is not None:
    check_count("sliding_window", sliding_window, 1)
  check_count("query_chunk", query_chunk, 1)
  if streaming_heads is not None:
    if len(streaming_heads) != keys.shape[1]:
      raise ValueError(
        f"streaming_heads has {len(streaming_heads)} flags; the keys have {keys.shape[1]} heads"
      )
    check_count("sinks", sinks, 0)
    check_count("recent", recent, 1)
  key_positions = jnp.arange(keys.shape[2])
  keys32 = keys.astype(jnp.float32)
  values32 = values.astype(jnp.float32)

  def attend_chunk(q, start):
    scores = jnp.einsum("bhgqd,bhkd->bhgqk", q.astype(jnp.float32), keys32) * sm_scale
    distance = (start + jnp.arange(q.shape[3]))[:, None] - key_positions[None, :]
    visible = distance >= 0
    if sliding_window is not None:
      visible &= distance < sliding_window
    if streaming_heads is not None:
      in_span = (key_positions[None, :] < sinks) | (distance < recent)
      streaming = jnp.asarray(streaming_heads)[:, None, None, None]  # [heads, 1, 1, 1]
      visible = visible & (~streaming | in_span)
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhgqk,bhkd->bhgqd", probs, values32)

  return over_query_chunks(attend_chunk, queries, query_chunk=query_chunk).astype(queries.dtype)


def cache_prompt_attention(
  cache,  # the layer's freshly allocated cache
  queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim], rotated
  keys: jax.Array,  # [batch, kv_heads, prompt, head_dim], rotated
  values: jax.Array,  # [batch, kv_heads, prompt, head_dim]
  lengths: jax.Array,  # int32 [batch]
  *,
  sm_scale: float,
  sliding_window: int | None = None,
) -> jax.Array:  # [batch, kv_heads, group, prompt, head_dim], queries' dtype
  """The prompt's attention as the layer's cache asks for it: its own `prompt_attention` when it
  has one (DuoAttention's streaming heads see only their sinks and recent tokens, as their gates
  were trained; gate training mixes both), else causal attention. A decoder whose prefill
  computes every layer's prompt attention with this says so (`honours_prompt_attention`,
  kvjax.decoder_protocol)."""
  own = getattr(cache, "prompt_attention", None)
  if own is None:
    return causal_prompt_attention(
      queries, keys, values, sm_scale=sm_scale, sliding_window=sliding_window
    )
  return own(queries, keys, values, lengths, sm_scale=sm_scale, sliding_window=sliding_window)
