"""Budget arithmetic and the configuration checks every selection method shares.

`budget` is the number of prompt tokens one KV head keeps (the protected window and sinks
included); `ratio` is the fraction of the prompt kept instead. Budgets are Python ints computed
at allocate time from `prompt_len`, the *padded* (static) prompt length of the batch, so every
cache has a static shape; a row shorter than the budget keeps all its tokens.
"""

import math
import numbers
import warnings

import numpy as np

from kvjax.cache_protocol import ModelCacheShape

# Tokens per KV head kept when neither `budget` nor `ratio` is given (SnapKV's smallest
# published LongBench setting; StreamingLLM's 4 sinks + 1020 recent tokens).
DEFAULT_BUDGET = 1024


def check_method_int(method: str, name: str, value, minimum: int) -> None:
  """A method's token count (budget, window, sinks, kernel, ...) is an int >= `minimum`: a
  float would reach array shapes inside tracing, a bool would pass for 0 or 1."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ValueError(f"{method}: {name}={value!r} must be an int >= {minimum}")


def check_budget_or_ratio(
  method: str,
  budget: int | None,
  ratio: float | None,
  *,
  minimum: int,
  minimum_what: str,
  default_budget: int = DEFAULT_BUDGET,
) -> None:
  """Raises (at construction, before any tracing) on an inconsistent or too small budget, the
  `default_budget` used when neither is given included."""
  if budget is not None:
    check_method_int(method, "budget", budget, 1)
  if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, numbers.Real)):
    raise ValueError(f"{method}: ratio={ratio!r} must be a number in (0, 1]")
  if budget is not None and ratio is not None:
    raise ValueError(
      f"{method}: give budget=<tokens kept per KV head> or ratio=<fraction kept, in (0, 1]>, "
      f"not both (got budget={budget}, ratio={ratio})"
    )
  if ratio is not None and not 0.0 < ratio <= 1.0:
    raise ValueError(f"{method}: ratio={ratio} must be in (0, 1] (the fraction of the prompt kept)")
  if budget is not None and budget < minimum:
    raise ValueError(
      f"{method}: budget={budget} is smaller than {minimum_what} = {minimum}; "
      f"raise budget or shrink the protected tokens"
    )
  if budget is None and ratio is None and default_budget < minimum:
    # Unchecked, it reached the budget arithmetic: razor's window went negative, snapkv kept
    # only a window cut to the budget, pyramidkv's layers got budgets past the prompt.
    raise ValueError(
      f"{method}: the default budget={default_budget} is smaller than {minimum_what} = "
      f"{minimum}; give budget=<tokens kept per KV head> (or ratio=) or shrink the protected "
      "tokens"
    )


def prompt_budget(
  method: str,
  budget: int | None,
  ratio: float | None,
  prompt_len: int,
  *,
  minimum: int,
  minimum_what: str,
) -> int:
  """Prompt tokens one KV head keeps for a (padded, static) prompt of `prompt_len` tokens.

  Never more than the prompt: a budget at or above `prompt_len` keeps everything.
  """
  tokens = budget_while_decoding(
    method, budget, ratio, prompt_len, minimum=minimum, minimum_what=minimum_what
  )
  return min(tokens, prompt_len)


def budget_while_decoding(
  method: str,
  budget: int | None,
  ratio: float | None,
  prompt_len: int,
  *,
  minimum: int,
  minimum_what: str,
) -> int:
  """Tokens one KV head holds in a cache that evicts while decoding (`streaming`, `h2o_decode`):
  `budget` (DEFAULT_BUDGET when neither is given), or `ratio` of the padded prompt. Unlike
  `prompt_budget`, a given budget is not capped at the prompt: it bounds the prompt and the
  generated tokens alike."""
  if ratio is None:
    return DEFAULT_BUDGET if budget is None else budget
  # ceil, so that ratio=r keeps at least the fraction r (the epsilon absorbs float error:
  # 0.3 * 10 = 3.0000000000000004).
  tokens = math.ceil(ratio * prompt_len - 1e-9)
  if tokens < minimum and tokens < prompt_len:
    raise ValueError(
      f"{method}: ratio={ratio} of a {prompt_len}-token prompt keeps {tokens} tokens, "
      f"fewer than {minimum_what} = {minimum}; raise ratio or shrink the protected tokens"
    )
  return tokens


def check_full_attention_model(shape: ModelCacheShape, method: str, capacity: int) -> None:
  """Selection and eviction caches attend over tokens a sliding-window model never attends to
  (old kept tokens, sinks), so they serve one only when prompt + new tokens (`capacity`) fit in
  its window."""
  if shape.sliding_window is not None and shape.sliding_window < capacity:
    raise ValueError(
      f"{method}: not supported for a sliding-window model (sliding_window="
      f"{shape.sliding_window} < prompt + new tokens = {capacity}); use `full`, whose ring "
      "buffer already keeps only the window"
    )


def check_storage_method(method: str, storage) -> None:
  if not callable(getattr(storage, "allocate_storage", None)):
    raise ValueError(
      f"{method}: storage={storage!r} is not a storage method (one with allocate_storage: "
      "full, kivi, gear)"
    )


def budget_follows_prompt_width(cache_method) -> bool:
  """Whether a method's budgets are computed from the batch's padded prompt width: a `ratio`
  (of any selection or eviction method) or PyramidKV's per-layer pyramid."""
  return (
    getattr(cache_method, "ratio", None) is not None
    or getattr(cache_method, "method_name", "") == "pyramidkv"
  )


def warn_if_ragged_budgets(cache_method, lengths, *, caller: str) -> None:
  """Warns when rows of different lengths share budgets computed from the padded width: a row
  then keeps what the longest row's budget allows, not what it would keep alone."""
  lengths = np.asarray(lengths)
  if budget_follows_prompt_width(cache_method) and lengths.size and lengths.min() != lengths.max():
    warnings.warn(
      f"{caller}: {getattr(cache_method, 'method_name', cache_method)}'s budgets follow the "
      f"batch's padded prompt width ({int(lengths.max())} tokens), so its shorter rows "
      f"({int(lengths.min())} tokens and up) keep what that width allows, not what each would "
      "keep alone; give budget= (not ratio=, and not pyramidkv) or batch rows of one length "
      "for per-row budgets",
      stacklevel=3,
    )
