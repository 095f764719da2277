"""Attention of a prompt chunk's queries: over what a cache already holds, and within the chunk.

In chunked prefill (`kvjax.chunked_prefill`) the C queries of a chunk see every token the
cache holds (all earlier than the chunk) plus the chunk's own tokens causally. The two parts
are computed apart, each with its log-sum-exp, and merged exactly
(`merge_attention_partials`).

Over the held tokens every query of the chunk sees the same keys, so a cache reuses its
one-query-position attention with the chunk folded into the query-group axis
(`attend_folded_chunk`). That is the jnp reference on every backend: C query positions make
this a matmul-shaped (compute-bound) product XLA does well, where the decode kernels are built
for one position.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from einops import rearrange

from pallas_kernels.decode_attention_reference import (
  decode_attention_reference,
  merge_attention_partials,
)

# Queries attended together over the held tokens: bounds the scores to
# [batch, kv_heads, group * QUERY_BLOCK, held] floats whatever the chunk size.
QUERY_BLOCK = 128


def attend_folded_chunk(
  attend_one_position: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
  queries: jax.Array,  # [batch, kv_heads, group, chunk, head_dim]
) -> tuple[jax.Array, jax.Array]:  # (out f32 [b, h, g, chunk, d], lse f32 [b, h, g, chunk])
  """`attend_one_position(q [b, h, G, d]) -> (out, lse)`, applied to the chunk's queries as if
  they were more query heads of each KV head, QUERY_BLOCK positions at a time."""
  batch, kv_heads, group, chunk, head_dim = queries.shape
  block = min(QUERY_BLOCK, chunk)
  blocks = -(-chunk // block)
  padded = jnp.pad(queries, ((0, 0),) * 3 + ((0, blocks * block - chunk), (0, 0)))
  stacked = rearrange(padded, "b h g (n c) d -> n b h (g c) d", c=block)
  out, lse = jax.lax.map(attend_one_position, stacked)
  out = rearrange(out, "n b h (g c) d -> b h g (n c) d", g=group)[:, :, :, :chunk]
  lse = rearrange(lse, "n b h (g c) -> b h g (n c)", g=group)[:, :, :, :chunk]
  return out, lse


def attend_chunk_over_slots(
  queries: jax.Array,  # [batch, kv_heads, group, chunk, head_dim]
  keys: jax.Array,  # [batch, kv_heads, slots, head_dim]
  values: jax.Array,  # [batch, kv_heads, slots, head_dim]
  lengths: jax.Array,  # int32 [batch]: slots [0, length) hold tokens every query sees
  *,
  sm_scale: float,
) -> tuple[jax.Array, jax.Array]:  # (out f32 [b, h, g, chunk, d], lse f32 [b, h, g, chunk])
  """A chunk's queries over a full-precision segment whose valid slots all precede the chunk."""
  return attend_folded_chunk(
    lambda q: decode_attention_reference(q, keys, values, lengths, sm_scale=sm_scale), queries
  )


def masked_attention(
  queries: jax.Array,  # [batch, kv_heads, group, chunk, head_dim]
  keys: jax.Array,  # [batch, kv_heads, slots, head_dim]
  values: jax.Array,  # [batch, kv_heads, slots, head_dim]
  visible: jax.Array,  # bool [batch, chunk, slots]: which slots each query position sees
  *,
  sm_scale: float,
) -> tuple[jax.Array, jax.Array]:  # (out f32 [b, h, g, chunk, d], lse f32 [b, h, g, chunk])
  """Softmax attention restricted to `visible`; a query that sees nothing gives out 0, lse
  -inf. Slots that no query of the chunk sees may hold anything, NaN included; a NaN in a slot
  some query sees reaches every query of that row (0 * NaN in the weighted sum), as it would
  in one query's attention over it."""
  scores = jnp.einsum("bhgcd,bhsd->bhgcs", queries.astype(jnp.float32), keys.astype(jnp.float32))
  mask = visible[:, None, None]
  scores = jnp.where(mask, scores * sm_scale, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1)
  safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  probs = jnp.where(mask, jnp.exp(scores - safe_lse[..., None]), 0.0)
  seen = jnp.any(visible, axis=1)[:, None, :, None]  # [b, 1, slots, 1]
  values = jnp.where(seen, values.astype(jnp.float32), 0.0)
  return jnp.einsum("bhgcs,bhsd->bhgcd", probs, values), lse


def causal_chunk_visibility(
  chunk: int, batch: int, *, sliding_window: int | None
) -> jax.Array:  # bool [batch, chunk, chunk]
  """Chunk query i sees chunk key j when j <= i (and i - j < sliding_window)."""
  query, key = jnp.arange(chunk)[:, None], jnp.arange(chunk)[None, :]
  visible = key <= query
  if sliding_window is not None:
    visible &= query - key < sliding_window
  return jnp.broadcast_to(visible, (batch, chunk, chunk))


def chunk_attention(
  held: tuple[jax.Array, jax.Array],  # (out [b, h, g, c, d], lse [b, h, g, c]) over held tokens
  queries: jax.Array,  # [batch, kv_heads, group, chunk, head_dim]
  keys: jax.Array,  # [batch, kv_heads, chunk, head_dim]
  values: jax.Array,
  *,
  sm_scale: float,
  sliding_window: int | None,
) -> jax.Array:  # [batch, kv_heads, group, chunk, head_dim] float32
  """The chunk's attention over held tokens merged with its causal attention over itself."""
  visible = causal_chunk_visibility(keys.shape[2], keys.shape[0], sliding_window=sliding_window)
  own = masked_attention(queries, keys, values, visible, sm_scale=sm_scale)
  out, _ = merge_attention_partials([held, own])
  return out
