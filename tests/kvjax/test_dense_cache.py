import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import ModelCacheShape, allocate_model_cache, model_cache_nbytes
from kvjax.dense_cache import DenseLayerCache, FullCache
from kvjax.sliding_window_cache import SlidingWindowLayerCache
from pallas_kernels.decode_attention_reference import (
  decode_attention_reference,
  merge_attention_partials,
)

B, H, G, D = 2, 3, 2, 8


def _random(key, *shape):
  return jax.random.normal(jax.random.key(key), shape)


def _softmax_attention(q, k, v, sm_scale):  # q [G, D], k/v [T, D], numpy
  scores = q @ k.T * sm_scale
  p = np.exp(scores - scores.max(-1, keepdims=True))
  return (p / p.sum(-1, keepdims=True)) @ v


def test_ingest_then_append_attends_over_exactly_the_valid_tokens():
  lengths = np.array([5, 2], np.int32)
  keys, values = _random(0, B, H, 5, D), _random(1, B, H, 5, D)
  cache = DenseLayerCache.zeros(batch=B, kv_heads=H, capacity=8, head_dim=D, dtype=jnp.float32)
  cache = cache.ingest(keys, values, None, jnp.asarray(lengths))
  new_k, new_v = _random(2, B, H, D), _random(3, B, H, D)
  cache = cache.append(new_k, new_v)
  np.testing.assert_array_equal(cache.lengths, lengths + 1)
  q = _random(4, B, H, G, D)
  out = np.asarray(cache.attend(q, sm_scale=0.3))
  for b in range(B):
    k_b = np.concatenate([np.asarray(keys[b, :, : lengths[b]]), np.asarray(new_k[b, :, None])], 1)
    v_b = np.concatenate([np.asarray(values[b, :, : lengths[b]]), np.asarray(new_v[b, :, None])], 1)
    for h in range(H):
      np.testing.assert_allclose(
        out[b, h], _softmax_attention(np.asarray(q[b, h]), k_b[h], v_b[h], 0.3), atol=1e-5
      )
  # Padding past a row's length is zero in storage, never garbage.
  assert np.all(np.asarray(cache.keys[1, :, 3:]) == 0)


def test_nbytes_counts_every_stored_array():
  cache = DenseLayerCache.zeros(batch=B, kv_heads=H, capacity=8, head_dim=D, dtype=jnp.bfloat16)
  assert cache.nbytes == 2 * B * H * 8 * D * 2 + B * 4
  assert cache.stored_elements == 2 * B * H * 8 * D


def test_full_cache_allocates_prompt_plus_new_tokens_per_layer():
  shape = ModelCacheShape(num_layers=3, num_kv_heads=H, num_query_heads=H * G, head_dim=D)
  caches = allocate_model_cache(
    FullCache(), shape, batch=B, prompt_len=10, max_new_tokens=6, dtype=jnp.bfloat16
  )
  assert len(caches) == 3 and all(c.capacity == 16 for c in caches)
  assert model_cache_nbytes(caches) == 3 * caches[0].nbytes


def test_full_cache_uses_a_ring_buffer_for_sliding_window_models():
  shape = ModelCacheShape(1, H, H * G, D, sliding_window=4)
  (cache,) = allocate_model_cache(
    FullCache(), shape, batch=B, prompt_len=10, max_new_tokens=6, dtype=jnp.float32
  )
  assert isinstance(cache, SlidingWindowLayerCache) and cache.window == 4


def test_ring_buffer_holds_exactly_the_last_window_tokens():
  window, total = 4, 11
  lengths = np.array([7, 3], np.int32)
  keys, values = _random(0, B, H, 7, D), _random(1, B, H, 7, D)
  stream_k, stream_v = _random(2, total, B, H, D), _random(3, total, B, H, D)
  ring = SlidingWindowLayerCache.zeros(
    batch=B, kv_heads=H, window=window, head_dim=D, dtype=jnp.float32
  )
  ring = ring.ingest(keys, values, None, jnp.asarray(lengths))
  dense = DenseLayerCache.zeros(
    batch=B, kv_heads=H, capacity=7 + total, head_dim=D, dtype=jnp.float32
  )
  dense = dense.ingest(keys, values, None, jnp.asarray(lengths))
  q = _random(4, B, H, G, D)
  for step in range(total):
    ring = ring.append(stream_k[step], stream_v[step])
    dense = dense.append(stream_k[step], stream_v[step])
    got = ring.attend(q, sm_scale=0.25)
    for b in range(B):
      n = int(dense.lengths[b])
      k_b = np.asarray(dense.keys[b, :, max(n - window, 0) : n])
      v_b = np.asarray(dense.values[b, :, max(n - window, 0) : n])
      for h in range(H):
        np.testing.assert_allclose(
          got[b, h], _softmax_attention(np.asarray(q[b, h]), k_b[h], v_b[h], 0.25), atol=1e-5
        )


