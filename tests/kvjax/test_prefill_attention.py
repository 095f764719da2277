import jax
import numpy as np
import pytest

from kvjax.prefill_attention import causal_prompt_attention


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("chunk", [4, 64])
def test_chunked_prompt_attention_equals_masked_softmax(window, chunk):
  b, h, g, t, d = 2, 2, 3, 11, 8
  q = jax.random.normal(jax.random.key(0), (b, h, g, t, d))
  k = jax.random.normal(jax.random.key(1), (b, h, t, d))
  v = jax.random.normal(jax.random.key(2), (b, h, t, d))
  got = causal_prompt_attention(q, k, v, sm_scale=0.3, sliding_window=window, query_chunk=chunk)
  scores = np.einsum("bhgqd,bhkd->bhgqk", q, k) * 0.3
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  visible = (j <= i) & ((i - j < window) if window else True)
  scores = np.where(visible, scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  expected = np.einsum("bhgqk,bhkd->bhgqd", p / p.sum(-1, keepdims=True), v)
  np.testing.assert_allclose(got, expected, atol=1e-5)


def test_a_window_or_query_chunk_below_one_is_refused():
  queries = np.zeros((1, 1, 1, 4, 8), np.float32)
  keys = np.zeros((1, 1, 4, 8), np.float32)
  for name, value in (("sliding_window", 0), ("sliding_window", 1.5), ("query_chunk", 0)):
    with pytest.raises(ValueError, match=rf"{name}={value!r} must be an int >= 1"):
      causal_prompt_attention(queries, keys, keys, sm_scale=1.0, **{name: value})


@pytest.mark.parametrize("chunk", [3, 64])
def test_streaming_heads_see_only_their_sinks_and_recent_keys(chunk):
  b, h, g, t, d = 1, 3, 2, 13, 4
  q = jax.random.normal(jax.random.key(3), (b, h, g, t, d))
  k = jax.random.normal(jax.random.key(4), (b, h, t, d))
  v = jax.random.normal(jax.random.key(5), (b, h, t, d))
  got = causal_prompt_attention(
    q, k, v, sm_scale=0.5, query_chunk=chunk, streaming_heads=(True, False, True), sinks=2, recent=3
  )
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  for head, visible in ((0, (j <= i) & ((j < 2) | (i - j < 3))), (1, j <= i)):
    scores = np.where(visible, np.einsum("gqd,kd->gqk", q[0, head], k[0, head]) * 0.5, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("gqk,kd->gqd", p / p.sum(-1, keepdims=True), v[0, head])
    np.testing.assert_allclose(got[0, head], expected, atol=1e-5)


def test_streaming_heads_need_one_flag_per_head_and_a_recent_span():
  queries = np.zeros((1, 2, 1, 4, 8), np.float32)
  keys = np.zeros((1, 2, 4, 8), np.float32)
  with pytest.raises(ValueError, match="streaming_heads has 1 flags; the keys have 2 heads"):
    causal_prompt_attention(queries, keys, keys, sm_scale=1.0, streaming_heads=(True,), recent=2)
  with pytest.raises(ValueError, match="recent=None must be an int >= 1"):
    causal_prompt_attention(queries, keys, keys, sm_scale=1.0, streaming_heads=(True, False))
