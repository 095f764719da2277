import types

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import ModelCacheShape
from kvjax.dense_cache import DenseLayerCache
from kvjax.h2o_decode import H2ODecode
from kvjax.kivi_cache import Kivi
from kvjax.shared_context_cache import SharedContextLayerCache, shared_context_refusal
from tests.kvjax.test_razor_attention import numpy_attention_with_lse

KV_HEADS, GROUP, HEAD_DIM = 2, 3, 16
CONTEXT_LENGTHS = np.array([13, 5], np.int32)


def random_array(rng, *shape):
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def dense_context(rng):
  keys, values = (random_array(rng, 2, KV_HEADS, 16, HEAD_DIM) for _ in range(2))
  cache = DenseLayerCache.zeros(
    batch=2, kv_heads=KV_HEADS, capacity=16, head_dim=HEAD_DIM, dtype=jnp.float32
  )
  cache = cache.ingest(keys, values, None, jnp.asarray(CONTEXT_LENGTHS))
  held = [
    (np.asarray(keys[b, :, :n]), np.asarray(values[b, :, :n]))
    for b, n in enumerate(CONTEXT_LENGTHS)
  ]
  return cache, held


def kivi_context(rng):
  keys, values = (random_array(rng, 2, KV_HEADS, 24, HEAD_DIM) for _ in range(2))
  cache = Kivi(bits=2, group_size=8, residual=8).allocate_storage(
    batch=2, kv_heads=KV_HEADS, capacity=24, head_dim=HEAD_DIM, dtype=jnp.float32
  )
  cache = cache.ingest(keys, values, None, jnp.asarray(CONTEXT_LENGTHS))
  # The tokens as KIVI holds them: its quantized segment, then its full-precision window.
  k, v, _ = (np.asarray(x) for x in cache.dequantized())
  held = []
  for b in range(2):
    quantized, window = int(cache.quantized_lengths[b]), int(cache.window_lengths[b])
    slots = np.r_[0:quantized, cache.quantized_capacity : cache.quantized_capacity + window]
    held.append((k[b][:, slots], v[b][:, slots]))
  return cache, held


def shared_cache(rng, context, copies, own_lengths, capacity):
  """A shared cache whose rows hold `own_lengths` random tokens of their own."""
  rows = len(own_lengths)
  own_keys, own_values = (random_array(rng, rows, KV_HEADS, 4, HEAD_DIM) for _ in range(2))
  own = DenseLayerCache.zeros(
    batch=rows, kv_heads=KV_HEADS, capacity=capacity, head_dim=HEAD_DIM, dtype=jnp.float32
  ).ingest(own_keys, own_values, None, jnp.asarray(own_lengths))
  cache = SharedContextLayerCache(context=context, own=own, copies=copies)
  return cache, np.asarray(own_keys), np.asarray(own_values)


