import types

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import ModelCacheShape, allocate_model_cache
from kvjax.dense_cache import FullCache
from kvjax.kivi_cache import Kivi
from kvjax.method_spec import parse_method_spec
from kvjax.razor_attention import RazorAttention
from kvjax.retrieval_heads import HeadProfile
from tests.kvjax.test_snapkv import run_generate
from tests.kvjax.tiny_decoder import tiny_decoder

B, G, D, T = 2, 2, 8, 40
LENGTHS = np.array([40, 10], np.int32)
SHAPE = ModelCacheShape(num_layers=2, num_kv_heads=3, num_query_heads=3 * G, head_dim=D)


def make_profile(shape, retrieval_heads):
  zeros = tuple((0.0,) * shape.num_kv_heads for _ in range(shape.num_layers))
  return HeadProfile(
    num_layers=shape.num_layers,
    num_kv_heads=shape.num_kv_heads,
    num_query_heads=shape.num_query_heads,
    head_dim=shape.head_dim,
    induction_scores=zeros,
    echo_scores=zeros,
    retrieval_heads=tuple(retrieval_heads),
  )


# Layer 0: KV head 1 is a retrieval head; layer 1: heads 0 and 2.
PROFILE = make_profile(SHAPE, [(0, 1), (1, 0), (1, 2)])


def numpy_razor_local(keys, values, length, *, sinks, window):
  """A non-retrieval head's tokens: sinks, window, (mean dropped key, mean value, count)."""
  if length <= sinks + window:
    return keys[:length], values[:length], None
  dropped = slice(sinks, length - window)
  kept = np.r_[0:sinks, length - window : length]
  compensation = (keys[dropped].mean(0), values[dropped].mean(0), length - window - sinks)
  return keys[kept], values[kept], compensation


def numpy_attention_with_lse(q, k, v, scale, compensation=None, weighted=False):
  """Softmax attention of q [n, d] over k, v [t, d] and an optional compensation token (its
  key, value and count; the count added to its logit as log n when `weighted`): (out, lse)."""
  logits = q @ k.T * scale
  if compensation is not None:
    comp_k, comp_v, count = compensation
    comp_logit = q @ comp_k * scale + (np.log(count) if weighted else 0.0)
    logits, v = np.concatenate([logits, comp_logit[:, None]], 1), np.concatenate([v, comp_v[None]])
  top = logits.max(1, keepdims=True)
  lse = top[:, 0] + np.log(np.exp(logits - top).sum(1))
  return np.exp(logits - lse[:, None]) @ v, lse


def ingest_random(method, layer, seed=0, max_new_tokens=2):
  rng = np.random.default_rng(seed)
  keys, values = rng.normal(size=(2, B, 3, T, D)).astype(np.float32)
  cache = method.allocate(
    SHAPE, layer, batch=B, prompt_len=T, max_new_tokens=max_new_tokens, dtype=jnp.float32
  )
  cache = cache.ingest(jnp.asarray(keys), jnp.asarray(values), None, jnp.asarray(LENGTHS))
  return cache, keys, values


