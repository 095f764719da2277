import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import ModelCacheShape, allocate_model_cache
from kvjax.generate import generate
from kvjax.method_spec import parse_method_spec
from kvjax.pyramidkv import PyramidKV, pyramid_layer_budgets
from tests.kvjax.test_snapkv import (
  LENGTHS,
  B,
  D,
  G,
  H,
  T,
  ingest,
  numpy_snapkv_kept,
  random_qkv,
  run_generate,
)
from tests.kvjax.tiny_decoder import tiny_decoder


def numpy_pyramid_budgets(budget, window, num_layers, prompt_len, beta=20):
  """The authors' PyramidKV formula, written out as they state it."""
  if prompt_len < budget:
    return [prompt_len] * num_layers
  if prompt_len < (budget - window) * 2:
    return [budget] * num_layers
  min_num = (budget - window) // beta
  max_num = (budget - window) * 2 - min_num
  if max_num >= prompt_len - window:
    max_num = prompt_len - window
    min_num = (budget - window) * 2 - max_num
  steps = (max_num - min_num) // (num_layers - 1)
  return [max_num - layer * steps + window for layer in range(num_layers)]


def test_the_papers_example():
  budgets = pyramid_layer_budgets(128, window=8, num_layers=32, prompt_len=4096)
  assert budgets[0] == 234 + 8 and budgets[31] == 17 + 8
  assert list(budgets) == numpy_pyramid_budgets(128, 8, 32, 4096)
  # Linear, with step (234 - 6) // 31 = 7.
  assert all(a - b == 7 for a, b in zip(budgets, budgets[1:], strict=False))
  # The floor in the step leaves the mean a little above the budget (133.5 here, not 128).
  assert np.mean(budgets) == 133.5


@pytest.mark.parametrize(
  "budget, window, num_layers, prompt_len",
  [
    (128, 8, 32, 250),  # max clipped to T - w
    (128, 8, 32, 239),  # T < 2 (B - w): uniform
    (128, 8, 32, 100),  # T < B: nothing compressed
    (64, 4, 5, 1000),
    (16, 4, 2, 40),
    (40, 32, 30, 2000),
  ],
)
def test_budgets_follow_the_formula(budget, window, num_layers, prompt_len):
  budgets = pyramid_layer_budgets(
    budget, window=window, num_layers=num_layers, prompt_len=prompt_len
  )
  assert list(budgets) == numpy_pyramid_budgets(budget, window, num_layers, prompt_len)
  assert all(window <= b <= prompt_len for b in budgets)


def test_short_prompts_fall_back_to_uniform_and_tiny_ones_keep_everything():
  assert PyramidKV(budget=128, window=8).layer_budgets(4, 200) == (128,) * 4
  assert PyramidKV(budget=128, window=8).layer_budgets(4, 100) == (100,) * 4
  # B = 200: (375 + 8, 9 + 8)
  assert PyramidKV(ratio=0.5, window=8).layer_budgets(2, 400) == (383, 17)


def test_each_layer_keeps_exactly_its_snapkv_choice_at_its_own_budget():
  num_layers = 3
  shape = ModelCacheShape(num_layers=num_layers, num_kv_heads=H, num_query_heads=H * G, head_dim=D)
  method = PyramidKV(budget=16, window=4, kernel=5, pooling="avg")
  budgets = method.layer_budgets(num_layers, T)
  assert budgets == (28, 16, 4)
  caches = allocate_model_cache(
    method, shape, batch=B, prompt_len=T, max_new_tokens=2, dtype=jnp.float32
  )
  for layer, (budget, cache) in enumerate(zip(budgets, caches, strict=True)):
    queries, keys, values = random_qkv(seed=10 + layer)
    cache = ingest(cache, queries, keys, values)
    assert cache.storage.keys.shape == (B, H, budget + 2, D)  # each layer its own static size
    expected = numpy_snapkv_kept(
      queries, keys, LENGTHS, budget=budget, window=4, kernel=5, pooling="avg", gqa_reduce="mean"
    )
    for (b, h), kept in expected.items():
      assert len(kept) == min(budget, LENGTHS[b]) == int(cache.lengths[b])
      stored = np.asarray(cache.storage.keys[b, h, : len(kept)])
      np.testing.assert_array_equal(stored, keys[b, h, kept])


def test_bad_configurations_raise_clearly():
  with pytest.raises(ValueError, match="pyramidkv: budget=4 is smaller than window = 8"):
    PyramidKV(budget=4, window=8)
  with pytest.raises(ValueError, match="beta=0 must be an int >= 1"):
    PyramidKV(beta=0)
  with pytest.raises(ValueError, match=r"ratio=2.0 must be in \(0, 1\]"):
    PyramidKV(ratio=2.0)
  # The default budget (1024) below the window made layer budgets past the prompt (1951 of 1500).
  with pytest.raises(ValueError, match="pyramidkv: the default budget=1024 is smaller than window"):
    PyramidKV(window=2000)


def test_generate_batch_of_two_lengths_layers_differ_in_size():
  method = parse_method_spec("pyramidkv:budget=12,window=4,kernel=3")
  result = run_generate(method, max_new_tokens=3)
  assert result.tokens.shape == (2, 3)
  budgets = method.layer_budgets(2, 37)  # the longest prompt: 37 tokens
  assert budgets == (20, 4) and sum(budgets) == 2 * 12
  assert result.cache_bytes == sum(2 * 2 * 2 * (b + 3) * 16 * 4 + 2 * 4 for b in budgets)


@pytest.mark.parametrize(
  "spec,warns",
  [
    ("pyramidkv:budget=16,window=4", True),
    ("snapkv:ratio=0.5,window=4", True),
    ("snapkv:ratio=0.5,window=4+kivi:bits=4,group_size=16,residual=16", True),
    ("snapkv:budget=16,window=4", False),
  ],
)
def test_ragged_batches_say_when_budgets_follow_the_padded_width(spec, warns):
  """Budgets from the padded width (a ratio, PyramidKV's pyramid) give a short row what the
  longest allows, not what it keeps alone (a review found its tokens changed); generate says
  so. A fixed budget is per row already: no warning."""
  decoder, params = tiny_decoder()
  method = parse_method_spec(spec)
  prompts = [list(range(1, 41)), list(range(1, 21))]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    generate(decoder, params, prompts, max_new_tokens=2, cache_method=method)
  said = [
    w for w in caught if "budgets follow the batch's padded prompt width (40" in str(w.message)
  ]
  assert bool(said) == warns
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    generate(decoder, params, [prompts[0]] * 2, max_new_tokens=2, cache_method=method)
  assert not [w for w in caught if "padded prompt width" in str(w.message)]


def test_budgets_the_pyramids_floor_takes_far_above_the_budget_are_warned_of():
  # The authors' step rounds down: at budget 64 with the default window of 32 over 80 layers it
  # is 0, and every layer keeps 95 tokens, 48% more than asked; 128 / 8 / 32 is 4% over.
  with pytest.warns(UserWarning, match=r"average 95.0 tokens per KV head, 48% more than the"):
    assert PyramidKV(budget=64).layer_budgets(80, 4096) == (95,) * 80
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    budgets = PyramidKV(budget=128, window=8).layer_budgets(32, 4096)
  assert (budgets[0], budgets[-1]) == (242, 25)
