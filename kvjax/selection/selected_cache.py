"""The layer cache of a prefill-time token selection: chosen tokens only, in an inner storage cache.

At `ingest` a *selector* (static configuration: SnapKV's observation window, H2O's accumulated
attention) picks `budget` tokens per KV head; their K/V are gathered (in original order) and
handed to the inner storage cache, which was allocated with room for exactly
`budget + max_new_tokens` tokens. Decoding appends and attends through the inner cache, so a
codec storage (`kivi`, `gear`) composes unchanged and the bytes are those of the kept tokens.

Chunked prefill (kvjax.chunked_prefill): after each chunk, the held tokens and the chunk's
compete for the budget again, which needs the held ones as computed. With a codec storage the
candidates are therefore held in a full-precision scratch cache of `budget` tokens while the
chunks run (`begin_chunks`), and handed to the codec once, after the last chunk (`end_chunks`):
the codec then stores exactly what a one-piece prefill with the same choice would store.
"""

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from einops import rearrange

from kvjax.cache_protocol import ModelCacheShape, check_prompt_width
from kvjax.compact_rows import held_then_chunk
from kvjax.dense_cache import DenseLayerCache, FullCache
from kvjax.selection.budgets import check_full_attention_model
from kvjax.selection.token_choice import gather_tokens


