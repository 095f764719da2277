"""SnapKV: keep the prompt tokens the last `window` queries attend to, chosen once at prefill.

Rule (per row, per KV head), when the row is longer than the budget:
  1. attention of the last `window` queries over all keys (scaled by 1/sqrt(head_dim), causal
     inside the window, softmax in float32), summed over those queries;
  2. the prefix part (tokens before the window) pooled along tokens (stride 1, padding
     kernel // 2, `pooling` max or avg);
  3. reduced over the KV head's query group (`gqa_reduce` mean, max or sum);
  4. the top-(budget - window) prefix tokens are kept, plus the window itself.
Chunked prefill (`ingest_chunk`, kvjax.chunked_prefill): after each chunk the held tokens and
the chunk's compete for the budget by the rule above, scored by the chunk's last `window`
queries. Decoding appends without further eviction. Only `[window, prompt]` scores per head are
ever built; the kept K/V alone are stored (in `storage`: full, kivi, gear), so the bytes are
real.
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
from kvjax.selection.pooling import (
  check_gqa_reduce,
  check_pooling,
  pool_scores,
  reduce_query_group,
)
from kvjax.selection.selected_cache import allocate_selected_cache
from kvjax.selection.token_choice import keep_top_tokens_and_window
from kvjax.selection.window_attention_scores import observation_window_attention


def snapkv_token_scores(
  keys: jax.Array,  # [batch, kv_heads, prompt, head_dim], rotated
  queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim], rotated
  lengths: jax.Array,  # int32 [batch]
  *,
  window: int,
  kernel: int,
  pooling: str,
  gqa_reduce: str,
  sm_scale: float,
  first_query: jax.Array | None = None,  # int32 [batch]: no queries before this position
) -> jax.Array:  # float32 [batch, kv_heads, prompt]; meaningful before each row's window
  summed = observation_window_attention(
    queries, keys, lengths, window=window, sm_scale=sm_scale, first_query=first_query
  )
  pooled = pool_scores(summed, lengths - window, kernel=kernel, pooling=pooling)
  return reduce_query_group(pooled, gqa_reduce)


@dataclasses.dataclass(frozen=True)
class ObservationWindowSelector:
  """SnapKV's choice for one layer (static: hashable, lives in the cache's metadata)."""

  budget: int
  window: int
  kernel: int
  pooling: str
  gqa_reduce: str
  sm_scale: float

  def kept_indices(self, keys, queries, lengths):
    return self.kept_indices_of_candidates(keys, queries, lengths, first_query=None)

  def kept_indices_of_candidates(self, keys, queries, lengths, first_query):
    """The choice among `lengths[b]` candidates whose queries start at `first_query[b]`
    (chunked prefill: held tokens, which have no queries left, then a chunk's tokens; None:
    a prompt, every token with its query): the last `window` queries score them."""
    scores = snapkv_token_scores(
      keys,
      queries,
      lengths,
      window=self.window,
      kernel=self.kernel,
      pooling=self.pooling,
      gqa_reduce=self.gqa_reduce,
      sm_scale=self.sm_scale,
      first_query=first_query,
    )
    # A budget below the window is one capped at a prompt shorter than the window, so the
    # candidates are never more than the budget and all are kept, as a one-piece ingest does.
    window = min(self.window, self.budget)
    return keep_top_tokens_and_window(scores, lengths, budget=self.budget, window=window)


def check_snapkv_fields(method: str, budget, ratio, window, kernel, pooling, gqa_reduce, storage):
  check_method_int(method, "window", window, 1)
  check_method_int(method, "kernel", kernel, 1)
  check_budget_or_ratio(method, budget, ratio, minimum=window, minimum_what="window")
  check_pooling(method, pooling, kernel)
  check_gqa_reduce(method, gqa_reduce)
  check_storage_method(method, storage)


@register_method("snapkv", kind="selection")
@dataclasses.dataclass(frozen=True)
class SnapKV:
  """Cache method `snapkv`: observation-window selection at prefill (see module docstring).

  `budget`: prompt tokens each KV head keeps, window included (default 1024 when neither
  `budget` nor `ratio` is given); `ratio`: fraction of the padded prompt kept instead. Budgets
  are computed at allocate time from the padded (static) prompt length; rows shorter than the
  budget keep every token. Scores use sm_scale = 1/sqrt(head_dim), the scale Llama-family
  attention uses.
  """

  budget: int | None = None
  ratio: float | None = None
  window: int = 32
  kernel: int = 7
  pooling: str = "max"
  gqa_reduce: str = "mean"
  storage: Any = FullCache()

  def __post_init__(self):
    check_snapkv_fields(
      "snapkv",
      self.budget,
      self.ratio,
      self.window,
      self.kernel,
      self.pooling,
      self.gqa_reduce,
      self.storage,
    )

  def prompt_budget(self, prompt_len: int) -> int:
    return prompt_budget(
      "snapkv", self.budget, self.ratio, prompt_len, minimum=self.window, minimum_what="window"
    )

  def selector(self, shape: ModelCacheShape, prompt_len: int) -> ObservationWindowSelector:
    return ObservationWindowSelector(
      budget=self.prompt_budget(prompt_len),
      window=self.window,
      kernel=self.kernel,
      pooling=self.pooling,
      gqa_reduce=self.gqa_reduce,
      sm_scale=shape.head_dim**-0.5,
    )

  def allocate(self, shape: ModelCacheShape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    del layer  # every layer keeps the same budget
    return allocate_selected_cache(
      "snapkv",
      self.storage,
      shape,
      self.selector(shape, prompt_len),
      batch=batch,
      prompt_len=prompt_len,
      max_new_tokens=max_new_tokens,
      dtype=dtype,
      sized_by_prompt=self.ratio is not None,
    )