@pytest.mark.parametrize("compensation", ["mean", "weighted"])
def test_heads_keep_what_the_rule_says_and_attend_over_exactly_that(compensation):
  # budget 12 = 3 sinks + 8 window + 1 compensation token.
  method = RazorAttention(profile=PROFILE, budget=12, sinks=3, compensation=compensation)
  cache, keys, values = ingest_random(method, layer=0)
  assert cache.retrieval_heads == (1,) and cache.local_heads == (0, 2)
  # Retrieval head: every token. Row 1 (10 tokens <= sinks + window + 1) keeps all its tokens too.
  for b in range(B):
    stored = np.asarray(cache.retrieval.keys[b, 0, : LENGTHS[b]])
    np.testing.assert_array_equal(stored, keys[b, 1, : LENGTHS[b]])
  np.testing.assert_array_equal(cache.retrieval.lengths, LENGTHS)
  local_len = np.asarray(cache.local.lengths)
  np.testing.assert_array_equal(local_len, [12 if compensation == "mean" else 11, 10])
  for b in range(B):
    for slot, h in enumerate((0, 2)):
      kept_k, _, comp = numpy_razor_local(keys[b, h], values[b, h], LENGTHS[b], sinks=3, window=8)
      stored_k = np.asarray(cache.local.keys[b, slot, : local_len[b]])
      if comp is None:
        np.testing.assert_array_equal(stored_k, kept_k)
      elif compensation == "mean":  # sinks, compensation token, window
        with_compensation = np.concatenate([kept_k[:3], comp[0][None], kept_k[3:]])
        np.testing.assert_allclose(stored_k, with_compensation, atol=1e-6)
      else:
        np.testing.assert_array_equal(stored_k, kept_k)
        stored_v = np.asarray(cache.compensation_values[b, slot])
        np.testing.assert_allclose(stored_v, comp[1], atol=1e-6)
        assert int(cache.dropped_counts[b]) == comp[2] == 29

  rng = np.random.default_rng(5)
  new_k, new_v = rng.normal(size=(2, B, 3, D)).astype(np.float32)
  q = rng.normal(size=(B, 3, G, D)).astype(np.float32)
  cache = cache.append(jnp.asarray(new_k), jnp.asarray(new_v))
  out = np.asarray(cache.attend(jnp.asarray(q), sm_scale=0.35))
  for b in range(B):
    for h in range(3):
      if h == 1:
        k, v, comp = keys[b, h, : LENGTHS[b]], values[b, h, : LENGTHS[b]], None
      else:
        k, v, comp = numpy_razor_local(keys[b, h], values[b, h], LENGTHS[b], sinks=3, window=8)
      k, v = np.concatenate([k, new_k[b, h][None]]), np.concatenate([v, new_v[b, h][None]])
      expected, _ = numpy_attention_with_lse(
        q[b, h], k, v, 0.35, comp, weighted=compensation == "weighted"
      )
      np.testing.assert_allclose(out[b, h], expected, atol=1e-5)


def test_weighting_the_compensation_token_changes_attention():
  mean_cache, *_ = ingest_random(RazorAttention(profile=PROFILE, budget=12, sinks=3), layer=0)
  weighted_cache, *_ = ingest_random(
    RazorAttention(profile=PROFILE, budget=12, sinks=3, compensation="weighted"), layer=0
  )
  q = jnp.asarray(np.random.default_rng(6).normal(size=(B, 3, G, D)), jnp.float32)
  a, b = mean_cache.attend(q, sm_scale=0.35), weighted_cache.attend(q, sm_scale=0.35)
  assert not np.allclose(a[0, 0], b[0, 0], atol=1e-3)  # row 0 dropped 29 tokens
  np.testing.assert_allclose(a[1], b[1], atol=1e-6)  # row 1 dropped none
  np.testing.assert_allclose(a[:, 1], b[:, 1], atol=1e-6)  # the retrieval head is untouched


def test_a_layer_of_only_retrieval_or_only_local_heads():
  profile = make_profile(SHAPE, [(0, 0), (0, 1), (0, 2)])
  caches = allocate_model_cache(
    RazorAttention(profile=profile, budget=12),
    SHAPE,
    batch=B,
    prompt_len=T,
    max_new_tokens=1,
    dtype=jnp.float32,
  )
  assert caches[0].local is None and caches[1].retrieval is None
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(B, 3, G, D)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, 3, D)), jnp.float32) for _ in range(2))
  for cache in caches:
    # One token per head in an empty cache: each head's output is that head's value.
    out = cache.append(k, v).attend(q, sm_scale=0.1)
    expected = np.broadcast_to(np.asarray(v)[:, :, None, :], (B, 3, G, D))
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


def test_budget_covering_the_prompt_keeps_everything_in_every_head():
  cache, keys, _ = ingest_random(RazorAttention(profile=PROFILE, budget=64), layer=1)
  np.testing.assert_array_equal(np.asarray(cache.local.keys[0, 0, :T]), keys[0, 1])
  np.testing.assert_array_equal(np.asarray(cache.local.keys[1, 0, :10]), keys[1, 1, :10])
  np.testing.assert_array_equal(cache.local.lengths, LENGTHS)
  assert cache.compensation_keys is None


def test_profile_of_another_model_raises_clearly(tmp_path):
  smollm = ModelCacheShape(num_layers=30, num_kv_heads=3, num_query_heads=9, head_dim=64)
  other = make_profile(smollm, [])
  path = tmp_path / "smollm.json"
  other.save(path)
  method = parse_method_spec(f"razor:profile={path},budget=16")
  message = f"razor: head profile '{path}' was computed for another model"
  with pytest.raises(ValueError, match=message):
    method.allocate(SHAPE, 0, batch=1, prompt_len=T, max_new_tokens=1, dtype=jnp.float32)