def test_merge_of_partials_equals_attention_over_the_union():
  q = _random(0, B, H, G, D)
  k, v = _random(1, B, H, 12, D), _random(2, B, H, 12, D)
  lengths = jnp.array([12, 7])
  whole = decode_attention_reference(q, k, v, lengths, sm_scale=0.2)
  first = decode_attention_reference(
    q, k[:, :, :5], v[:, :, :5], jnp.minimum(lengths, 5), sm_scale=0.2
  )
  second = decode_attention_reference(q, k[:, :, 5:], v[:, :, 5:], lengths - 5, sm_scale=0.2)
  merged = merge_attention_partials([first, second])
  np.testing.assert_allclose(merged[0], whole[0], atol=1e-5)
  np.testing.assert_allclose(merged[1], whole[1], atol=1e-5)


def test_a_ring_of_no_slots_is_refused():
  for window in (0, -1, 2.0, True):
    with pytest.raises(ValueError, match=rf"window={window!r} must be an int >= 1"):
      SlidingWindowLayerCache.zeros(
        batch=1, kv_heads=1, window=window, head_dim=8, dtype=jnp.float32
      )


def test_keys_whose_heads_differ_from_the_queries_are_refused_not_broadcast():
  cache = DenseLayerCache.zeros(batch=2, kv_heads=1, capacity=4, head_dim=8, dtype=jnp.float32)
  queries = jnp.ones((2, 2, 3, 8), jnp.float32)
  with pytest.raises(ValueError, match=r"keys must be \[2, 2, tokens, 8\] to match the queries"):
    cache.attend(queries, sm_scale=1.0)


def test_on_a_tpu_the_full_cache_holds_whole_tiles_of_tokens(monkeypatch):
  """Where the compiled TPU kernel reads the full cache (`full_precision_cache_granule`), its
  capacity is rounded up so that a TPU's default layout of K and V is the kernel's: 16 tokens
  from 128 channels, 128 below. The storage selection methods keep their budget in is not."""

  def capacity(method, head_dim):
    shape = ModelCacheShape(num_layers=1, num_kv_heads=1, num_query_heads=2, head_dim=head_dim)
    cache = jax.eval_shape(
      lambda: method.allocate(
        shape, 0, batch=1, prompt_len=20000, max_new_tokens=100, dtype=jnp.bfloat16
      )
    )
    return cache.capacity

  full = FullCache()
  assert capacity(full, 128) == capacity(full, 64) == 20100  # the CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert capacity(full, 128) == 20112
  assert capacity(full, 64) == 20224
  assert capacity(FullCache(implementation="interpret"), 128) == 20100
  storage = jax.eval_shape(
    lambda: full.allocate_storage(
      batch=1, kv_heads=1, capacity=20100, head_dim=128, dtype=jnp.bfloat16
    )
  )
  assert storage.capacity == 20100


def test_a_cache_relaid_to_another_capacity_keeps_every_held_token():
  """`with_capacity` (restoring a context laid out on another backend): the slots past the new
  capacity cut off, or zeros added, the held tokens and lengths as they were; there and back is
  the cache again. `capacity_on_tpu` is `FullCache.allocate`'s rounding on a TPU."""
  lengths = np.array([5, 2], np.int32)
  keys, values = _random(0, B, H, 5, D), _random(1, B, H, 5, D)
  cache = DenseLayerCache.zeros(batch=B, kv_heads=H, capacity=8, head_dim=D, dtype=jnp.float32)
  cache = cache.ingest(keys, values, None, lengths)
  wider, narrower = cache.with_capacity(128), cache.with_capacity(5)
  assert wider.capacity == 128 and narrower.capacity == 5
  for relaid in (wider, narrower, wider.with_capacity(8)):
    np.testing.assert_array_equal(relaid.lengths, cache.lengths)
    np.testing.assert_array_equal(relaid.keys[:, :, :5], cache.keys[:, :, :5])
    np.testing.assert_array_equal(relaid.values[:, :, :5], cache.values[:, :, :5])
    assert (
      not np.asarray(relaid.keys[:, :, 5:]).any() and not np.asarray(relaid.values[:, :, 5:]).any()
    )
  query = _random(2, B, H, G, D)
  np.testing.assert_array_equal(
    wider.attend(query, sm_scale=0.3), cache.attend(query, sm_scale=0.3)
  )
  assert [cache.capacity_on_tpu(tokens) for tokens in (1, 128, 129)] == [128, 128, 256]  # D < 128
  wide_heads = DenseLayerCache.zeros(
    batch=1, kv_heads=1, capacity=8, head_dim=128, dtype=jnp.bfloat16
  )
  assert [wide_heads.capacity_on_tpu(tokens) for tokens in (8, 16, 17)] == [16, 16, 32]
  for tokens in (-1, 2.0, True):
    with pytest.raises(ValueError, match=rf"tokens={tokens!r} must be an int >= 0"):
      cache.with_capacity(tokens)