class TokenSelector(Protocol):
  """Hashable static configuration that picks each KV head's kept prompt tokens."""

  budget: int  # prompt tokens kept per KV head (static)

  def kept_indices(
    self,
    keys: jax.Array,  # [batch, kv_heads, prompt, head_dim]
    queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim]
    lengths: jax.Array,  # int32 [batch]
  ) -> tuple[jax.Array, jax.Array]:  # (int32 [batch, kv_heads, budget] ascending, int32 [batch])
    ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SelectedLayerCache:
  storage: Any  # inner layer cache with capacity budget + max_new_tokens
  selector: Any = dataclasses.field(metadata=dict(static=True))  # a TokenSelector
  # Chunked prefill with a codec storage only: the candidates in full precision (module doc).
  scratch: DenseLayerCache | None = None
  # (kv_heads, head_dim, dtype name) of that scratch; None when the storage is full. No batch:
  # static metadata must not depend on it (kvjax.row_sharding finds batch axes by shapes).
  scratch_layout: tuple | None = dataclasses.field(default=None, metadata=dict(static=True))
  # The prompt_len it was allocated for where that sized the selector's budget (a ratio of it,
  # or a budget capped at it): a wider prompt is refused (`check_prompt_width`). None where the
  # budget does not depend on it, so that caches of one budget share their compiled programs.
  allocated_prompt_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  @property
  def lengths(self) -> jax.Array:  # int32 [batch]: tokens held per row
    return self.storage.lengths

  @property
  def room(self) -> jax.Array | None:  # int32 [batch], or None when the storage evicts
    return getattr(self.storage, "room", None)

  def ingest(self, keys, values, queries, lengths):
    check_prompt_width(
      f"selection cache ({type(self.selector).__qualname__})",
      keys.shape[2],
      self.allocated_prompt_len,
    )
    if self.selector.budget >= keys.shape[2]:  # nothing to score, keep every token
      storage = self.storage.ingest(keys, values, None, lengths)
    else:
      indices, kept_lengths = self.selector.kept_indices(keys, queries, lengths)
      storage = self.storage.ingest(
        gather_tokens(keys, indices), gather_tokens(values, indices), None, kept_lengths
      )
    return dataclasses.replace(self, storage=storage)

  @property
  def chunked_prefill_refusal(self) -> str | None:
    """Why this cache cannot take a prompt in chunks (kvjax.chunked_prefill), or None."""
    if not hasattr(self.selector, "kept_indices_of_candidates"):
      return (
        f"{type(self.selector).__qualname__} scores the whole prompt at once (for H2O chunk "
        "by chunk, use h2o_decode, which accumulates its scores)"
      )
    return None

  @property
  def chunk_room(self) -> None:
    """No bound on the prompt tokens it takes in chunks: they compete with the held ones for
    the budget (`chunked_prefill`), however many come."""
    return None

  @property
  def chunked_continuation_refusal(self) -> str | None:
    """Why a prefilled cache cannot take more tokens in chunks (`prefill_in_chunks` with
    offsets), or None: with a codec storage the candidates start in an empty full-precision
    scratch and replace the storage after the last chunk, which would drop what it holds."""
    if self.scratch_layout is None:
      return None
    return (
      "a selection with a codec storage keeps its candidates in a full-precision scratch that "
      "starts empty and replaces the storage when the prompt ends, so continuing a prefilled "
      "cache in chunks would drop the tokens it holds; continue it by decode steps, or use "
      "full storage"
    )

  @property
  def _candidates(self) -> DenseLayerCache:
    """Where chunked prefill keeps the held tokens as computed."""
    return self.storage if self.scratch is None else self.scratch

  def begin_chunks(self) -> "SelectedLayerCache":
    """Before the first chunk: a full-precision scratch for the candidates when the storage is
    a codec (a full storage holds them itself)."""
    if self.scratch_layout is None:
      return self
    kv_heads, head_dim, dtype = self.scratch_layout
    scratch = FullCache().allocate_storage(
      batch=self.storage.lengths.shape[0],
      kv_heads=kv_heads,
      capacity=self.selector.budget,
      head_dim=head_dim,
      dtype=jnp.dtype(dtype),
    )
    return dataclasses.replace(self, scratch=scratch)

  def end_chunks(self) -> "SelectedLayerCache":
    """After the last chunk: the chosen tokens handed to the codec storage, scratch dropped."""
    if self.scratch is None:
      return self
    scratch = self.scratch
    storage = self.storage.ingest(scratch.keys, scratch.values, None, scratch.lengths)
    return dataclasses.replace(self, storage=storage, scratch=None)

  def ingest_chunk(self, keys, values, queries, counts):
    """Chunked prefill: the held tokens and the chunk's first `counts[b]` compete for the
    budget (the selector's `kept_indices_of_candidates`), and the kept ones are held."""
    refusal = self.chunked_prefill_refusal
    if refusal is not None:
      raise ValueError(f"chunked prefill: {refusal}")
    held = self._candidates
    after_held = lambda stored, new: held_then_chunk(stored, new, held.lengths, counts)

    batch, kv_heads, group, _, head_dim = queries.shape
    # Held tokens have no queries any more: zeros there, never read (`first_query`).
    no_queries = jnp.zeros((batch, kv_heads * group, held.capacity, head_dim), queries.dtype)
    candidate_queries = rearrange(
      after_held(no_queries, rearrange(queries, "b h g c d -> b (h g) c d")),
      "b (h g) t d -> b h g t d",
      g=group,
    )
    # Scored as a one-piece prefill scores them: the chunk's keys unrounded (held ones are
    # stored in the cache dtype already); the kept ones are rounded when held.
    candidate_keys = after_held(held.keys.astype(keys.dtype), keys)
    candidate_values = after_held(held.values, values)
    totals = held.lengths + counts
    indices, kept_lengths = self.selector.kept_indices_of_candidates(
      candidate_keys, candidate_queries, totals, held.lengths
    )
    held = held.ingest(
      gather_tokens(candidate_keys, indices),
      gather_tokens(candidate_values, indices),
      None,
      kept_lengths,
    )
    if self.scratch is None:
      return dataclasses.replace(self, storage=held)
    return dataclasses.replace(self, scratch=held)

  def attend_chunk(self, queries, *, sm_scale):
    return self._candidates.attend_chunk(queries, sm_scale=sm_scale)

  def append(self, keys, values):
    return dataclasses.replace(self, storage=self.storage.append(keys, values))

  def attend(self, queries, *, sm_scale):
    return self.storage.attend(queries, sm_scale=sm_scale)

  def attend_with_lse(self, queries, *, sm_scale):
    return self.storage.attend_with_lse(queries, sm_scale=sm_scale)

  @property
  def nbytes(self) -> int:
    """The storage's bytes, and the candidates' scratch while chunks run."""
    return self.storage.nbytes + (0 if self.scratch is None else self.scratch.nbytes)

  @property
  def stored_elements(self) -> int:
    return self.storage.stored_elements


def allocate_selected_cache(
  method: str,
  storage_method,
  shape: ModelCacheShape,
  selector,
  *,
  batch: int,
  prompt_len: int,
  max_new_tokens: int,
  dtype,
  sized_by_prompt: bool,
) -> SelectedLayerCache:
  """A selection cache whose storage holds exactly `selector.budget + max_new_tokens` tokens.
  `sized_by_prompt`: the method sized the selector's budget from `prompt_len` (a ratio of it, a
  schedule over it); a budget capped at `prompt_len` counts as sized by it too."""
  check_full_attention_model(shape, method, prompt_len + max_new_tokens)
  storage = storage_method.allocate_storage(
    batch=batch,
    kv_heads=shape.num_kv_heads,
    capacity=selector.budget + max_new_tokens,
    head_dim=shape.head_dim,
    dtype=dtype,
  )
  full = isinstance(storage, DenseLayerCache)
  layout = None if full else (shape.num_kv_heads, shape.head_dim, jnp.dtype(dtype).name)
  sized_by_prompt = sized_by_prompt or selector.budget >= prompt_len
  return SelectedLayerCache(
    storage=storage,
    selector=selector,
    scratch_layout=layout,
    allocated_prompt_len=prompt_len if sized_by_prompt else None,
  )