def test_a_profile_rewritten_under_the_same_path_makes_a_different_method(tmp_path):
  # The method is a static argument of jit: equal methods share compiled programs, so methods
  # holding different heads must not be equal.
  path = tmp_path / "profile.json"
  PROFILE.save(path)
  before = parse_method_spec(f"razor:profile={path},budget=16")
  assert before == parse_method_spec(f"razor:profile={path},budget=16")
  make_profile(SHAPE, [(0, 0)]).save(path)
  after = parse_method_spec(f"razor:profile={path},budget=16")
  assert after.head_profile.retrieval_heads == ((0, 0),)
  assert before != after and hash(before) != hash(after)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(profile=None), "razor: profile=<head profile JSON> is required"),
    (
      dict(budget=4),
      r"budget=4 is smaller than sinks \+ a window of 1 \+ the compensation token = 6",
    ),
    (dict(ratio=0.0), r"ratio=0.0 must be in \(0, 1\]"),
    (dict(compensation="sum"), "compensation='sum'; allowed: mean, weighted"),
    (dict(budget=12.5), "razor: budget=12.5 must be an int >= 1"),
    (dict(sinks=2.5), "razor: sinks=2.5 must be an int >= 0"),
    (dict(profile="/nonexistent/profile.json"), "does not exist; compute it once per model"),
    # the default budget (260) is checked like a given one (it made a window of -41 tokens)
    (
      dict(sinks=300),
      r"razor: the default budget=260 is smaller than sinks \+ a window of 1 \+ the "
      "compensation token = 302",
    ),
  ],
)
def test_bad_configurations_raise_clearly(kwargs, message):
  with pytest.raises(ValueError, match=message):
    RazorAttention(**({"profile": PROFILE} | kwargs))


@pytest.mark.parametrize("compensation", ["mean", "weighted"])
def test_compensation_composes_with_kivi(compensation):
  storage = Kivi(bits=4, group_size=8, residual=8)
  settings = dict(profile=PROFILE, budget=12, sinks=3, compensation=compensation)
  quantized, *_ = ingest_random(RazorAttention(**settings, storage=storage), 0)
  exact, *_ = ingest_random(RazorAttention(**settings), 0)
  q = jnp.asarray(np.random.default_rng(7).normal(size=(B, 3, G, D)), jnp.float32)
  # KIVI-4's rounding only (2026-11-25: output error at most 0.077, median 0.010 and 0.008, on
  # outputs of mean magnitude 0.29 and 0.26; lse error at most 0.022). The two compensations
  # differ by 0.48, so a swap between them fails.
  exact_out, exact_lse = exact.attend_with_lse(q, sm_scale=0.35)
  out, lse = quantized.attend_with_lse(q, sm_scale=0.35)
  np.testing.assert_allclose(out, exact_out, atol=0.1)
  assert np.median(np.abs(np.asarray(out) - np.asarray(exact_out))) < 0.02
  np.testing.assert_allclose(out, quantized.attend(q, sm_scale=0.35), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(lse, exact_lse, atol=0.05)
  assert np.median(np.abs(np.asarray(lse) - np.asarray(exact_lse))) < 0.015


class StorageWithoutLse:
  """A user's storage whose caches report no log-sum-exp."""

  def allocate_storage(self, **allocation):
    return types.SimpleNamespace(inner=FullCache().allocate_storage(**allocation))


def test_weighted_compensation_refuses_a_storage_without_lse_clearly():
  message = "compensation=weighted needs a storage that reports its log-sum-exp"
  with pytest.raises(ValueError, match=message):
    RazorAttention(
      profile=PROFILE, budget=12, compensation="weighted", storage=StorageWithoutLse()
    ).allocate(SHAPE, 0, batch=1, prompt_len=T, max_new_tokens=1, dtype=jnp.float32)


def test_generate_batch_of_two_lengths(tmp_path):
  decoder, params = tiny_decoder()
  path = tmp_path / "tiny.json"
  make_profile(decoder.cache_shape, [(0, 1)]).save(path)
  method = parse_method_spec(f"razor:profile={path},budget=10,sinks=2,compensation=weighted")
  result = run_generate(method, max_new_tokens=3)
  assert result.tokens.shape == (2, 3)
  retrieval = 2 * 2 * (37 + 3) * 16 * 4 + 2 * 4  # layer 0, 1 head: K and V, every token
  local = lambda heads: 2 * 2 * heads * (9 + 3) * 16 * 4 + 2 * 4 + 2 * 2 * heads * 16 * 4 + 2 * 4
  assert result.cache_bytes == retrieval + local(1) + local(2)
