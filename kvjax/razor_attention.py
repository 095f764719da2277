"""RazorAttention: retrieval heads keep every token; the other heads keep sinks + a local window +
one compensation token.

Per layer, the KV heads are split by a head profile (`kvjax.retrieval_heads.HeadProfile`,
computed once per model and loaded from `profile=PATH`):
  - retrieval heads: a storage cache of `prompt + max_new_tokens` tokens (nothing dropped);
  - the other ("local") heads: a storage cache of `budget + max_new_tokens` tokens, holding per
    row the first `sinks` tokens, one compensation token (key = mean of the dropped keys,
    value = mean of the dropped values), and the last `window = budget - sinks - 1` prompt
    tokens; decode tokens are appended after them.
The two groups live in separate caches with their own static head counts, so a local head
really holds only its window: `nbytes` is the sum of the parts.

Compensation (`compensation=`):
  - "mean" (default; Huawei's deployed code): the compensation token is an ordinary token of
    the local storage, so any storage (full, kivi, gear) composes.
  - "weighted" (the paper): the compensation token counts as the n tokens it replaces — its
    attention logit gets + log(n). It is kept beside the storage in the cache dtype with n per
    row, and merged with the storage's attention by log-sum-exp, which needs a storage that
    reports its log-sum-exp (`full`, `kivi`, `gear`: any layer cache with `attend_with_lse`).
A row is compressed when it has tokens to drop (length > sinks + window); shorter rows keep
every token.

Chunked prefill (kvjax.chunked_prefill): retrieval heads store each chunk in their storage. The
local heads hold their sinks and last `window` tokens in a full-precision buffer of
`sinks + window` tokens (`begin_chunks`), and every token that leaves the window is added to
float32 sums, so the compensation token is the mean of exactly the tokens a one-piece ingest
drops (summed as the cache dtype rounds them, where a one-piece ingest averages them unrounded:
with a bfloat16 cache the two means can differ by a unit in its last place). A chunk's
queries on a local head attend over sinks, window and the compensation token so far (weighted
by its count with "weighted"). After the last
chunk (`end_chunks`) the storage receives sinks, compensation token and window as a one-piece
ingest would hand them over, so a codec storage encodes them once.

`budget` (tokens a local head keeps, sinks and compensation token included) or
`ratio` is a Python int at allocate time, from the padded (static) prompt length.
"""

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.cache_protocol import ModelCacheShape, check_prompt_width, tree_nbytes
from kvjax.compact_rows import held_then_chunk
from kvjax.dense_cache import DenseLayerCache, FullCache
from kvjax.head_split import join_head_partials, join_heads, split_heads
from kvjax.method_registry import register_method
from kvjax.retrieval_heads import HeadProfile
from kvjax.selection.budgets import (
  check_budget_or_ratio,
  check_full_attention_model,
  check_method_int,
  check_storage_method,
  prompt_budget,
)
from pallas_kernels.decode_attention_reference import merge_attention_partials

COMPENSATIONS = ("mean", "weighted")
# Huawei's deployed default: 4 sinks + a local capacity of 256 including the compensation token.
RAZOR_DEFAULT_BUDGET = 260


def keep_sinks_and_window(
  keys: jax.Array,  # [batch, heads, tokens, head_dim]: a row's first `lengths[b]` are tokens
  values: jax.Array,  # [batch, heads, tokens, head_dim]
  lengths: jax.Array,  # int32 [batch]
  *,
  sinks: int,
  window: int,
) -> dict[str, jax.Array]:
  """Each row's first `sinks` and last `window` tokens, in order, and the sums of the others.

  Returns `kept_keys/kept_values [batch, heads, sinks + window, head_dim]`, `kept_lengths
  [batch]` (a row of at most `sinks + window` tokens keeps them all), `dropped_key_sums/
  dropped_value_sums float32 [batch, heads, head_dim]` (positions [sinks, length - window)) and
  `dropped_counts int32 [batch]`.
  """
  tokens = keys.shape[2]
  dropped_counts = jnp.maximum(lengths - sinks - window, 0).astype(jnp.int32)
  compressed = dropped_counts > 0
  slots = jnp.arange(sinks + window)[None, :]
  window_start = (lengths - window)[:, None]
  source = jnp.where(slots < sinks, slots, window_start + slots - sinks)
  source = jnp.clip(jnp.where(compressed[:, None], source, slots), 0, tokens - 1)
  positions = jnp.arange(tokens)[None, :]
  dropped = ((positions >= sinks) & (positions < window_start)).astype(jnp.float32)  # [b, t]
  dropped_sum = lambda x: jnp.einsum("bhtd,bt->bhd", x.astype(jnp.float32), dropped)
  return dict(
    kept_keys=jnp.take_along_axis(keys, source[:, None, :, None], axis=2),
    kept_values=jnp.take_along_axis(values, source[:, None, :, None], axis=2),
    kept_lengths=jnp.minimum(lengths, sinks + window).astype(jnp.int32),
    dropped_key_sums=dropped_sum(keys),
    dropped_value_sums=dropped_sum(values),
    dropped_counts=dropped_counts,
  )


