import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import ModelCacheShape, tree_nbytes
from kvjax.compressed_context import compress_context
from kvjax.duo_attention import DuoAttention
from kvjax.duo_gate_profile import DuoGateProfile
from kvjax.generate import generate
from kvjax.method_spec import parse_method_spec
from tests.kvjax.test_duo_gate_training import reference_gated_attention
from tests.kvjax.tiny_decoder import tiny_decoder

SHAPE = ModelCacheShape(num_layers=2, num_kv_heads=3, num_query_heads=6, head_dim=8)
# Layer 0: heads 0 and 2 have the largest gates of all six; layer 1: head 1.
GATES = DuoGateProfile.from_gates(SHAPE, [[0.9, 0.1, 0.8], [0.2, 0.7, 0.3]])


def _allocate(method, layer=0, *, prompt_len=30, max_new_tokens=4):
  return method.allocate(
    SHAPE, layer, batch=2, prompt_len=prompt_len, max_new_tokens=max_new_tokens, dtype=jnp.float32
  )


def test_the_largest_gates_keep_every_token_and_the_others_sinks_and_recent():
  method = DuoAttention(profile=GATES, sinks=2, recent=5)  # GQA: half of the 6 heads full
  first, second = _allocate(method, 0), _allocate(method, 1)
  assert (first.full_heads, first.streaming_heads) == ((0, 2), (1,))
  assert (second.full_heads, second.streaming_heads) == ((1,), (0, 2))
  assert first.full.keys.shape == (2, 2, 34, 8)  # prompt + new tokens
  assert first.streaming.keys.shape == (2, 1, 7, 8)  # sinks + recent
  assert first.nbytes == tree_nbytes(first) < _allocate(parse_method_spec("full")).nbytes
  # A prompt and generation that fit in sinks + recent take no more slots than they need.
  assert _allocate(method, prompt_len=3, max_new_tokens=1).streaming.keys.shape[2] == 4
  every_head = DuoAttention(profile=GATES, full_fraction=1.0)
  assert _allocate(every_head).streaming is None


def _reference_decode(keys, values, queries, held, scale):
  """[b, heads, group, d] attention of `queries` over the positions `held[h]` of each head."""
  out = np.zeros(queries.shape)
  for b in range(keys.shape[0]):
    for h, positions in enumerate(held):
      k, v = keys[b, h, positions], values[b, h, positions]
      for g in range(queries.shape[2]):
        scores = k @ queries[b, h, g] * scale
        p = np.exp(scores - scores.max())
        out[b, h, g] = (p / p.sum()) @ v
  return out


def test_decoding_attends_over_what_each_head_keeps():
  rng = np.random.default_rng(0)
  keys = rng.normal(size=(2, 3, 34, 8)).astype(np.float32)
  values = rng.normal(size=(2, 3, 34, 8)).astype(np.float32)
  cache = _allocate(DuoAttention(profile=GATES, sinks=2, recent=5))
  cache = cache.ingest(
    jnp.asarray(keys[:, :, :30]), jnp.asarray(values[:, :, :30]), None, jnp.array([30, 30])
  )
  for position in range(30, 34):
    cache = cache.append(jnp.asarray(keys[:, :, position]), jnp.asarray(values[:, :, position]))
  queries = rng.normal(size=(2, 3, 2, 8)).astype(np.float32)
  got = cache.attend(jnp.asarray(queries), sm_scale=0.3)
  every = list(range(34))
  held = [every, [0, 1, 29, 30, 31, 32, 33], every]  # head 1 streams: 2 sinks + 5 recent
  np.testing.assert_allclose(
    got, _reference_decode(keys, values, queries, held, 0.3), rtol=1e-5, atol=1e-5
  )
  out, lse = cache.attend_with_lse(jnp.asarray(queries), sm_scale=0.3)
  np.testing.assert_allclose(out, got, atol=1e-6)
  assert lse.shape == (2, 3, 2)


