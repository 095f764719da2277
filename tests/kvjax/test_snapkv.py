import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import ModelCacheShape
from kvjax.dense_cache import FullCache
from kvjax.generate import generate
from kvjax.kivi_cache import Kivi
from kvjax.method_spec import parse_method_spec
from kvjax.selection.window_attention_scores import observation_window_attention
from kvjax.snapkv import SnapKV
from tests.kvjax.tiny_decoder import tiny_decoder

B, H, G, T, D = 2, 2, 3, 40, 8
LENGTHS = np.array([40, 27], np.int32)
SHAPE = ModelCacheShape(num_layers=1, num_kv_heads=H, num_query_heads=H * G, head_dim=D)


def random_qkv(seed=0, batch=B, kv_heads=H, group=G, prompt=T, head_dim=D):
  rng = np.random.default_rng(seed)
  queries = rng.normal(size=(batch, kv_heads, group, prompt, head_dim)).astype(np.float32)
  keys = rng.normal(size=(batch, kv_heads, prompt, head_dim)).astype(np.float32)
  values = rng.normal(size=(batch, kv_heads, prompt, head_dim)).astype(np.float32)
  return queries, keys, values


def ingest(cache, queries, keys, values, lengths=LENGTHS):
  as_jax = lambda x: jnp.asarray(x)
  return cache.ingest(as_jax(keys), as_jax(values), as_jax(queries), as_jax(lengths))


def run_generate(method, *, max_new_tokens, prompts=None):
  """Greedy generation with the tiny decoder, batch 2 of different lengths by default."""
  decoder, params = tiny_decoder()
  return generate(
    decoder,
    params,
    PROMPTS if prompts is None else prompts,
    max_new_tokens=max_new_tokens,
    cache_dtype=jnp.float32,
    cache_method=method,
  )


def softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def numpy_pool(x, kernel, pooling):
  """PyTorch max_pool1d / avg_pool1d(count_include_pad=True), stride 1, padding kernel // 2."""
  pad = kernel // 2
  fill = -np.inf if pooling == "max" else 0.0
  padded = np.concatenate([np.full(pad, fill), x, np.full(pad, fill)])
  windows = np.stack([padded[i : i + len(x)] for i in range(kernel)])
  return windows.max(0) if pooling == "max" else windows.sum(0) / kernel


def numpy_reduce(scores, gqa_reduce):  # [group, tokens]
  return dict(mean=scores.mean, max=scores.max, sum=scores.sum)[gqa_reduce](axis=0)


def numpy_top_and_window(score, length, budget, window):
  """Top (budget - window) of the prefix (ties: earlier token) + the window, ascending."""
  top = np.argsort(-score, kind="stable")[: budget - window]
  return np.concatenate([np.sort(top), np.arange(length - window, length)])


def numpy_snapkv_kept(queries, keys, lengths, *, budget, window, kernel, pooling, gqa_reduce):
  """The SnapKV rule, row by row and head by head, on each row's own tokens."""
  kept = {}
  for b, length in enumerate(lengths):
    for h in range(keys.shape[1]):
      if length <= budget:
        kept[b, h] = np.arange(length)
        continue
      k = keys[b, h, :length].astype(np.float64)
      per_query_head = []
      for g in range(queries.shape[2]):
        q = queries[b, h, g, length - window : length].astype(np.float64)
        logits = q @ k.T / np.sqrt(k.shape[-1])
        causal = np.arange(length)[None, :] <= np.arange(length - window, length)[:, None]
        probs = softmax(np.where(causal, logits, -np.inf))
        per_query_head.append(numpy_pool(probs[:, : length - window].sum(0), kernel, pooling))
      score = numpy_reduce(np.stack(per_query_head), gqa_reduce)
      kept[b, h] = numpy_top_and_window(score, length, budget, window)
  return kept


