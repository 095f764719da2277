"""H2O (heavy hitters + recent tokens), one-shot at prefill (the KVCache-Factory variant).

Rule (per row, per KV head), when the row is longer than the budget:
  1. every key's accumulated attention: softmax(q·k / sqrt(head_dim)) in float32, causal,
     summed over *all* of the row's prompt queries;
  2. reduced over the KV head's query group (`gqa_reduce` mean, max or sum);
  3. the top-(budget - window) tokens before the recent window are kept (heavy hitters), plus
     the last `window` tokens.
The scores are accumulated over chunks of `query_chunk` queries, so the prompt x prompt matrix
never exists whole. Decoding appends without further eviction, so the cache holds budget +
max_new_tokens; `h2o_decode` (kvjax.h2o_decode) is the original H2O, re-scored at every step
in a cache that stays at the budget. Only the kept K/V are stored (in `storage`).
"""

import dataclasses
from typing import Any

import jax

from kvjax.cache_protocol import ModelCacheShape
from kvjax.dense_cache import FullCache
from kvjax.method_registry import register_method
from kvjax.selection.budgets import (
  check_budget_or_ratio,
  check_method_int,
  check_storage_method,
  prompt_budget,
)
from kvjax.selection.pooling import check_gqa_reduce, reduce_query_group
from kvjax.selection.selected_cache import allocate_selected_cache
from kvjax.selection.token_choice import keep_top_tokens_and_window
from kvjax.selection.window_attention_scores import accumulated_prompt_attention


def h2o_token_scores(
  keys: jax.Array,  # [batch, kv_heads, prompt, head_dim], rotated
  queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim], rotated
  lengths: jax.Array,  # int32 [batch]
  *,
  gqa_reduce: str,
  sm_scale: float,
  query_chunk: int,
) -> jax.Array:  # float32 [batch, kv_heads, prompt]
  accumulated = accumulated_prompt_attention(
    queries, keys, lengths, sm_scale=sm_scale, query_chunk=query_chunk
  )
  return reduce_query_group(accumulated, gqa_reduce)


@dataclasses.dataclass(frozen=True)
class HeavyHitterSelector:
  """H2O's choice for one layer (static: hashable, lives in the cache's metadata)."""

  budget: int
  window: int
  gqa_reduce: str
  sm_scale: float
  query_chunk: int

  def kept_indices(self, keys, queries, lengths):
    scores = h2o_token_scores(
      keys,
      queries,
      lengths,
      gqa_reduce=self.gqa_reduce,
      sm_scale=self.sm_scale,
      query_chunk=self.query_chunk,
    )
    return keep_top_tokens_and_window(scores, lengths, budget=self.budget, window=self.window)


@register_method("h2o", kind="selection")
@dataclasses.dataclass(frozen=True)
class H2O:
  """Cache method `h2o`: heavy hitters by accumulated prompt attention + a recent window.

  `budget`: prompt tokens each KV head keeps, recent window included, at least `window` + 1 (a
  heavy hitter; default 1024 when neither `budget` nor `ratio` is given); `ratio`: fraction of
  the padded prompt kept instead. `window` is 32 by default, as SnapKV's (KVCache-Factory's
  one-shot H2O keeps 8). Budgets are computed at allocate time from the padded (static) prompt
  length; rows shorter than the budget keep every token. Scores use sm_scale = 1/sqrt(head_dim).
  """

  budget: int | None = None
  ratio: float | None = None
  window: int = 32
  gqa_reduce: str = "mean"
  query_chunk: int = 512
  storage: Any = FullCache()

  def __post_init__(self):
    check_method_int("h2o", "window", self.window, 1)
    check_method_int("h2o", "query_chunk", self.query_chunk, 1)
    check_budget_or_ratio("h2o", self.budget, self.ratio, **self._smallest_budget())
    check_gqa_reduce("h2o", self.gqa_reduce)
    check_storage_method("h2o", self.storage)

  def prompt_budget(self, prompt_len: int) -> int:
    return prompt_budget("h2o", self.budget, self.ratio, prompt_len, **self._smallest_budget())

  def _smallest_budget(self) -> dict:
    # A budget of the window alone keeps no heavy hitter: a recent window, not H2O (as
    # h2o_decode refuses it).
    return dict(minimum=self.window + 1, minimum_what="window + 1 (a heavy-hitter slot)")

  def selector(self, shape: ModelCacheShape, prompt_len: int) -> HeavyHitterSelector:
    return HeavyHitterSelector(
      budget=self.prompt_budget(prompt_len),
      window=self.window,
      gqa_reduce=self.gqa_reduce,
      sm_scale=shape.head_dim**-0.5,
      query_chunk=self.query_chunk,
    )

  def allocate(self, shape: ModelCacheShape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    del layer
    return allocate_selected_cache(
      "h2o",
      self.storage,
      shape,
      self.selector(shape, prompt_len),
      batch=batch,
      prompt_len=prompt_len,
      max_new_tokens=max_new_tokens,
      dtype=dtype,
      sized_by_prompt=self.ratio is not None,
    )
