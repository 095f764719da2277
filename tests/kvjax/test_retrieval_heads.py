import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import ModelCacheShape
from kvjax.retrieval_heads import (
  HeadProfile,
  compute_head_profile,
  echo_induction_scores,
  probe_tokens,
  select_retrieval_heads,
)
from models.nnx_decoder import split_decoder
from models.weights import random_decoder
from tests.kvjax.test_razor_attention import make_profile
from tests.kvjax.test_snapkv import softmax
from tests.kvjax.tiny_decoder import TINY_CONFIG, tiny_decoder


def numpy_echo_induction(
  queries, keys, length, *, block_len, prefix_len, sm_scale, sliding_window=None
):
  """The paper's scores for one row, query by query: [H, G] echo and induction means (query i
  attending to keys i - sliding_window < j <= i on a sliding-window model)."""
  num_heads, group = queries.shape[:2]
  echo = np.zeros((num_heads, group))
  induction = np.zeros((num_heads, group))
  scored = range(prefix_len + block_len, length)
  for i in scored:
    first = 0 if sliding_window is None else max(0, i - sliding_window + 1)
    logits = np.einsum("hgd,hkd->hgk", queries[:, :, i], keys[:, first : i + 1]) * sm_scale
    probs = softmax(logits.astype(np.float64))  # over keys first..i
    earlier = [i - k * block_len for k in range(1, (i - prefix_len) // block_len + 1)]
    echo += probs[:, :, [j - first for j in earlier if j >= first]].sum(-1)
    induction += probs[:, :, [j + 1 - first for j in earlier if j + 1 >= first]].sum(-1)
  return echo / len(scored), induction / len(scored)


@pytest.mark.parametrize("sliding_window", [None, 8])
def test_scores_equal_the_numpy_statement_on_random_inputs(sliding_window):
  rng = np.random.default_rng(0)
  batch, heads, group, head_dim, block_len, repeats = 2, 2, 3, 8, 6, 3
  prompt_len = 1 + block_len * repeats
  queries = rng.normal(size=(batch, heads, group, prompt_len, head_dim)).astype(np.float32)
  keys = rng.normal(size=(batch, heads, prompt_len, head_dim)).astype(np.float32)
  lengths = np.array([prompt_len, prompt_len - 4], np.int32)
  echo, induction = echo_induction_scores(
    jnp.asarray(queries),
    jnp.asarray(keys),
    jnp.asarray(lengths),
    block_len=block_len,
    prefix_len=1,
    sm_scale=0.4,
    query_chunk=5,
    sliding_window=sliding_window,
  )
  for b in range(batch):
    expected_echo, expected_induction = numpy_echo_induction(
      queries[b],
      keys[b],
      lengths[b],
      block_len=block_len,
      prefix_len=1,
      sm_scale=0.4,
      sliding_window=sliding_window,
    )
    np.testing.assert_allclose(echo[b], expected_echo, atol=1e-5)
    np.testing.assert_allclose(induction[b], expected_induction, atol=1e-5)


def test_a_constructed_induction_head_and_echo_head_are_found():
  """Queries carry the current token; keys the previous token (induction) or the token (echo)."""
  block_len, repeats, vocab = 12, 4, 16
  rng = np.random.default_rng(1)
  block = rng.permutation(vocab)[:block_len]
  tokens = np.concatenate([[vocab - 1], np.tile(block, repeats)])  # BOS, then the repeats
  prompt_len = len(tokens)
  onehot = np.eye(vocab)[tokens]  # [T, vocab] (head_dim = vocab)
  previous = np.concatenate([np.zeros((1, vocab)), onehot[:-1]])
  # 2 layers x 2 KV heads, 2 query heads per group. Layer 0, KV head 1, query head 0: induction.
  # Layer 1, KV head 0, query head 1: echo. Everything else: random.
  queries = rng.normal(size=(2, 1, 2, 2, prompt_len, vocab)) * 0.3
  keys = rng.normal(size=(2, 1, 2, prompt_len, vocab)) * 0.3
  queries[0, 0, 1, 0] = 40 * onehot
  keys[0, 0, 1] = previous
  queries[1, 0, 0, 1] = 40 * onehot
  keys[1, 0, 0] = onehot
  lengths = jnp.asarray([prompt_len])
  scores = [
    echo_induction_scores(
      jnp.asarray(queries[layer], jnp.float32),
      jnp.asarray(keys[layer], jnp.float32),
      lengths,
      block_len=block_len,
      prefix_len=1,
      sm_scale=0.25,
      query_chunk=16,
    )
    for layer in range(2)
  ]
  echo = np.stack([np.asarray(e)[0].max(-1) for e, _ in scores])  # [layers, kv_heads]
  induction = np.stack([np.asarray(i)[0].max(-1) for _, i in scores])
  assert induction[0, 1] > 0.95 and np.delete(induction.ravel(), 1).max() < 0.3
  # The echo head also attends to itself, so repeat r gives r / (r + 1) of its mass to echoes.
  assert echo[1, 0] > 0.6 and np.delete(echo.ravel(), 2).max() < 0.3
  select = lambda echo_ratio: select_retrieval_heads(
    induction, echo, induction_ratio=0.25, echo_ratio=echo_ratio
  )
  assert select(0.0) == ((0, 1),)
  assert select(0.25) == ((0, 1), (1, 0))


def test_selection_counts_are_ceil_of_the_ratio_over_all_heads():
  rng = np.random.default_rng(2)
  induction, echo = rng.random((30, 3)), rng.random((30, 3))
  chosen = select_retrieval_heads(induction, echo, induction_ratio=0.14, echo_ratio=0.01)
  top_induction = set(map(tuple, np.argwhere(induction >= np.sort(induction.ravel())[-13])))
  top_echo = {tuple(np.unravel_index(echo.argmax(), echo.shape))}
  assert set(chosen) == top_induction | top_echo  # ceil(0.14 x 90) = 13, ceil(0.01 x 90) = 1


def _echo_decoder(echo_kv_head: int):
  """A tiny decoder whose layer-0 KV head `echo_kv_head` attends to earlier copies of the token.

  The probe tokens get orthonormal embeddings in 6 hidden dims; that head's queries and keys
  read them into the head dims of RoPE's slowest frequencies (rope_theta 1e12: rotation by a
  few hundred positions is negligible there), queries scaled up; every other head is blind
  (zero queries: uniform attention).
  """
  config = dataclasses.replace(TINY_CONFIG, rope_theta=1e12)
  model = random_decoder(config, seed=3)
  hidden, head_dim, group = config.hidden_size, config.head_dim, config.query_group_size
  embedding = np.asarray(model.embed_tokens.embedding[...]).copy()
  probe_ids = np.arange(20, 26)
  embedding[probe_ids] = 0
  embedding[probe_ids, np.arange(6)] = 1.0
  model.embed_tokens.embedding[...] = jnp.asarray(embedding)
  slow_dims = np.array([5, 6, 7, 13, 14, 15])  # frequency pairs 5..7 of head_dim 16
  read = np.zeros((hidden, head_dim))
  read[np.arange(6), slow_dims] = 1.0
  for layer in model.layers:
    q_kernel = np.zeros((hidden, config.num_heads * head_dim))
    k_kernel = np.zeros((hidden, config.num_kv_heads * head_dim))
    if layer is model.layers[0]:
      for g in range(group):
        query_head = echo_kv_head * group + g
        q_kernel[:, query_head * head_dim : (query_head + 1) * head_dim] = 20 * read
      k_kernel[:, echo_kv_head * head_dim : (echo_kv_head + 1) * head_dim] = read
    layer.self_attn.q_proj.kernel[...] = jnp.asarray(q_kernel)
    layer.self_attn.k_proj.kernel[...] = jnp.asarray(k_kernel)
  return split_decoder(model)


def test_detection_through_a_decoder_finds_the_constructed_head(tmp_path):
  decoder, params = _echo_decoder(echo_kv_head=1)
  profile = compute_head_profile(
    decoder,
    params,
    vocab_size=64,
    block_len=8,
    repeats=3,
    token_range=(20, 26),
    induction_ratio=0.0,
    echo_ratio=0.25,
    model_name="echo-constructed",
  )
  echo = np.asarray(profile.echo_scores)
  assert echo.shape == (2, 2) and np.argmax(echo) == 1  # layer 0, KV head 1
  # Random blocks of 8 from 6 ids repeat ids inside a block, which dilutes the echo mass.
  assert echo[0, 1] > 0.25 and echo[0, 1] > 3 * np.delete(echo.ravel(), 1).max(), echo
  assert profile.retrieval_heads == ((0, 1),)
  path = tmp_path / "profile.json"
  profile.save(path)
  assert HeadProfile.load(path) == profile
  assert json.loads(path.read_text())["model"]["num_layers"] == 2


def test_profile_of_a_random_decoder_has_the_models_shape_and_checks_it(tmp_path):
  decoder, params = tiny_decoder()
  profile = compute_head_profile(
    decoder, params, vocab_size=64, block_len=8, repeats=3, bos_token_id=1, batch=2
  )
  assert np.asarray(profile.induction_scores).shape == (2, 2)
  assert all(0.0 <= s <= 1.0 for row in profile.induction_scores + profile.echo_scores for s in row)
  # ceil(0.14 x 4) = 1 head by induction, ceil(0.01 x 4) = 1 by echo (possibly the same one).
  assert 1 <= len(profile.retrieval_heads) <= 2
  profile.check_matches(decoder.cache_shape)
  other = ModelCacheShape(num_layers=30, num_kv_heads=3, num_query_heads=9, head_dim=64)
  message = "computed for another model .*num_layers=2.*this model has num_layers=30"
  with pytest.raises(ValueError, match=message):
    profile.check_matches(other)
  assert hash(profile) == hash(HeadProfile.load(_saved(profile, tmp_path)))


def test_profile_of_a_decoder_scanning_its_layers_is_the_unrolled_ones():
  """A scanning decoder returns its look-alike probe caches stacked (kvjax.layer_runs): the
  scores are read layer by layer all the same."""
  settings = dict(vocab_size=64, block_len=8, repeats=3, bos_token_id=1)
  unrolled = compute_head_profile(*tiny_decoder(layer_loop="unroll"), **settings)
  scanned = compute_head_profile(*tiny_decoder(layer_loop="scan"), **settings)
  assert np.asarray(scanned.induction_scores).shape == (2, 2)
  np.testing.assert_allclose(scanned.induction_scores, unrolled.induction_scores, atol=1e-6)
  np.testing.assert_allclose(scanned.echo_scores, unrolled.echo_scores, atol=1e-6)
  assert scanned.retrieval_heads == unrolled.retrieval_heads


def _saved(profile, tmp_path):
  path = tmp_path / "p.json"
  profile.save(path)
  return path


def test_probe_tokens_repeat_a_mid_vocabulary_block():
  tokens = probe_tokens(vocab_size=100, block_len=5, repeats=3, batch=2, seed=0, bos_token_id=7)
  assert tokens.shape == (2, 16) and np.all(tokens[:, 0] == 7)
  np.testing.assert_array_equal(tokens[:, 1:6], tokens[:, 6:11])
  assert tokens[:, 1:].min() >= 25 and tokens[:, 1:].max() < 75


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(repeats=1), "repeats=1 must be an int >= 2"),
    (dict(block_len=1), "block_len=1 must be an int >= 2"),
    (dict(query_chunk=0), "query_chunk=0 must be an int >= 1"),
    (dict(query_chunk=-1), "query_chunk=-1 must be an int >= 1"),
    (dict(seed=-1), "seed=-1 must be an int >= 0"),
    (dict(induction_ratio=1.5), r"induction_ratio=1.5 must be in \[0, 1\]"),
    (dict(max_positions=16), "probe of 25 tokens .* exceeds the model's context of 16"),
  ],
)
def test_bad_detection_settings_raise_clearly(kwargs, message):
  decoder, params = tiny_decoder()
  settings = dict(vocab_size=64, block_len=8, repeats=3, bos_token_id=1) | kwargs
  with pytest.raises(ValueError, match=message):
    compute_head_profile(decoder, params, **settings)