def test_the_prompt_attends_as_the_gates_were_trained():
  rng = np.random.default_rng(1)
  q = rng.normal(size=(1, 3, 2, 20, 8)).astype(np.float32)
  k, v = (rng.normal(size=(1, 3, 20, 8)).astype(np.float32) for _ in range(2))
  cache = _allocate(DuoAttention(profile=GATES, sinks=2, recent=5), 1, prompt_len=20)
  got = cache.prompt_attention(q, k, v, jnp.array([20]), sm_scale=0.4, sliding_window=None)
  want = reference_gated_attention(
    q, k, v, np.array([0.0, 1.0, 0.0]), sinks=2, recent=5, sm_scale=0.4
  )
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_streaming_heads_that_hold_everything_generate_what_the_full_cache_does(gates_path):
  decoder, params = tiny_decoder()
  prompts = [list(np.random.default_rng(5).integers(1, 64, 20)), [3, 4, 5, 6, 7]]
  run = lambda method: (
    generate(
      decoder, params, prompts, max_new_tokens=6, cache_method=method, cache_dtype=jnp.float32
    ).tokens
  )
  # No head full, but sinks + recent cover the 26 tokens: every head sees every token.
  roomy = parse_method_spec(f"duo:full_fraction=0,sinks=4,recent=22,profile={gates_path}")
  np.testing.assert_array_equal(run(roomy), run(parse_method_spec("full")))


def test_every_head_full_is_the_full_cache(gates_path):
  decoder, params = tiny_decoder()
  prompts = [list(np.random.default_rng(6).integers(1, 64, 40)), [3, 4, 5, 6, 7]]
  every_head = parse_method_spec(f"duo:full_fraction=1.0,sinks=2,recent=8,profile={gates_path}")
  full = parse_method_spec("full")
  duo_context, full_context = (
    compress_context(decoder, params, prompts, cache_method=method, room=6, cache_dtype=jnp.float32)
    for method in (every_head, full)
  )
  np.testing.assert_allclose(duo_context.next_logits, full_context.next_logits, atol=1e-5)
  assert duo_context.cache_bytes == full_context.cache_bytes
  run = lambda method: (
    generate(
      decoder, params, prompts, max_new_tokens=6, cache_method=method, cache_dtype=jnp.float32
    ).tokens
  )
  np.testing.assert_array_equal(run(every_head), run(full))


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(), "duo: profile=<duo gate file JSON> is required; train it once per model with `kvjax"),
    (dict(profile=3), "duo: profile=3 must be a file path or a DuoGateProfile"),
    (dict(profile=GATES, full_fraction=1.5), "full_fraction=1.5 must be a number in \\[0, 1\\]"),
    (dict(profile=GATES, recent=0), "duo: recent=0 must be an int >= 1"),
    (dict(profile=GATES, sinks=-1), "duo: sinks=-1 must be an int >= 0"),
    (dict(profile=GATES, storage="kivi"), "duo: storage='kivi' is not a storage method"),
    (dict(profile=GATES, implementation="gpu"), "implementation='gpu'"),
  ],
)
def test_bad_configurations_raise_clearly(kwargs, message):
  with pytest.raises(ValueError, match=message):
    DuoAttention(**kwargs)


def test_gates_of_another_model_are_refused_at_allocate(tmp_path):
  path = tmp_path / "g.json"
  GATES.save(path)
  method = parse_method_spec(f"duo:profile={path}")
  other = ModelCacheShape(num_layers=2, num_kv_heads=3, num_query_heads=6, head_dim=16)
  with pytest.raises(ValueError, match=f"duo: gate file '{path}' was trained for another model"):
    method.allocate(other, 0, batch=1, prompt_len=8, max_new_tokens=1, dtype=jnp.float32)


def test_two_paths_to_equal_gates_are_one_method(tmp_path):
  for name in ("a.json", "b.json"):
    GATES.save(tmp_path / name)
  a, b = (parse_method_spec(f"duo:profile={tmp_path / n}") for n in ("a.json", "b.json"))
  assert a == b and hash(a) == hash(b)
  changed = DuoGateProfile.from_gates(SHAPE, [[0.1, 0.9, 0.8], [0.2, 0.7, 0.3]])
  changed.save(tmp_path / "a.json")
  assert parse_method_spec(f"duo:profile={tmp_path / 'a.json'}") != b


def test_deploying_with_other_sizes_than_trained_warns():
  trained = DuoGateProfile.from_gates(
    SHAPE, [[0.9, 0.1, 0.8], [0.2, 0.7, 0.3]], training=dict(sinks=2, recent=5, steps=10)
  )
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    DuoAttention(profile=trained, sinks=2, recent=5)  # as trained: silent
    DuoAttention(profile=GATES, sinks=7, recent=9)  # no record of training: silent
  with pytest.warns(UserWarning, match=r"duo: recent=9 \(trained with 5\): the gates were") as seen:
    DuoAttention(profile=trained, sinks=2, recent=9)
  assert seen[0].filename == __file__  # the caller's line, not kvjax's or dataclasses'
  with pytest.warns(UserWarning, match=r"sinks=64 \(trained with 2\), recent=256 \(trained"):
    DuoAttention(profile=trained)
