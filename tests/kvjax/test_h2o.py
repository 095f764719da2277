import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.h2o import H2O
from kvjax.method_spec import parse_method_spec
from kvjax.selection.window_attention_scores import accumulated_prompt_attention
from tests.kvjax.test_snapkv import (
  LENGTHS,
  PROMPTS,
  SHAPE,
  B,
  D,
  H,
  T,
  ingest,
  numpy_reduce,
  numpy_top_and_window,
  random_qkv,
  run_generate,
  softmax,
)


def numpy_accumulated_attention(queries, keys, length):  # one row: [H, G, T, D], [H, T, D]
  """Every query's causal softmax row, summed over the queries (the full matrix: reference only)."""
  logits = np.einsum("hgqd,hkd->hgqk", queries[:, :, :length], keys[:, :length])
  logits = logits / np.sqrt(keys.shape[-1])
  causal = np.tril(np.ones((length, length), bool))
  return softmax(np.where(causal, logits.astype(np.float64), -np.inf)).sum(axis=2)  # [H, G, length]


def numpy_h2o_kept(queries, keys, lengths, *, budget, window, gqa_reduce):
  kept = {}
  for b, length in enumerate(lengths):
    accumulated = numpy_accumulated_attention(queries[b], keys[b], length)
    for h in range(keys.shape[1]):
      if length <= budget:
        kept[b, h] = np.arange(length)
      else:
        score = numpy_reduce(accumulated[h, :, : length - window], gqa_reduce)
        kept[b, h] = numpy_top_and_window(score, length, budget, window)
  return kept


def test_chunked_accumulation_equals_the_full_matrix_sum():
  queries, keys, _ = random_qkv(seed=4)
  total = np.asarray(
    accumulated_prompt_attention(
      jnp.asarray(queries),
      jnp.asarray(keys),
      jnp.asarray(LENGTHS),
      sm_scale=D**-0.5,
      query_chunk=7,  # 40 = 5 chunks of 7 + a padded sixth
    )
  )
  for b, length in enumerate(LENGTHS):
    np.testing.assert_allclose(
      total[b, :, :, :length], numpy_accumulated_attention(queries[b], keys[b], length), atol=1e-4
    )
    assert np.all(total[b, :, :, length:] == 0)  # padding keys receive nothing


@pytest.mark.parametrize("gqa_reduce", ["mean", "max", "sum"])
def test_kept_indices_equal_the_numpy_rule(gqa_reduce):
  queries, keys, _ = random_qkv(seed=5)
  method = H2O(budget=14, window=3, gqa_reduce=gqa_reduce, query_chunk=8)
  indices, kept_lengths = method.selector(SHAPE, prompt_len=T).kept_indices(
    jnp.asarray(keys), jnp.asarray(queries), jnp.asarray(LENGTHS)
  )
  expected = numpy_h2o_kept(queries, keys, LENGTHS, budget=14, window=3, gqa_reduce=gqa_reduce)
  np.testing.assert_array_equal(kept_lengths, [14, 14])
  for (b, h), kept in expected.items():
    np.testing.assert_array_equal(np.asarray(indices[b, h, :14]), kept)


def test_cache_holds_only_the_heavy_hitters_and_the_window():
  queries, keys, values = random_qkv(seed=6)
  method = H2O(budget=14, window=3, query_chunk=16)
  cache = method.allocate(SHAPE, 0, batch=B, prompt_len=T, max_new_tokens=2, dtype=jnp.float32)
  cache = ingest(cache, queries, keys, values)
  expected = numpy_h2o_kept(queries, keys, LENGTHS, budget=14, window=3, gqa_reduce="mean")
  assert cache.storage.keys.shape == (B, H, 14 + 2, D)
  for (b, h), kept in expected.items():
    np.testing.assert_array_equal(np.asarray(cache.storage.values[b, h, :14]), values[b, h, kept])


def test_budget_covering_the_prompt_keeps_every_token():
  queries, keys, values = random_qkv(seed=7)
  method = H2O(budget=T, window=3)
  cache = method.allocate(SHAPE, 0, batch=B, prompt_len=T, max_new_tokens=1, dtype=jnp.float32)
  cache = ingest(cache, queries, keys, values)
  np.testing.assert_array_equal(cache.lengths, LENGTHS)
  np.testing.assert_array_equal(np.asarray(cache.storage.keys[0, :, :T]), keys[0])


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(budget=2, window=3), r"h2o: budget=2 is smaller than window \+ 1 \(a heavy-hitter"),
    # The window alone keeps no heavy hitter (h2o_decode refuses it too).
    (dict(budget=3, window=3), r"budget=3 is smaller than window \+ 1 \(a heavy-hitter slot\) = 4"),
    (dict(ratio=-0.5), r"ratio=-0.5 must be in \(0, 1\]"),
    (dict(query_chunk=0), "query_chunk=0 must be an int >= 1"),
    (dict(budget=16, window=2.5), "h2o: window=2.5 must be an int >= 1"),
    (dict(gqa_reduce="min"), "gqa_reduce='min'"),
    # Refused at construction, not while tracing the first ingest of a prompt over 1024.
    (dict(window=2000), r"h2o: the default budget=1024 is smaller than window \+ 1 .* = 2001"),
  ],
)
def test_bad_configurations_raise_clearly(kwargs, message):
  with pytest.raises(ValueError, match=message):
    H2O(**kwargs)


def test_generate_batch_of_two_lengths():
  """Both rows (37 and 22 tokens) cut to the 10-token budget at prefill: each generates what it
  generates alone (its scores, choice and padding its own), and not what the full cache does.
  Which tokens are kept is checked against numpy by the ingest tests above."""
  method = parse_method_spec("h2o:budget=10,window=4,query_chunk=16")
  assert method == H2O(budget=10, window=4, query_chunk=16)
  result = run_generate(method, max_new_tokens=3)
  assert result.cache_bytes == 2 * (2 * 2 * 2 * (10 + 3) * 16 * 4 + 2 * 4)
  for row, prompt in enumerate(PROMPTS):
    alone = run_generate(method, max_new_tokens=3, prompts=[prompt])
    np.testing.assert_array_equal(result.tokens[row], alone.tokens[0])
  full = run_generate(parse_method_spec("full"), max_new_tokens=3)
  assert not np.array_equal(result.tokens, full.tokens)