@pytest.mark.parametrize(
  "kernel, pooling, gqa_reduce",
  [(7, "max", "mean"), (5, "avg", "max"), (3, "max", "sum"), (1, "avg", "mean")],
)
def test_kept_indices_equal_the_numpy_rule(kernel, pooling, gqa_reduce):
  queries, keys, _ = random_qkv(seed=kernel)
  method = SnapKV(budget=16, window=4, kernel=kernel, pooling=pooling, gqa_reduce=gqa_reduce)
  selector = method.selector(SHAPE, prompt_len=T)
  indices, kept_lengths = selector.kept_indices(
    jnp.asarray(keys), jnp.asarray(queries), jnp.asarray(LENGTHS)
  )
  expected = numpy_snapkv_kept(
    queries,
    keys,
    LENGTHS,
    budget=16,
    window=4,
    kernel=kernel,
    pooling=pooling,
    gqa_reduce=gqa_reduce,
  )
  np.testing.assert_array_equal(kept_lengths, [16, 16])
  for (b, h), kept in expected.items():
    np.testing.assert_array_equal(np.asarray(indices[b, h, : kept_lengths[b]]), kept)


def test_window_attention_equals_the_rows_of_full_attention():
  queries, keys, _ = random_qkv(seed=3)
  summed = np.asarray(
    observation_window_attention(
      jnp.asarray(queries), jnp.asarray(keys), jnp.asarray(LENGTHS), window=5, sm_scale=0.3
    )
  )
  for b, length in enumerate(LENGTHS):
    logits = np.einsum("hgqd,hkd->hgqk", queries[b, :, :, :length], keys[b, :, :length]) * 0.3
    causal = np.tril(np.ones((length, length), bool))
    probs = softmax(np.where(causal, logits, -np.inf))  # the full matrix, as a reference only
    np.testing.assert_allclose(summed[b, :, :, :length], probs[:, :, -5:].sum(2), atol=1e-5)
    assert np.all(summed[b, :, :, length:] == 0)


def test_cache_stores_exactly_the_kept_tokens_then_decodes_over_them():
  queries, keys, values = random_qkv(seed=1)
  method = SnapKV(budget=16, window=4, kernel=5)
  cache = method.allocate(SHAPE, 0, batch=B, prompt_len=T, max_new_tokens=3, dtype=jnp.float32)
  cache = ingest(cache, queries, keys, values)
  expected = numpy_snapkv_kept(
    queries, keys, LENGTHS, budget=16, window=4, kernel=5, pooling="max", gqa_reduce="mean"
  )
  assert cache.storage.capacity == 16 + 3
  np.testing.assert_array_equal(cache.lengths, [16, 16])
  for (b, h), kept in expected.items():
    np.testing.assert_array_equal(np.asarray(cache.storage.keys[b, h, :16]), keys[b, h, kept])
    np.testing.assert_array_equal(np.asarray(cache.storage.values[b, h, :16]), values[b, h, kept])

  rng = np.random.default_rng(9)
  new_k, new_v = rng.normal(size=(2, B, H, D)).astype(np.float32)
  q = rng.normal(size=(B, H, G, D)).astype(np.float32)
  cache = cache.append(jnp.asarray(new_k), jnp.asarray(new_v))
  out = np.asarray(cache.attend(jnp.asarray(q), sm_scale=0.4))
  for (b, h), kept in expected.items():
    k = np.concatenate([keys[b, h, kept], new_k[b, h][None]])
    v = np.concatenate([values[b, h, kept], new_v[b, h][None]])
    np.testing.assert_allclose(out[b, h], softmax(q[b, h] @ k.T * 0.4) @ v, atol=1e-5)


def test_short_rows_and_budgets_above_the_prompt_keep_everything():
  queries, keys, values = random_qkv(seed=2)
  for method in (SnapKV(budget=30, window=4), SnapKV(budget=500, window=4), SnapKV(ratio=1.0)):
    cache = method.allocate(SHAPE, 0, batch=B, prompt_len=T, max_new_tokens=2, dtype=jnp.float32)
    cache = ingest(cache, queries, keys, values)
    # Row 1 (27 tokens) fits every one of these budgets: all its tokens, in order.
    np.testing.assert_array_equal(np.asarray(cache.storage.keys[1, :, :27]), keys[1, :, :27])
    assert int(cache.lengths[1]) == 27
  assert int(cache.lengths[0]) == 40 and cache.storage.capacity == 40 + 2


