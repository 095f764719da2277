"""H2O as published: heavy hitters re-scored at every decode step, in a cache that never grows.

Each KV head holds at most `budget` tokens in unordered slots: their K and V, their accumulated
attention and their position. Rule, per row and KV head:
  - prefill: the `h2o` rule (attention every prompt token receives from all later prompt
    queries, softmax in float32, reduced over the query group by `gqa_reduce`; the last
    `window` tokens plus the top-scoring older ones); kept tokens carry their prompt score;
  - each decode step: the new token's query attends over the held tokens and the new token;
    every token's attention probability (reduced over the query group) is added to its score;
    then, if the slots are full, the lowest-scoring token outside the recent window (the last
    `window` tokens, the new one included) is evicted and the new token takes its slot.
  - chunked prefill (`ingest_chunk`): each chunk's queries add their attention to the scores of
    the held tokens and the chunk's, then the same choice as at prefill keeps `budget` of them;
    chunks of one token are exactly decode steps.
Memory is `budget` tokens per KV head (plus a float32 score and an int32 position per slot)
however many tokens are generated; the `h2o` method instead stops evicting after prefill and
holds budget + max_new_tokens.

Decode attention here is jnp (XLA), whatever `implementation` the caller asked for elsewhere:
eviction needs each held token's probability at every step, which kvjax's flash-decoding kernels
do not return. So `h2o_decode` accepts implementation "auto" or "reference" only.
"""

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.cache_protocol import KeyValueArrays, ModelCacheShape, check_prompt_width
from kvjax.chunk_attention import attend_chunk_over_slots
from kvjax.compact_rows import zero_past_lengths
from kvjax.dense_cache import FullCache
from kvjax.h2o import h2o_token_scores
from kvjax.kernel_settings import KernelSettings
from kvjax.method_registry import register_method
from kvjax.selection.budgets import (
  budget_while_decoding,
  check_budget_or_ratio,
  check_full_attention_model,
  check_method_int,
)
from kvjax.selection.pooling import check_gqa_reduce, reduce_query_group
from kvjax.selection.token_choice import gather_tokens, keep_top_tokens_and_window