def test_loading_bad_files_raises_clearly(tmp_path):
  with pytest.raises(ValueError, match="does not exist; compute it once per model"):
    HeadProfile.load(tmp_path / "missing.json")
  (tmp_path / "other.json").write_text('{"format": "something-else"}')
  with pytest.raises(ValueError, match="not a kvjax head profile"):
    HeadProfile.load(tmp_path / "other.json")
  (tmp_path / "broken.json").write_text("{")
  with pytest.raises(ValueError, match="is not valid JSON"):
    HeadProfile.load(tmp_path / "broken.json")


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(block_len=0), "block_len=0 must be an int >= 1"),
    (dict(repeats=0), "repeats=0 must be an int >= 1"),
    (dict(block_len=2.5), "block_len=2.5 must be an int >= 1"),
    # The generator truncated float bounds: (10.5, 12.9) drew id 10.
    (dict(token_range=(10.5, 12.9)), r"token_range=\(10.5, 12.9\) must be a pair of ints"),
    (dict(token_range=(10,)), r"token_range=\(10,\) must be a pair of ints"),
  ],
)
def test_probe_tokens_refuse_an_empty_probe(kwargs, message):
  with pytest.raises(ValueError, match=message):
    probe_tokens(**(dict(vocab_size=100, block_len=5, repeats=3) | kwargs))