def mean_of_dropped(sums: jax.Array, counts: jax.Array) -> jax.Array:
  """float32 [batch, heads, head_dim] means (zeros where nothing was dropped)."""
  return sums / jnp.maximum(counts, 1).astype(jnp.float32)[:, None, None]


def with_compensation_token(
  kept_keys: jax.Array,  # [batch, heads, sinks + window, head_dim]
  kept_values: jax.Array,
  kept_lengths: jax.Array,  # int32 [batch]
  compensation_keys: jax.Array,  # [batch, heads, head_dim]
  compensation_values: jax.Array,
  dropped_counts: jax.Array,  # int32 [batch]
  *,
  sinks: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # [b, h, sinks + 1 + window, d] twice, lengths
  """The compensation token stored as an ordinary token at slot `sinks` of each compressed row
  (its window one slot later); a row with nothing dropped keeps its tokens as they are."""
  compressed = dropped_counts > 0

  def put(kept, token):
    shifted = jnp.concatenate(
      [kept[:, :, :sinks], token[:, :, None].astype(kept.dtype), kept[:, :, sinks:]], axis=2
    )
    unchanged = jnp.pad(kept, ((0, 0), (0, 0), (0, 1), (0, 0)))
    return jnp.where(compressed[:, None, None, None], shifted, unchanged)

  lengths = kept_lengths + compressed.astype(jnp.int32)
  return put(kept_keys, compensation_keys), put(kept_values, compensation_values), lengths


def compensation_partial(
  queries: jax.Array,  # [batch, heads, ..., head_dim]
  compensation_keys: jax.Array,  # [batch, heads, head_dim]
  compensation_values: jax.Array,  # [batch, heads, head_dim]
  dropped_counts: jax.Array,  # int32 [batch]
  *,
  sm_scale: float,
  weighted: bool,
) -> tuple[
  jax.Array, jax.Array
]:  # (out f32 [batch, heads, ..., head_dim], lse [batch, heads, ...])
  """The compensation token as one attention segment, for `merge_attention_partials`: its logit,
  plus log n when it counts as the n tokens it replaces; -inf where nothing was dropped."""
  logits = (
    jnp.einsum(
      "bh...d,bhd->bh...", queries.astype(jnp.float32), compensation_keys.astype(jnp.float32)
    )
    * sm_scale
  )
  counts = dropped_counts.reshape((-1,) + (1,) * (logits.ndim - 1))
  if weighted:
    logits = logits + jnp.log(jnp.maximum(counts, 1).astype(jnp.float32))
  lse = jnp.where(counts > 0, logits, -jnp.inf)
  value = compensation_values.astype(jnp.float32).reshape(
    compensation_values.shape[:2] + (1,) * (queries.ndim - 3) + compensation_values.shape[2:]
  )
  return jnp.broadcast_to(value, queries.shape[:-1] + value.shape[-1:]), lse


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LocalHeadsInChunks:
  """The non-retrieval heads while a prompt arrives in chunks: sinks and window as the cache
  holds them, and the running sums of the tokens dropped so far (float32)."""

  kept: DenseLayerCache  # [batch, local heads, sinks + window, head_dim]
  dropped_key_sums: jax.Array  # float32 [batch, local heads, head_dim]
  dropped_value_sums: jax.Array  # float32 [batch, local heads, head_dim]
  dropped_counts: jax.Array  # int32 [batch]

  def compensation(self, dtype) -> tuple[jax.Array, jax.Array]:
    """The compensation token so far, rounded to the cache's dtype as it will be stored."""
    mean = lambda sums: mean_of_dropped(sums, self.dropped_counts).astype(dtype)
    return mean(self.dropped_key_sums), mean(self.dropped_value_sums)


def supports_lse(storage_cache) -> bool:
  return callable(getattr(storage_cache, "attend_with_lse", None))


def _least_room(*parts) -> jax.Array | None:
  """int32 [batch]: the least room of the parts that report one (None if none does)."""
  rooms = [part.room for part in parts if part is not None and part.room is not None]
  return functools.reduce(jnp.minimum, rooms) if rooms else None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RazorLayerCache:
  retrieval: Any  # storage cache of the retrieval heads [batch, r, prompt + new], or None
  local: Any  # storage cache of the other heads [batch, n, budget + new], or None
  compensation_keys: jax.Array | None  # [batch, n, head_dim] ("weighted" only)
  compensation_values: jax.Array | None  # [batch, n, head_dim] ("weighted" only)
  dropped_counts: jax.Array | None  # int32 [batch]: tokens the compensation token stands for
  retrieval_heads: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  local_heads: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  sinks: int = dataclasses.field(metadata=dict(static=True))
  window: int | None = dataclasses.field(metadata=dict(static=True))  # None: no compression
  compensation: str = dataclasses.field(default="mean", metadata=dict(static=True))
  # Chunked prefill of compressed local heads only (module docstring), between begin_chunks
  # and end_chunks.
  local_in_chunks: LocalHeadsInChunks | None = None
  # (head_dim, dtype name) of that state; None when the local heads are not compressed. No
  # batch: static metadata must not depend on it (kvjax.row_sharding finds batch axes by shapes).
  local_layout: tuple | None = dataclasses.field(default=None, metadata=dict(static=True))
  # The prompt_len it was allocated for where that sized the local heads' budget and storage:
  # a wider prompt is refused (`check_prompt_width`). None where they do not depend on it.
  allocated_prompt_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  @property
  def room(self) -> jax.Array | None:  # int32 [batch]: tokens every head's storage can take
    return _least_room(self.retrieval, self.local)

  @property
  def chunk_room(self) -> jax.Array | None:
    """int32 [batch]: prompt tokens every head can take in chunks (`chunked_prefill`). Compressed
    local heads keep a sinks-and-window buffer between `begin_chunks` and `end_chunks`, whatever
    the prompt, and their storage receives only that: the retrieval heads bound it."""
    return _least_room(self.retrieval, None if self._compresses_local_heads else self.local)

  def _split(self, x):  # heads on axis 1 -> (retrieval part, local part)
    return split_heads(x, self.retrieval_heads, self.local_heads)

  def _join(self, retrieval_part, local_part):  # the inverse of _split
    return join_heads(retrieval_part, local_part, self.retrieval_heads, self.local_heads)

  def _join_partials(self, retrieval, local):  # (out, lse) of either part, or None
    return join_head_partials(retrieval, local, self.retrieval_heads, self.local_heads)

  @property
  def _compresses_local_heads(self) -> bool:
    return self.local is not None and self.window is not None

  def ingest(self, keys, values, queries, lengths):
    del queries  # the split is fixed by the head profile
    check_prompt_width("razor", keys.shape[2], self.allocated_prompt_len)
    lengths = lengths.astype(jnp.int32)
    (retrieval_keys, local_keys), (retrieval_values, local_values) = (
      self._split(keys),
      self._split(values),
    )
    updates = {}
    if self.retrieval is not None:
      updates["retrieval"] = self.retrieval.ingest(retrieval_keys, retrieval_values, None, lengths)
    if self.local is not None and not self._compresses_local_heads:
      updates["local"] = self.local.ingest(local_keys, local_values, None, lengths)
    elif self.local is not None:
      part = keep_sinks_and_window(
        local_keys, local_values, lengths, sinks=self.sinks, window=self.window
      )
      updates.update(
        self._local_storage_of(
          part["kept_keys"],
          part["kept_values"],
          part["kept_lengths"],
          mean_of_dropped(part["dropped_key_sums"], part["dropped_counts"]),
          mean_of_dropped(part["dropped_value_sums"], part["dropped_counts"]),
          part["dropped_counts"],
        )
      )
    return dataclasses.replace(self, **updates)

  def _local_storage_of(
    self, kept_keys, kept_values, kept_lengths, compensation_keys, compensation_values, counts
  ) -> dict:
    """The fields holding compressed local heads: sinks + window, and the compensation token
    in the storage ("mean") or beside it ("weighted")."""
    if self.compensation == "mean":
      keys, values, lengths = with_compensation_token(
        kept_keys,
        kept_values,
        kept_lengths,
        compensation_keys,
        compensation_values,
        counts,
        sinks=self.sinks,
      )
      return dict(local=self.local.ingest(keys, values, None, lengths))
    return dict(
      local=self.local.ingest(kept_keys, kept_values, None, kept_lengths),
      compensation_keys=compensation_keys.astype(self.compensation_keys.dtype),
      compensation_values=compensation_values.astype(self.compensation_values.dtype),
      dropped_counts=counts,
    )

  # --- chunked prefill (kvjax.chunked_prefill) ---------------------------------------------

  @property
  def chunked_prefill_refusal(self) -> str | None:
    for part in (self.retrieval, None if self._compresses_local_heads else self.local):
      if part is not None and not hasattr(part, "ingest_chunk"):
        return f"razor's storage {type(part).__name__} cannot take a prompt in chunks"
    return None

  @property
  def chunked_continuation_refusal(self) -> str | None:
    """Why a prefilled cache cannot take more tokens in chunks (`prefill_in_chunks` with
    offsets), or None."""
    if not self._compresses_local_heads:
      return None
    return (
      "razor's compressed local heads start a chunked prefill from an empty sinks-and-window "
      "buffer and store it when the prompt ends, so continuing a prefilled cache in chunks "
      "would drop the tokens they hold; continue it by decode steps"
    )

  def begin_chunks(self) -> "RazorLayerCache":
    """Before the first chunk: compressed local heads hold their sinks and window in a
    full-precision buffer of `sinks + window` tokens, and the sums of what they drop."""
    if not self._compresses_local_heads:
      return self
    head_dim, dtype = self.local_layout
    batch, heads = self.local.lengths.shape[0], len(self.local_heads)
    sums = jnp.zeros((batch, heads, head_dim), jnp.float32)
    state = LocalHeadsInChunks(
      kept=FullCache().allocate_storage(
        batch=batch,
        kv_heads=heads,
        capacity=self.sinks + self.window,
        head_dim=head_dim,
        dtype=jnp.dtype(dtype),
      ),
      dropped_key_sums=sums,
      dropped_value_sums=sums,
      dropped_counts=jnp.zeros((batch,), jnp.int32),
    )
    return dataclasses.replace(self, local_in_chunks=state)

  def end_chunks(self) -> "RazorLayerCache":
    """After the last chunk: the local heads' sinks, window and compensation token (the mean of
    every dropped token) stored as a one-piece ingest stores them."""
    state = self.local_in_chunks
    if state is None:
      return self
    compensation_keys, compensation_values = state.compensation(state.kept.keys.dtype)
    updates = self._local_storage_of(
      state.kept.keys,
      state.kept.values,
      state.kept.lengths,
      compensation_keys,
      compensation_values,
      state.dropped_counts,
    )
    return dataclasses.replace(self, local_in_chunks=None, **updates)

  def ingest_chunk(self, keys, values, queries, counts):
    """Retrieval heads store the chunk; compressed local heads keep their sinks and the last
    `window` of held + chunk tokens, adding the tokens that leave the window to the sums."""
    del queries
    (retrieval_keys, local_keys), (retrieval_values, local_values) = (
      self._split(keys),
      self._split(values),
    )
    updates = {}
    if self.retrieval is not None:
      updates["retrieval"] = self.retrieval.ingest_chunk(
        retrieval_keys, retrieval_values, None, counts
      )
    if self.local is not None and not self._compresses_local_heads:
      updates["local"] = self.local.ingest_chunk(local_keys, local_values, None, counts)
    elif self.local is not None:
      state = self.local_in_chunks
      held = state.kept
      # Cast first: the sums are of the tokens as the cache holds them, wherever they drop.
      candidates = lambda stored, new: held_then_chunk(
        stored, new.astype(stored.dtype), held.lengths, counts
      )
      part = keep_sinks_and_window(
        candidates(held.keys, local_keys),
        candidates(held.values, local_values),
        held.lengths + counts,
        sinks=self.sinks,
        window=self.window,
      )
      updates["local_in_chunks"] = LocalHeadsInChunks(
        kept=held.ingest(part["kept_keys"], part["kept_values"], None, part["kept_lengths"]),
        dropped_key_sums=state.dropped_key_sums + part["dropped_key_sums"],
        dropped_value_sums=state.dropped_value_sums + part["dropped_value_sums"],
        dropped_counts=state.dropped_counts + part["dropped_counts"],
      )
    return dataclasses.replace(self, **updates)

  def attend_chunk(self, queries, *, sm_scale):
    """(out, lse) of a chunk's queries [b, heads, group, chunk, d] over what each head holds:
    every earlier token (retrieval heads), or sinks + window + the compensation token so far."""
    retrieval_queries, local_queries = self._split(queries)
    retrieval = local = None
    if self.retrieval is not None:
      retrieval = self.retrieval.attend_chunk(retrieval_queries, sm_scale=sm_scale)
    if self.local is not None and not self._compresses_local_heads:
      local = self.local.attend_chunk(local_queries, sm_scale=sm_scale)
    elif self.local is not None:
      state = self.local_in_chunks
      held = state.kept.attend_chunk(local_queries, sm_scale=sm_scale)
      compensation = compensation_partial(
        local_queries,
        *state.compensation(state.kept.keys.dtype),
        state.dropped_counts,
        sm_scale=sm_scale,
        weighted=self.compensation == "weighted",
      )
      local = merge_attention_partials([held, compensation])
    return self._join_partials(retrieval, local)

  # --- decoding -----------------------------------------------------------------------------

  def append(self, keys, values):
    (retrieval_keys, local_keys), (retrieval_values, local_values) = (
      self._split(keys),
      self._split(values),
    )
    updates = {}
    if self.retrieval is not None:
      updates["retrieval"] = self.retrieval.append(retrieval_keys, retrieval_values)
    if self.local is not None:
      updates["local"] = self.local.append(local_keys, local_values)
    return dataclasses.replace(self, **updates)

  def _attend_local_with_lse(self, queries, sm_scale):
    held = self.local.attend_with_lse(queries, sm_scale=sm_scale)
    if self.compensation_keys is None:
      return held
    return merge_attention_partials(
      [
        held,
        compensation_partial(
          queries,
          self.compensation_keys,
          self.compensation_values,
          self.dropped_counts,
          sm_scale=sm_scale,
          weighted=True,
        ),
      ]
    )

  def attend(self, queries, *, sm_scale):
    if self.compensation_keys is None:
      # Storages need not report their log-sum-exp unless compensation=weighted merges by it.
      retrieval_queries, local_queries = self._split(queries)
      return self._join(
        None
        if self.retrieval is None
        else self.retrieval.attend(retrieval_queries, sm_scale=sm_scale),
        None if self.local is None else self.local.attend(local_queries, sm_scale=sm_scale),
      )
    return self.attend_with_lse(queries, sm_scale=sm_scale)[0]

  def attend_with_lse(self, queries, *, sm_scale):
    """(out, lse) of one query position per row: each head over what it holds (a local head's
    compensation token counted as `dropped_counts` tokens with compensation=weighted)."""
    retrieval_queries, local_queries = self._split(queries)
    retrieval = (
      None
      if self.retrieval is None
      else self.retrieval.attend_with_lse(retrieval_queries, sm_scale=sm_scale)
    )
    local = None if self.local is None else self._attend_local_with_lse(local_queries, sm_scale)
    return self._join_partials(retrieval, local)

  @property
  def compensation_nbytes(self) -> int:
    return tree_nbytes((self.compensation_keys, self.compensation_values, self.dropped_counts))

  @property
  def nbytes(self) -> int:
    """Everything held, the local heads' chunked-prefill state too while chunks run."""
    parts = [p.nbytes for p in (self.retrieval, self.local) if p is not None]
    return sum(parts) + self.compensation_nbytes + tree_nbytes(self.local_in_chunks)

  @property
  def stored_elements(self) -> int:
    parts = [p.stored_elements for p in (self.retrieval, self.local) if p is not None]
    extra = sum(x.size for x in (self.compensation_keys, self.compensation_values) if x is not None)
    return sum(parts) + extra


@register_method("razor", kind="selection")
@dataclasses.dataclass(frozen=True)
class RazorAttention:
  """Cache method `razor` (module docstring).

  `profile`: path of the model's head profile JSON (or a `HeadProfile`); `budget`: prompt
  tokens a non-retrieval head keeps, sinks and compensation token included (default 260 when
  neither `budget` nor `ratio` is given); `ratio`: that budget as a fraction of the padded
  prompt; `sinks` (default 4); `compensation`: "mean" | "weighted".
  """

  # Where the heads came from: two paths to equal profiles are one method (`head_profile`).
  profile: str | HeadProfile | None = dataclasses.field(default=None, compare=False)
  budget: int | None = None
  ratio: float | None = None
  sinks: int = 4
  compensation: str = "mean"
  storage: Any = FullCache()
  # Compared and hashed with the rest: the method is a static argument of jit, and a profile
  # file rewritten under the same path must not reuse the programs compiled for the old heads.
  head_profile: HeadProfile = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    check_method_int("razor", "sinks", self.sinks, 0)
    check_budget_or_ratio(
      "razor",
      self.budget,
      self.ratio,
      minimum=self.sinks + 2,
      minimum_what="sinks + a window of 1 + the compensation token",
      default_budget=RAZOR_DEFAULT_BUDGET,
    )
    if self.compensation not in COMPENSATIONS:
      raise ValueError(
        f"razor: compensation={self.compensation!r}; allowed: {', '.join(COMPENSATIONS)}"
      )
    check_storage_method("razor", self.storage)
    object.__setattr__(
      self, "head_profile", HeadProfile.from_method_argument("razor", self.profile)
    )

  def prompt_budget(self, prompt_len: int) -> int:
    budget = self.budget
    if budget is None and self.ratio is None:
      budget = RAZOR_DEFAULT_BUDGET
    return prompt_budget(
      "razor",
      budget,
      self.ratio,
      prompt_len,
      minimum=self.sinks + 2,
      minimum_what="sinks + a window of 1 + the compensation token",
    )

  @property
  def profile_path(self) -> str | None:
    """The file the heads were read from (None for a `HeadProfile` given directly)."""
    return os.fspath(self.profile) if isinstance(self.profile, (str, os.PathLike)) else None

  def allocate(self, shape: ModelCacheShape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    named = f" {self.profile_path!r}" if self.profile_path is not None else ""
    self.head_profile.check_matches(shape, source=f"razor: head profile{named}")
    check_full_attention_model(shape, "razor", prompt_len + max_new_tokens)
    retrieval_heads = self.head_profile.retrieval_heads_of_layer(layer)
    local_heads = tuple(h for h in range(shape.num_kv_heads) if h not in retrieval_heads)
    kept = self.prompt_budget(prompt_len)
    compress = kept < prompt_len
    weighted = compress and self.compensation == "weighted"
    # "weighted" keeps the compensation token beside the storage, so the storage holds one less.
    local_prompt_slots = (kept - 1 if weighted else kept) if compress else prompt_len

    def storage(heads, capacity):
      if not heads:
        return None
      return self.storage.allocate_storage(
        batch=batch,
        kv_heads=len(heads),
        capacity=capacity,
        head_dim=shape.head_dim,
        dtype=dtype,
      )

    local = storage(local_heads, local_prompt_slots + max_new_tokens)
    if weighted and local is not None and not supports_lse(local):
      raise ValueError(
        f"razor: compensation=weighted needs a storage that reports its log-sum-exp (full, "
        f"or a cache with attend_with_lse); {type(local).__name__} does not: use "
        "compensation=mean with this storage"
      )
    compensation_shape = (batch, len(local_heads), shape.head_dim)
    with_compensation = weighted and local is not None
    return RazorLayerCache(
      retrieval=storage(retrieval_heads, prompt_len + max_new_tokens),
      local=local,
      compensation_keys=jnp.zeros(compensation_shape, dtype) if with_compensation else None,
      compensation_values=jnp.zeros(compensation_shape, dtype) if with_compensation else None,
      dropped_counts=jnp.zeros((batch,), jnp.int32) if with_compensation else None,
      retrieval_heads=retrieval_heads,
      local_heads=local_heads,
      sinks=self.sinks,
      window=kept - self.sinks - 1 if compress else None,
      compensation=self.compensation,
      local_layout=(shape.head_dim, jnp.dtype(dtype).name)
      if compress and local is not None
      else None,
      # Sized by the prompt where the budget is a ratio of it or keeps all of it.
      allocated_prompt_len=prompt_len if self.ratio is not None or not compress else None,
    )