# The attention of an h2o_decode cache is always computed with jnp (module docstring).
IMPLEMENTATIONS = ("auto", "reference")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeavyHitterEvictionCache(KeyValueArrays):
  keys: jax.Array  # [batch, kv_heads, slots, head_dim], rotated at their original positions
  values: jax.Array  # [batch, kv_heads, slots, head_dim]
  scores: jax.Array  # float32 [batch, kv_heads, slots]: attention each held token has received
  positions: jax.Array  # int32 [batch, kv_heads, slots]: each held token's position in its row
  lengths: jax.Array  # int32 [batch]: slots in use (compact: slots [0, lengths))
  seen: jax.Array  # int32 [batch]: tokens the row has seen (position of its next token)
  window: int = dataclasses.field(metadata=dict(static=True))
  gqa_reduce: str = dataclasses.field(metadata=dict(static=True))
  prompt_sm_scale: float = dataclasses.field(metadata=dict(static=True))
  query_chunk: int = dataclasses.field(metadata=dict(static=True))
  # False when the slots are fewer than the method's budget (the prompt and the new tokens fit
  # in less): evicting there would keep fewer tokens than the budget, so the cache is bounded.
  evicts_when_full: bool = dataclasses.field(default=True, metadata=dict(static=True))
  # The prompt_len it was allocated for where that sized its slots (fewer than the budget, or
  # a budget that is a ratio of it): a wider prompt is refused (`check_prompt_width`). None
  # where they do not depend on it.
  allocated_prompt_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  @classmethod
  def zeros(
    cls,
    *,
    batch,
    kv_heads,
    slots,
    head_dim,
    dtype,
    window,
    gqa_reduce,
    sm_scale,
    query_chunk,
    evicts_when_full=True,
    allocated_prompt_len=None,
  ):
    shape = (batch, kv_heads, slots)
    return cls(
      keys=jnp.zeros((*shape, head_dim), dtype),
      values=jnp.zeros((*shape, head_dim), dtype),
      scores=jnp.zeros(shape, jnp.float32),
      positions=jnp.zeros(shape, jnp.int32),
      lengths=jnp.zeros((batch,), jnp.int32),
      seen=jnp.zeros((batch,), jnp.int32),
      window=window,
      gqa_reduce=gqa_reduce,
      prompt_sm_scale=sm_scale,
      query_chunk=query_chunk,
      evicts_when_full=evicts_when_full,
      allocated_prompt_len=allocated_prompt_len,
    )

  @property
  def slots(self) -> int:
    return self.keys.shape[2]

  @property
  def room(self) -> jax.Array | None:  # int32 [batch], or None once the cache holds its budget
    return None if self.evicts_when_full else self.slots - self.lengths

  @property
  def tokens_seen(self) -> jax.Array:  # int32 [batch]: the position of each row's next token
    return self.seen

  def ingest(self, keys, values, queries, lengths):
    check_prompt_width("h2o_decode", keys.shape[2], self.allocated_prompt_len)
    lengths = lengths.astype(jnp.int32)
    batch, kv_heads, prompt_len, _ = keys.shape
    scores = h2o_token_scores(
      keys,
      queries,
      lengths,
      gqa_reduce=self.gqa_reduce,
      sm_scale=self.prompt_sm_scale,
      query_chunk=self.query_chunk,
    )
    if prompt_len <= self.slots:
      indices = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), scores.shape)
      kept_lengths = lengths
    else:
      indices, kept_lengths = keep_top_tokens_and_window(
        scores, lengths, budget=self.slots, window=self.window
      )
    kept = indices.shape[-1]

    def into_slots(x):  # [batch, kv_heads, kept, ...] -> [batch, kv_heads, slots, ...]
      x = zero_past_lengths(x, kept_lengths)
      return jnp.pad(x, ((0, 0), (0, 0), (0, self.slots - kept)) + ((0, 0),) * (x.ndim - 3))

    return dataclasses.replace(
      self,
      keys=into_slots(gather_tokens(keys, indices)).astype(self.keys.dtype),
      values=into_slots(gather_tokens(values, indices)).astype(self.values.dtype),
      scores=into_slots(jnp.take_along_axis(scores, indices, axis=2)),
      positions=into_slots(indices),
      lengths=kept_lengths,
      seen=lengths,
    )

  def ingest_chunk(self, keys, values, queries, counts):
    """Chunked prefill: each of the chunk's first `counts[b]` queries attends over the held
    tokens and the chunk's tokens up to itself; the attention each token receives (summed
    over the chunk's queries, then reduced over the query group, as at prefill) is added to
    its score; then the held and the chunk's tokens compete for the slots as at prefill: the
    last `window` positions plus the top scores. A prompt in one chunk gets the prefill's
    choice and scores."""
    batch, kv_heads, group, chunk, _ = queries.shape
    q = queries.astype(jnp.float32)
    held_logits = self._held_logits(
      q.reshape(batch, kv_heads, group * chunk, -1), self.prompt_sm_scale
    )
    held_logits = held_logits.reshape(batch, kv_heads, group, chunk, self.slots)
    own_logits = jnp.einsum("bhgcd,bhkd->bhgck", q, keys.astype(jnp.float32)) * self.prompt_sm_scale
    causal = jnp.arange(chunk)[None, :] <= jnp.arange(chunk)[:, None]  # [query, key]
    own_logits = jnp.where(causal, own_logits, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([held_logits, own_logits], axis=-1), axis=-1)
    real_query = (jnp.arange(chunk)[None, :] < counts[:, None])[:, None, None, :, None]
    received = reduce_query_group(jnp.where(real_query, probs, 0.0).sum(axis=3), self.gqa_reduce)

    offsets = jnp.arange(chunk)[None, :]
    positions = jnp.concatenate(
      [
        self.positions,
        jnp.broadcast_to((self.seen[:, None] + offsets)[:, None, :], (batch, kv_heads, chunk)),
      ],
      axis=2,
    )
    scores = jnp.pad(self.scores, ((0, 0), (0, 0), (0, chunk))) + received
    real = jnp.concatenate(
      [jnp.arange(self.slots)[None, :] < self.lengths[:, None], offsets < counts[:, None]], axis=1
    )[:, None, :]  # [batch, 1, slots + chunk]: held tokens and the chunk's real ones
    seen = self.seen + counts
    recent = positions >= (seen - self.window)[:, None, None]
    priority = jnp.where(real, jnp.where(recent, jnp.inf, scores), -jnp.inf)
    _, chosen = jax.lax.top_k(priority, self.slots)
    # Compact: real tokens first (held slots, then the chunk's in order), then the padding.
    candidates = priority.shape[-1]
    is_real = jnp.take_along_axis(jnp.broadcast_to(real, priority.shape), chosen, axis=2)
    chosen = jnp.sort(jnp.where(is_real, chosen, chosen + candidates), axis=-1) % candidates
    kept_lengths = jnp.minimum(self.lengths + counts, self.slots)

    def keep(x):  # [batch, kv_heads, slots + chunk, ...] -> [batch, kv_heads, slots, ...]
      taken = jnp.take_along_axis(x, chosen.reshape(*chosen.shape, *([1] * (x.ndim - 3))), axis=2)
      return zero_past_lengths(taken, kept_lengths)

    return dataclasses.replace(
      self,
      keys=keep(jnp.concatenate([self.keys, keys.astype(self.keys.dtype)], axis=2)),
      values=keep(jnp.concatenate([self.values, values.astype(self.values.dtype)], axis=2)),
      scores=keep(scores),
      positions=keep(positions),
      lengths=kept_lengths,
      seen=seen,
    )

  def attend_chunk(self, queries, *, sm_scale):
    """(out, lse) of a prompt chunk's queries over the held tokens (scores are not updated:
    `ingest_chunk` does that)."""
    return attend_chunk_over_slots(queries, self.keys, self.values, self.lengths, sm_scale=sm_scale)

  def append_and_attend(self, keys, values, queries, *, sm_scale):
    """kvjax.append_and_attend for this cache: attend over held + new, score, evict, store."""
    q = queries.astype(jnp.float32)  # [batch, kv_heads, group, head_dim]
    # As stored: attending to the unrounded new token would differ from the full cache.
    new_key = keys.astype(self.keys.dtype).astype(jnp.float32)
    new_value = values.astype(self.values.dtype).astype(jnp.float32)
    held_logits = self._held_logits(q, sm_scale)
    new_logit = jnp.einsum("bhgd,bhd->bhg", q, new_key) * sm_scale
    top = jnp.maximum(held_logits.max(axis=-1), new_logit)
    held_weights = jnp.exp(held_logits - top[..., None])
    new_weight = jnp.exp(new_logit - top)
    total = held_weights.sum(axis=-1) + new_weight
    attended = (
      jnp.einsum("bhgs,bhsd->bhgd", held_weights, self.values.astype(jnp.float32))
      + new_weight[..., None] * new_value[:, :, None, :]
    ) / total[..., None]

    scores = self.scores + reduce_query_group(held_weights / total[..., None], self.gqa_reduce)
    new_score = reduce_query_group((new_weight / total)[..., None], self.gqa_reduce)[..., 0]
    # The new token is the last of the recent window; older held tokens in it are protected.
    recent = self.positions > (self.seen - self.window)[:, None, None]
    victim = jnp.argmin(jnp.where(recent, jnp.inf, scores), axis=-1)  # [batch, kv_heads]
    full = (self.lengths >= self.slots)[:, None]
    target = jnp.where(full, victim, self.lengths[:, None])
    rows = jnp.arange(target.shape[0])[:, None]
    heads = jnp.arange(target.shape[1])[None, :]

    def place(stored, new):  # new: [batch, kv_heads, ...], one token per (row, head) at target
      return stored.at[rows, heads, target].set(new.astype(stored.dtype))

    cache = dataclasses.replace(
      self,
      keys=place(self.keys, keys),
      values=place(self.values, values),
      scores=place(scores, new_score),
      positions=place(self.positions, jnp.broadcast_to(self.seen[:, None], target.shape)),
      lengths=jnp.minimum(self.lengths + 1, self.slots),
      seen=self.seen + 1,
    )
    return attended, cache

  def append(self, keys, values):
    raise TypeError(
      "h2o_decode chooses what to evict from the attention of each step's query, so a decode "
      "step must store and attend at once: call kvjax.append_and_attend(cache, keys, values, "
      "queries, sm_scale=...) instead of append then attend"
    )

  def attend(self, queries, *, sm_scale):
    """Attention over the held tokens only (a read: scores are not updated)."""
    probs = jax.nn.softmax(self._held_logits(queries.astype(jnp.float32), sm_scale), axis=-1)
    return jnp.einsum("bhgs,bhsd->bhgd", probs, self.values.astype(jnp.float32))

  def _held_logits(self, q, sm_scale):  # float32 [batch, kv_heads, group, slots], -inf unheld
    logits = jnp.einsum("bhgd,bhsd->bhgs", q, self.keys.astype(jnp.float32)) * sm_scale
    held = jnp.arange(self.slots)[None, None, None, :] < self.lengths[:, None, None, None]
    return jnp.where(held, logits, -jnp.inf)