def test_a_profile_naming_a_head_twice_or_a_float_head_is_refused(tmp_path):
  """A repeated head would give its layer an extra KV head in the retrieval storage."""
  shape = ModelCacheShape(num_layers=2, num_kv_heads=3, num_query_heads=6, head_dim=8)
  data = make_profile(shape, [(0, 1)]).to_json_dict()
  (tmp_path / "twice.json").write_text(json.dumps(data | {"retrieval_heads": [[0, 1], [0, 1]]}))
  with pytest.raises(ValueError, match=r"name a \(layer, kv_head\) more than once"):
    HeadProfile.load(tmp_path / "twice.json")
  (tmp_path / "float.json").write_text(json.dumps(data | {"retrieval_heads": [[0, 1.5]]}))
  with pytest.raises(ValueError, match=r"retrieval head \[0, 1.5\] must be two ints"):
    HeadProfile.load(tmp_path / "float.json")


@pytest.mark.parametrize("field, stored", [("head_dim", 8.9), ("num_query_heads", "6")])
def test_a_profile_with_a_model_count_that_is_not_an_int_is_refused(tmp_path, field, stored):
  """int() read head_dim 8.9 as 8 (and "6" as 6): the profile then matched a model the file
  does not name."""
  shape = ModelCacheShape(num_layers=2, num_kv_heads=3, num_query_heads=6, head_dim=8)
  data = make_profile(shape, [(0, 1)]).to_json_dict()
  data["model"][field] = stored
  (tmp_path / "p.json").write_text(json.dumps(data))
  with pytest.raises(
    ValueError, match=rf"malformed head profile \(model {field}=.* must be an int"
  ):
    HeadProfile.load(tmp_path / "p.json")


def test_selecting_heads_refuses_bad_ratios_and_scores_that_are_not_a_table():
  scores = np.arange(6.0).reshape(2, 3)
  # A negative ratio made the count negative and the slice order[:-k] took almost every head.
  with pytest.raises(ValueError, match=r"induction_ratio=-0.2 must be in \[0, 1\]"):
    select_retrieval_heads(scores, scores, induction_ratio=-0.2, echo_ratio=0.0)
  with pytest.raises(ValueError, match=r"echo_ratio='0.1' must be in \[0, 1\]"):
    select_retrieval_heads(scores, scores, induction_ratio=0.1, echo_ratio="0.1")
  with pytest.raises(ValueError, match=r"induction_scores \(6,\) .* must both be \[layers"):
    HeadProfile.from_scores(
      ModelCacheShape(num_layers=2, num_kv_heads=3, num_query_heads=3, head_dim=8),
      scores.reshape(-1),
      scores.reshape(-1),
    )
  with pytest.raises(ValueError, match=r"echo_scores \(3, 2\) must"):
    select_retrieval_heads(scores, scores.T, induction_ratio=0.1, echo_ratio=0.1)
