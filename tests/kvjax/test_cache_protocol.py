import importlib

import jax
import jax.numpy as jnp
import pytest

from kvjax.cache_protocol import ModelCacheShape, allocate_model_cache, model_cache_shapes
from kvjax.lru_table import LruTable
from kvjax.method_spec import parse_method_spec

SHAPE = ModelCacheShape(num_layers=2, num_kv_heads=2, num_query_heads=4, head_dim=32)
ALLOCATION = dict(batch=2, prompt_len=40, max_new_tokens=8, dtype=jnp.bfloat16)


def _as_shapes(caches):
  return [(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(caches)]


@pytest.mark.parametrize("spec", ["full", "kivi:bits=2,group_size=16,residual=16"])
def test_shapes_are_the_allocated_caches_shapes_and_are_memoised(spec):
  method = parse_method_spec(spec)
  shapes = model_cache_shapes(method, SHAPE, **ALLOCATION)
  assert _as_shapes(shapes) == _as_shapes(allocate_model_cache(method, SHAPE, **ALLOCATION))
  assert model_cache_shapes(method, SHAPE, **ALLOCATION) is shapes
  # Another request is another entry.
  longer = model_cache_shapes(method, SHAPE, **dict(ALLOCATION, max_new_tokens=40))
  assert _as_shapes(longer) != _as_shapes(shapes)


def test_a_full_memo_still_returns_what_it_shaped(monkeypatch):
  # Threads share the memo; an entry may be evicted by another thread right after it is stored.
  module = importlib.import_module("kvjax.cache_protocol")
  monkeypatch.setattr(module, "_SHAPED_CACHES", LruTable(max_entries=0))
  method = parse_method_spec("full")
  shapes = model_cache_shapes(method, SHAPE, **dict(ALLOCATION, prompt_len=41))
  assert _as_shapes(shapes) == _as_shapes(
    allocate_model_cache(method, SHAPE, **dict(ALLOCATION, prompt_len=41))
  )


def test_errors_of_the_allocation_are_raised_and_not_memoised():
  method = parse_method_spec("kivi:group_size=64")
  for _ in range(2):
    with pytest.raises(ValueError, match="kivi: group_size=64 must divide head_dim=32"):
      model_cache_shapes(method, SHAPE, **ALLOCATION)


def test_a_model_cache_shape_refuses_counts_that_are_not_positive_ints():
  good = dict(num_layers=2, num_kv_heads=2, num_query_heads=4, head_dim=8)
  for name in ("num_layers", "num_kv_heads", "num_query_heads", "head_dim", "sliding_window"):
    for bad in (0, -3, 2.0, True):
      with pytest.raises(ValueError, match=rf"{name}={bad!r} must be an int >= 1"):
        ModelCacheShape(**{**good, name: bad})
  assert ModelCacheShape(**good, sliding_window=1).sliding_window == 1