@register_method("h2o_decode", kind="selection")
@dataclasses.dataclass(frozen=True)
class H2ODecode:
  """Cache method `h2o_decode`: H2O re-scored at every decode step (module docstring).

  `budget`: tokens each KV head holds, recent window included, at prefill and during decoding
  alike (default 1024 when neither `budget` nor `ratio` is given); `ratio`: that budget as a
  fraction of the padded (static) prompt length. `window`: recent tokens never evicted (default
  half the budget, the paper's equal heavy and recent shares). A cache has fewer slots when the
  prompt plus the new tokens fit in less; it then reports room and refuses tokens past it.
  Stores its own full-precision slots: composing it with a codec storage is not supported.
  """

  budget: int | None = None
  ratio: float | None = None
  window: int | None = None
  gqa_reduce: str = "mean"
  query_chunk: int = 512
  storage: Any = FullCache()

  def __post_init__(self):
    if self.window is not None:
      check_method_int("h2o_decode", "window", self.window, 1)
    check_method_int("h2o_decode", "query_chunk", self.query_chunk, 1)
    check_budget_or_ratio("h2o_decode", self.budget, self.ratio, **self._smallest_budget())
    check_gqa_reduce("h2o_decode", self.gqa_reduce)
    if type(self.storage) is not FullCache:
      raise ValueError(
        f"h2o_decode: storage {getattr(self.storage, 'method_name', self.storage)!r} is not "
        "supported: it evicts from its own full-precision slots while decoding; use h2o_decode "
        "alone (or h2o+<storage>, which stops evicting after prefill)"
      )
    if self.storage.implementation not in IMPLEMENTATIONS:
      raise ValueError(
        f"h2o_decode: implementation={self.storage.implementation!r}; allowed: "
        f"{', '.join(IMPLEMENTATIONS)} (its decode attention needs every held token's "
        "probability, which the Pallas kernels do not return, so it is always jnp)"
      )
    if self.storage.kernel_settings != KernelSettings():
      # A warning, not an error: a command line's --kernel-settings reaches every method
      # compared, this one too.
      warnings.warn(
        "h2o_decode ignores its kernel_settings: its decode attention is always jnp (it needs "
        "every held token's probability, which the kernels do not return)",
        stacklevel=2,
      )

  def budget_tokens(self, prompt_len: int) -> int:
    """Tokens each KV head holds at most (before capping at prompt + new tokens)."""
    tokens = budget_while_decoding(
      "h2o_decode", self.budget, self.ratio, prompt_len, **self._smallest_budget()
    )
    return max(tokens, self._smallest_budget()["minimum"])

  def _smallest_budget(self) -> dict:
    return dict(minimum=(self.window or 1) + 1, minimum_what="window + 1 (a heavy-hitter slot)")

  def recent_window(self, budget: int) -> int:
    return budget // 2 if self.window is None else self.window

  def allocate(self, shape: ModelCacheShape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    del layer
    budget = self.budget_tokens(prompt_len)
    # Heavy hitters are old tokens: however few slots, they reach past a sliding window.
    check_full_attention_model(shape, "h2o_decode", prompt_len + max_new_tokens)
    slots = min(budget, prompt_len + max_new_tokens)
    return HeavyHitterEvictionCache.zeros(
      batch=batch,
      kv_heads=shape.num_kv_heads,
      slots=slots,
      head_dim=shape.head_dim,
      dtype=dtype,
      window=min(self.recent_window(budget), max(slots - 1, 0)),
      gqa_reduce=self.gqa_reduce,
      sm_scale=shape.head_dim**-0.5,
      query_chunk=self.query_chunk,
      evicts_when_full=slots >= budget,
      allocated_prompt_len=prompt_len if self.ratio is not None or slots < budget else None,
    )