def tokens_seen(held, own_keys, own_values, own_lengths, copies, row, head):
  """(keys, values) that `row`'s queries of `head` see: its context row's, then its own."""
  context_keys, context_values = held[row // copies]
  n = own_lengths[row]
  return (
    np.concatenate([context_keys[head], own_keys[row, head, :n]]),
    np.concatenate([context_values[head], own_values[row, head, :n]]),
  )


@pytest.mark.parametrize("make_context", [dense_context, kivi_context], ids=["dense", "kivi"])
@pytest.mark.parametrize("copies", [1, 3])
def test_each_row_attends_over_its_context_row_and_its_own_tokens(make_context, copies):
  rng = np.random.default_rng(copies)
  context, held = make_context(rng)
  rows = 2 * copies
  own_lengths = rng.integers(0, 5, rows).astype(np.int32)
  cache, own_keys, own_values = shared_cache(rng, context, copies, own_lengths, capacity=6)
  queries = random_array(rng, rows, KV_HEADS, GROUP, HEAD_DIM)
  out, lse = cache.attend_with_lse(queries, sm_scale=0.3)
  assert out.shape == (rows, KV_HEADS, GROUP, HEAD_DIM) and lse.shape == (rows, KV_HEADS, GROUP)
  for row in range(rows):
    for head in range(KV_HEADS):
      keys, values = tokens_seen(held, own_keys, own_values, own_lengths, copies, row, head)
      expected_out, expected_lse = numpy_attention_with_lse(
        np.asarray(queries[row, head]), keys, values, 0.3
      )
      np.testing.assert_allclose(out[row, head], expected_out, rtol=2e-5, atol=2e-5)
      np.testing.assert_allclose(lse[row, head], expected_lse, rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(cache.attend(queries, sm_scale=0.3), out)


@pytest.mark.parametrize("make_context", [dense_context, kivi_context], ids=["dense", "kivi"])
def test_a_chunks_queries_attend_over_the_context_row_and_the_own_tokens_before_it(make_context):
  rng = np.random.default_rng(5)
  context, held = make_context(rng)
  copies, chunk = 2, 5
  rows = 2 * copies
  own_lengths = np.array([0, 3, 1, 2], np.int32)
  cache, own_keys, own_values = shared_cache(rng, context, copies, own_lengths, capacity=12)
  queries = random_array(rng, rows, KV_HEADS, GROUP, chunk, HEAD_DIM)
  out, lse = cache.attend_chunk(queries, sm_scale=0.3)
  for row in range(rows):
    for head in range(KV_HEADS):
      keys, values = tokens_seen(held, own_keys, own_values, own_lengths, copies, row, head)
      for position in range(chunk):
        expected_out, expected_lse = numpy_attention_with_lse(
          np.asarray(queries[row, head, :, position]), keys, values, 0.3
        )
        np.testing.assert_allclose(out[row, head, :, position], expected_out, atol=2e-5)
        np.testing.assert_allclose(lse[row, head, :, position], expected_lse, atol=2e-5)
  # The chunk's first counts[b] tokens go after each row's own tokens; the context is kept.
  new_keys, new_values = (random_array(rng, rows, KV_HEADS, chunk, HEAD_DIM) for _ in range(2))
  counts = jnp.asarray([5, 0, 2, 4], jnp.int32)
  ingested = cache.ingest_chunk(new_keys, new_values, queries, counts)
  assert ingested.context is context
  np.testing.assert_array_equal(ingested.lengths, own_lengths + np.asarray(counts))
  for row in range(rows):
    start, count = own_lengths[row], int(counts[row])
    np.testing.assert_array_equal(
      ingested.own.keys[row, :, start : start + count], new_keys[row, :, :count]
    )


def test_appending_writes_only_the_rows_own_tokens():
  rng = np.random.default_rng(0)
  context, _ = dense_context(rng)
  own = DenseLayerCache.zeros(
    batch=4, kv_heads=KV_HEADS, capacity=3, head_dim=HEAD_DIM, dtype=jnp.float32
  )
  cache = SharedContextLayerCache(context=context, own=own, copies=2)
  keys, values = (random_array(rng, 4, KV_HEADS, HEAD_DIM) for _ in range(2))
  appended = cache.append(keys, values)
  assert appended.context is context
  np.testing.assert_array_equal(appended.lengths, [1, 1, 1, 1])
  np.testing.assert_array_equal(appended.room, [2, 2, 2, 2])
  np.testing.assert_array_equal(appended.own.keys[:, :, 0], keys)
  assert cache.nbytes == context.nbytes + own.nbytes
  assert cache.stored_elements == context.stored_elements + own.stored_elements
  with pytest.raises(ValueError, match="continue_context"):
    cache.ingest(None, None, None, None)


def test_caches_that_cannot_be_shared_are_named():
  shape = ModelCacheShape(num_layers=1, num_kv_heads=2, num_query_heads=4, head_dim=8)
  evicting = H2ODecode(budget=8).allocate(
    shape, 0, batch=1, prompt_len=8, max_new_tokens=1, dtype=jnp.float32
  )
  assert "evicts by the attention of each decode step" in shared_context_refusal(evicting)
  assert "has no attend_with_lse" in shared_context_refusal(types.SimpleNamespace())
  dense = DenseLayerCache.zeros(batch=1, kv_heads=2, capacity=4, head_dim=8, dtype=jnp.float32)
  assert shared_context_refusal(dense) is None
