"""Shared pieces of the token- and head-selection methods (SnapKV, H2O, PyramidKV, StreamingLLM,
RazorAttention): budget arithmetic, attention-based token scores, pooling, top-k choice with a
protected recent window, and the wrapper cache that stores only the chosen tokens.

Every selection method decides at prefill which prompt tokens each KV head keeps and stores
*only those* in an inner storage cache (`full`, `kivi`, `gear`) allocated at the kept size, so a
dropped token costs no bytes.
"""

from kvjax.selection.budgets import (
  DEFAULT_BUDGET,
  check_budget_or_ratio,
  check_full_attention_model,
  check_storage_method,
  prompt_budget,
)
from kvjax.selection.pooling import GQA_REDUCTIONS, POOLINGS, pool_scores, reduce_query_group
from kvjax.selection.selected_cache import SelectedLayerCache
from kvjax.selection.token_choice import gather_tokens, keep_top_tokens_and_window
from kvjax.selection.window_attention_scores import (
  accumulated_prompt_attention,
  observation_window_attention,
)

__all__ = [
  "DEFAULT_BUDGET",
  "GQA_REDUCTIONS",
  "POOLINGS",
  "SelectedLayerCache",
  "accumulated_prompt_attention",
  "check_budget_or_ratio",
  "check_full_attention_model",
  "check_storage_method",
  "gather_tokens",
  "keep_top_tokens_and_window",
  "observation_window_attention",
  "pool_scores",
  "prompt_budget",
  "reduce_query_group",
]