def test_ratio_gives_the_budget_from_the_padded_prompt_length():
  assert SnapKV(ratio=0.25, window=4).prompt_budget(40) == 10
  assert SnapKV(ratio=0.3, window=2).prompt_budget(10) == 3
  assert SnapKV(budget=64).prompt_budget(40) == 40
  assert SnapKV().prompt_budget(5000) == 1024  # the default budget


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(budget=8, window=16), r"snapkv: budget=8 is smaller than window = 16"),
    (dict(ratio=0.0), r"ratio=0.0 must be in \(0, 1\]"),
    (dict(ratio=1.5), r"ratio=1.5 must be in \(0, 1\]"),
    (dict(budget=64, ratio=0.5), "not both"),
    (dict(pooling="min"), "pooling='min'; allowed: max, avg"),
    (dict(kernel=4), "kernel=4 must be an odd integer"),
    (dict(gqa_reduce="median"), "gqa_reduce='median'; allowed: mean, max, sum"),
    (dict(window=0), "window=0 must be an int >= 1"),
    # a float would reach array shapes inside tracing, a bool would pass for 1
    (dict(budget=16.5), r"snapkv: budget=16.5 must be an int >= 1"),
    (dict(kernel=3.0), r"snapkv: kernel=3.0 must be an int >= 1"),
    (dict(budget=True, window=1), r"snapkv: budget=True must be an int"),
    (dict(ratio="0.5"), r"snapkv: ratio=.0.5. must be a number in \(0, 1\]"),
    (dict(storage="kivi"), "is not a storage method"),
    # the default budget (1024) is checked like a given one: not silently shrunk to the window
    (dict(window=2000), r"snapkv: the default budget=1024 is smaller than window = 2000"),
  ],
)
def test_bad_configurations_raise_clearly(kwargs, message):
  with pytest.raises(ValueError, match=message):
    SnapKV(**kwargs)


def test_a_ratio_that_keeps_fewer_tokens_than_the_window_raises_at_allocate():
  message = "ratio=0.1 of a 40-token prompt keeps 4 tokens, fewer than window = 8"
  with pytest.raises(ValueError, match=message):
    SnapKV(ratio=0.1, window=8).allocate(
      SHAPE, 0, batch=1, prompt_len=40, max_new_tokens=1, dtype=jnp.float32
    )


def test_spec_parses_and_composes_with_a_storage():
  method = parse_method_spec("snapkv:budget=64,window=8,pooling=avg,gqa_reduce=max")
  assert method == SnapKV(budget=64, window=8, pooling="avg", gqa_reduce="max")
  assert method.storage == FullCache()


PROMPTS = [np.random.default_rng(row).integers(1, 63, n).tolist() for row, n in enumerate((37, 22))]


def test_budget_at_least_the_prompt_generates_exactly_what_the_full_cache_does():
  decoder, params = tiny_decoder()
  full = generate(decoder, params, PROMPTS, max_new_tokens=4, cache_dtype=jnp.float32)
  snap = generate(
    decoder,
    params,
    PROMPTS,
    max_new_tokens=4,
    cache_dtype=jnp.float32,
    cache_method=SnapKV(budget=37, window=4),
  )
  np.testing.assert_array_equal(snap.tokens, full.tokens)
  assert snap.cache_bytes == full.cache_bytes


def test_generate_batch_of_two_lengths_with_a_real_saving():
  decoder, params = tiny_decoder()
  result = generate(
    decoder,
    params,
    PROMPTS,
    max_new_tokens=4,
    cache_dtype=jnp.float32,
    cache_method=SnapKV(budget=12, window=4, kernel=3),
  )
  assert result.tokens.shape == (2, 4)
  # 2 layers x K and V x [2 rows, 2 KV heads, 12 kept + 4 new, 16] float32 + lengths.
  assert result.cache_bytes == 2 * (2 * 2 * 2 * 16 * 16 * 4 + 2 * 4)


def test_composes_with_kivi_under_generate():
  decoder, params = tiny_decoder()
  storage = Kivi(bits=4, group_size=16, residual=16)
  method = SnapKV(budget=20, window=4, storage=storage)
  result = run_generate(method, max_new_tokens=3)
  assert result.tokens.shape == (2, 3)
  per_layer = storage.allocate_storage(
    batch=2, kv_heads=2, capacity=20 + 3, head_dim=16, dtype=jnp.float32
  )
  assert result.cache_bytes == 2 * per_layer.nbytes
  spec = "snapkv:budget=20,window=4+kivi:bits=4,group_size=16,residual=16"
  assert parse_method_spec(spec) == method
