"""A layer cache read by several rows at once: one context row's caches, held once, plus each
row's own tokens after it (`kvjax.compressed_context.share_context` makes them).

Row `b * copies + j` is copy j of context row b. A decode step's query of that row attends over
context row b's cache and over the row's own tokens; the two parts are merged by log-sum-exp.
The `copies` queries of one context row are folded into the query-group axis of a single call
of the context cache's `attend_with_lse`, as more query heads of each KV head: the context is
read once per step for all its copies, with the same kernel (or reference) that decodes it
alone.

The context's cache is never written: tokens appended after it go to `own`, a full-precision
cache of `room` tokens per row, and are never quantized or evicted. Tokens fed in chunks
(`continue_context(feed_chunk=...)`) go there too: a chunk's queries are folded, with the
copies, into the query-group axis of the context's `attend_with_lse` (kvjax.chunk_attention).
"""

import dataclasses
from typing import Any

import jax
from einops import rearrange

from kvjax.chunk_attention import attend_folded_chunk
from kvjax.dense_cache import DenseLayerCache
from pallas_kernels.decode_attention_reference import merge_attention_partials


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedContextLayerCache:
  context: Any  # a layer cache of the context's rows [batch, ...], frozen
  own: DenseLayerCache  # [batch * copies, kv_heads, room, head_dim]: tokens appended after it
  copies: int = dataclasses.field(metadata=dict(static=True))

  @property
  def lengths(self) -> jax.Array:  # int32 [batch * copies]: tokens appended after the context
    return self.own.lengths

  @property
  def room(self) -> jax.Array:  # int32 [batch * copies]: tokens each row can still append
    return self.own.room

  def ingest(self, keys, values, queries, lengths):
    raise ValueError(
      "a shared context holds a prefilled prompt already: feed tokens after it with "
      "kvjax.continue_context (or decode steps)"
    )

  def append(self, keys, values):
    return dataclasses.replace(self, own=self.own.append(keys, values))

  def _attend_context(self, queries, *, sm_scale):
    """(out, lse) of queries [rows, h, g, d] over their context rows, read once per row."""
    fold = dict(n=self.copies)
    folded = rearrange(queries, "(b n) h g d -> b h (n g) d", **fold)
    out, lse = self.context.attend_with_lse(folded, sm_scale=sm_scale)
    return (
      rearrange(out, "b h (n g) d -> (b n) h g d", **fold),
      rearrange(lse, "b h (n g) -> (b n) h g", **fold),
    )

  def attend_with_lse(self, queries, *, sm_scale):
    """(out, lse) of one query position per row over its context row and its own tokens."""
    return merge_attention_partials(
      [
        self._attend_context(queries, sm_scale=sm_scale),
        self.own.attend_with_lse(queries, sm_scale=sm_scale),
      ]
    )

  def attend(self, queries, *, sm_scale):
    return self.attend_with_lse(queries, sm_scale=sm_scale)[0]

  # Tokens fed after the context a chunk at a time (continue_context(feed_chunk=...)): every
  # query of a chunk sees its whole context row and the row's own earlier tokens.

  def attend_chunk(self, queries, *, sm_scale):
    """(out, lse) of a chunk's queries [rows, h, g, chunk, d] over the context row and the
    row's own tokens held (all precede the chunk)."""
    context_part = attend_folded_chunk(
      lambda q: self._attend_context(q, sm_scale=sm_scale), queries
    )
    return merge_attention_partials(
      [context_part, self.own.attend_chunk(queries, sm_scale=sm_scale)]
    )

  def ingest_chunk(self, keys, values, queries, counts):
    """The chunk's first `counts[b]` tokens appended to row b's own tokens, as computed."""
    return dataclasses.replace(self, own=self.own.ingest_chunk(keys, values, queries, counts))

  @property
  def nbytes(self) -> int:
    return self.context.nbytes + self.own.nbytes

  @property
  def stored_elements(self) -> int:
    return self.context.stored_elements + self.own.stored_elements


def shared_context_refusal(cache) -> str | None:
  """Why `cache` (a context's layer cache) cannot be shared by several rows, or None."""
  if callable(getattr(cache, "append_and_attend", None)):
    return (
      f"{type(cache).__name__} evicts by the attention of each decode step, row by row, which "
      "a context held once for many rows cannot do; use kvjax.repeat_context"
    )
  if not callable(getattr(cache, "attend_with_lse", None)):
    return (
      f"{type(cache).__name__} has no attend_with_lse (kvjax.cache_protocol), which merges "
      "the context's attention with each row's own tokens; use kvjax.repeat_context"
    )
  return None
