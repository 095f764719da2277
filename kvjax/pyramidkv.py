"""PyramidKV: SnapKV selection with per-layer budgets falling linearly with depth.

Layer budgets (the authors' formula, beta = 20; B = budget per layer including the window w,
T = prompt length, L = layers, all Python ints):
    min = (B - w) // beta,  max = 2 (B - w) - min
    if max >= T - w:  max = T - w,  min = 2 (B - w) - max
    step = (max - min) // (L - 1)
    budget_l = max - l * step + w            (layer 0 keeps the most)
If T <= B nothing is compressed; if T < 2 (B - w) every layer keeps B (uniform). The budgets
average to B before the floor in `step`, and the floor can take them far above it: B=128, w=8,
L=32 gives 242 ... 25, mean 133.5 (+4%); B=64, w=32, L=80 gives step 0 and every layer 95
(+48%), with no pyramid at all. `PyramidKV.layer_budgets` warns when the mean exceeds B by more
than 10%; the bytes kvjax reports (`cache_bytes`, the comparison's columns) are the real ones.

T is the padded (static) prompt length of the batch, so every layer's cache has its own static
size and the memory saving is real; rows shorter than their layer's budget keep every token.
"""

import dataclasses
import warnings
from typing import Any

from kvjax.cache_protocol import ModelCacheShape
from kvjax.dense_cache import FullCache
from kvjax.method_registry import register_method
from kvjax.selection.budgets import check_method_int, prompt_budget
from kvjax.selection.selected_cache import allocate_selected_cache
from kvjax.snapkv import ObservationWindowSelector, check_snapkv_fields


def pyramid_layer_budgets(
  budget: int, *, window: int, num_layers: int, prompt_len: int, beta: int = 20
) -> tuple[int, ...]:
  """Prompt tokens each layer keeps per KV head (window included), layer 0 first."""
  if budget >= prompt_len:
    return (prompt_len,) * num_layers
  if prompt_len < 2 * (budget - window) or num_layers == 1:
    return (budget,) * num_layers
  selected = budget - window  # tokens chosen by score, per layer on average
  low = selected // beta
  high = 2 * selected - low
  if high >= prompt_len - window:
    high = prompt_len - window
    low = 2 * selected - high
  step = (high - low) // (num_layers - 1)
  return tuple(high - layer * step + window for layer in range(num_layers))


@register_method("pyramidkv", kind="selection")
@dataclasses.dataclass(frozen=True)
class PyramidKV:
  """Cache method `pyramidkv`: SnapKV with pyramid-shaped per-layer budgets (module docstring).

  `budget`: prompt tokens per KV head averaged over layers, window included (default 1024 when
  neither `budget` nor `ratio` is given); `ratio`: that average as a fraction of the padded
  prompt. `window`, `kernel`, `pooling`, `gqa_reduce` as in SnapKV (window 32 by default, so
  SnapKV and PyramidKV differ only in their budgets; the PyramidKV authors' LongBench runner
  uses window=8); `beta` the pyramid's steepness (min layer budget (B - w) // beta).
  """

  budget: int | None = None
  ratio: float | None = None
  window: int = 32
  kernel: int = 7
  pooling: str = "max"
  gqa_reduce: str = "mean"
  beta: int = 20
  storage: Any = FullCache()

  def __post_init__(self):
    check_snapkv_fields(
      "pyramidkv",
      self.budget,
      self.ratio,
      self.window,
      self.kernel,
      self.pooling,
      self.gqa_reduce,
      self.storage,
    )
    check_method_int("pyramidkv", "beta", self.beta, 1)

  def layer_budgets(self, num_layers: int, prompt_len: int) -> tuple[int, ...]:
    average = prompt_budget(
      "pyramidkv",
      self.budget,
      self.ratio,
      prompt_len,
      minimum=self.window,
      minimum_what="window",
    )
    budgets = pyramid_layer_budgets(
      average, window=self.window, num_layers=num_layers, prompt_len=prompt_len, beta=self.beta
    )
    mean = sum(budgets) / num_layers
    if mean > 1.1 * average:
      warnings.warn(
        f"pyramidkv: the authors' layer budgets for budget={average}, window={self.window} and "
        f"{num_layers} layers average {mean:.1f} tokens per KV head, {mean / average - 1:.0%} "
        f"more than the budget (layers {budgets[0]} ... {budgets[-1]}: the pyramid's step "
        "rounds down); a larger budget or a smaller window keeps the pyramid closer to it",
        stacklevel=2,
      )
    return budgets

  def selector(self, shape: ModelCacheShape, layer: int, prompt_len: int):
    return ObservationWindowSelector(
      budget=self.layer_budgets(shape.num_layers, prompt_len)[layer],
      window=self.window,
      kernel=self.kernel,
      pooling=self.pooling,
      gqa_reduce=self.gqa_reduce,
      sm_scale=shape.head_dim**-0.5,
    )

  def allocate(self, shape: ModelCacheShape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    return allocate_selected_cache(
      "pyramidkv",
      self.storage,
      shape,
      self.selector(shape, layer, prompt_len),
      batch=batch,
      prompt_len=prompt_len,
      max_new_tokens=max_new_tokens,
      dtype=dtype,
      sized_by_prompt=True,  # the pyramid's layer budgets depend on the prompt's length
    )
