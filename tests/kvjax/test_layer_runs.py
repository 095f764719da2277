"""Scanning over runs of look-alike layers gives what calling every layer does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import allocate_model_cache, model_cache_nbytes
from kvjax.eval.continuation import score_continuation
from kvjax.layer_runs import StackedLayerCaches, flatten_layer_caches, run_layers, uniform_runs
from kvjax.method_spec import parse_method_spec
from tests.kvjax.tiny_decoder import TINY_CONFIG, tiny_decoder


def test_uniform_runs_cover_every_index_in_order():
  assert uniform_runs(list("aabaa")) == [(0, 2), (2, 3), (3, 5)]
  assert uniform_runs(list("abc")) == [(0, 1), (1, 2), (2, 3)]
  assert uniform_runs(["x"] * 4) == [(0, 4)]
  assert uniform_runs([]) == []


def _toy_layers(rng, cache_lengths):
  """Layer i: `h = tanh(x @ w_i)`; the cache step adds the cache's mean to `h` and stores `h`
  in the cache's first slot; then `x + h @ u_i`."""
  w = [jnp.asarray(rng.normal(size=(3, 3)), jnp.float32) for _ in cache_lengths]
  u = [jnp.asarray(rng.normal(size=(3, 3)), jnp.float32) for _ in cache_lengths]
  caches = [jnp.asarray(rng.normal(size=(n, 3)), jnp.float32) for n in cache_lengths]
  before = [lambda x, w=w_i: jnp.tanh(x @ w) for w_i in w]
  after = [lambda x, h, u=u_i: x + h @ u for u_i in u]
  return before, after, caches


def _toy_cache_step(h, cache):
  return h + cache.mean(0), cache.at[0].set(h)


def _run(before, after, x, caches, layer_loop, cache_step=_toy_cache_step):
  return run_layers(
    x,
    caches,
    before_cache=before,
    cache_step=cache_step,
    after_cache=after,
    layer_loop=layer_loop,
  )


@pytest.mark.parametrize("cache_lengths", [(4, 4, 4), (4, 4, 2, 4, 4), (5, 3, 2)])
def test_scan_equals_unroll_with_mixed_cache_shapes(cache_lengths):
  before, after, caches = _toy_layers(np.random.default_rng(0), cache_lengths)
  x = jnp.ones((3,), jnp.float32)
  x_scan, caches_scan = jax.jit(lambda x, c: _run(before, after, x, c, "scan"))(x, caches)
  x_loop, caches_loop = _run(before, after, x, caches, "unroll")
  np.testing.assert_allclose(x_scan, x_loop, rtol=1e-5)
  assert [c.shape for c in caches_scan] == [(n, 3) for n in cache_lengths]
  for got, want in zip(caches_scan, caches_loop):
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_scan_traces_the_cache_step_once_per_run():
  before, after, caches = _toy_layers(np.random.default_rng(0), (4, 4, 4, 2, 2, 4))
  traced = []

  def counting_step(h, cache):
    traced.append(cache.shape)
    return _toy_cache_step(h, cache)

  jax.jit(lambda x, c: _run(before, after, x, c, "scan", counting_step)).lower(
    jnp.ones((3,)), caches
  )
  assert traced == [(4, 3), (2, 3), (4, 3)]  # runs [0, 3), [3, 5), [5, 6)


def test_bad_layer_loop_and_mismatched_counts_raise():
  before, after, caches = _toy_layers(np.random.default_rng(0), (4, 4))
  with pytest.raises(ValueError, match="layer_loop='while'; allowed: scan, unroll"):
    _run(before, after, jnp.ones((3,)), caches, "while")
  with pytest.raises(
    ValueError, match="2 before_cache and 2 after_cache functions for caches of 1 layers"
  ):
    _run(before, after, jnp.ones((3,)), caches[:1], "scan")


FOUR_LAYERS = dataclasses.replace(TINY_CONFIG, num_layers=4)


@pytest.mark.parametrize(
  "spec",
  [
    "full",
    "kivi:bits=2,group_size=16,residual=16",
    # 26 s; GEAR's stacked arrays also go through the scan in test_cache_room and
    # test_context_checkpoint by default.
    pytest.param("gear:bits=2,group_size=16,block=16,rank=2,outliers=0.02", marks=pytest.mark.slow),
    "pyramidkv:budget=16,window=4",
    "streaming:budget=16,sinks=2",
  ],
)
def test_scanned_decoder_scores_like_the_unrolled_one(spec):
  """Prefill, then 8 decode steps through the cache: the same log-probs either way."""
  method = parse_method_spec(spec)
  windows = np.random.default_rng(3).integers(1, 64, (2, 48)).astype(np.int32)
  scores = {
    loop: score_continuation(
      *tiny_decoder(0, FOUR_LAYERS, loop),
      method,
      windows,
      context_len=40,
      cache_dtype=jnp.float32,
    )
    for loop in ("scan", "unroll")
  }
  np.testing.assert_allclose(scores["scan"].logprobs, scores["unroll"].logprobs, atol=2e-5)


def test_scanned_decoder_rejects_a_wrong_number_of_caches():
  decoder, params = tiny_decoder(0, FOUR_LAYERS, "scan")
  caches = allocate_model_cache(
    parse_method_spec("full"),
    decoder.cache_shape,
    batch=1,
    prompt_len=4,
    max_new_tokens=1,
    dtype=jnp.float32,
  )
  with pytest.raises(
    ValueError, match="4 before_cache and 4 after_cache functions for caches of 3 layers"
  ):
    decoder.prefill(params, jnp.ones((1, 4), jnp.int32), jnp.array([4]), caches[:3])


def test_stacked_runs_come_back_stacked_and_count_their_bytes():
  before, after, caches = _toy_layers(np.random.default_rng(0), (4, 4, 4, 2))
  x = jnp.ones((3,), jnp.float32)
  run = jax.jit(lambda x, c, keep: _run_kept(before, after, x, c, keep), static_argnums=2)
  x_kept, kept = run(x, caches, True)
  assert isinstance(kept[0], StackedLayerCaches) and kept[0].num_layers == 3
  assert not isinstance(kept[1], StackedLayerCaches)
  # A second pass over the stacked arrangement keeps it and matches the loose one.
  x_again, again = run(x_kept, kept, False)
  x_loose, loose = run(*run(x, caches, False), False)
  assert isinstance(again[0], StackedLayerCaches) and len(loose) == 4
  np.testing.assert_allclose(x_again, x_loose, rtol=1e-5)
  for got, want in zip(flatten_layer_caches(again), loose):
    np.testing.assert_allclose(got, want, rtol=1e-5)
  assert kept[0].stacked.shape == (3, 4, 3)


def _run_kept(before, after, x, caches, keep_stacked):
  return run_layers(
    x,
    caches,
    before_cache=before,
    cache_step=_toy_cache_step,
    after_cache=after,
    keep_stacked=keep_stacked,
  )


def test_stacked_layer_caches_report_the_runs_bytes_and_elements():
  decoder, params = tiny_decoder(0, FOUR_LAYERS, "scan")
  method = parse_method_spec("full")
  caches = allocate_model_cache(
    method, decoder.cache_shape, batch=2, prompt_len=8, max_new_tokens=4, dtype=jnp.bfloat16
  )
  tokens = jnp.ones((2, 8), jnp.int32)
  _, prefilled = jax.jit(decoder.prefill)(params, tokens, jnp.array([8, 5]), caches)
  assert len(prefilled) == 1 and prefilled[0].num_layers == 4
  assert model_cache_nbytes(prefilled) == model_cache_nbytes(caches)
  assert prefilled[0].stored_elements == sum(c.stored_elements for c in caches)
  np.testing.assert_array_equal(prefilled[0].layer(2).lengths, [8, 5])


@pytest.mark.parametrize("jit", [False, True])
def test_an_unrolled_loop_gives_a_stacked_run_back_stacked(jit):
  before, after, caches = _toy_layers(np.random.default_rng(1), (4, 4, 4, 2))
  x = jnp.ones((3,), jnp.float32)
  _, kept = jax.jit(lambda x, c: _run_kept(before, after, x, c, True))(x, caches)
  unrolled = lambda x, c: _run(before, after, x, c, "unroll")
  x_unroll, got = (jax.jit(unrolled) if jit else unrolled)(x, kept)
  x_scan, want = jax.jit(lambda x, c: _run(before, after, x, c, "scan"))(x, kept)
  assert isinstance(got[0], StackedLayerCaches) and got[0].num_layers == 3 and len(got) == 2
  assert jax.tree.structure(got) == jax.tree.structure(want)
  np.testing.assert_allclose(x_unroll, x_scan, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5)


def test_a_stacked_template_counts_its_elements():
  decoder, _ = tiny_decoder(0, FOUR_LAYERS, "scan")
  caches = allocate_model_cache(
    parse_method_spec("full"),
    decoder.cache_shape,
    batch=2,
    prompt_len=8,
    max_new_tokens=4,
    dtype=jnp.bfloat16,
  )
  stacked = StackedLayerCaches(jax.tree.map(lambda *leaves: jnp.stack(leaves), *caches))
  template = jax.eval_shape(lambda s: s, stacked)
  assert isinstance(jax.tree.leaves(template)[0], jax.ShapeDtypeStruct)
  assert template.stored_elements == sum(c.stored_elements for c in caches)


def test_an_unrolled_loop_updates_a_stacked_run_in_place():
  # Without the read-out barrier XLA copied the whole stack at every layer.
  before, after, caches = _toy_layers(np.random.default_rng(1), (64, 64, 64, 64))
  x = jnp.ones((3,), jnp.float32)
  _, kept = jax.jit(lambda x, c: _run_kept(before, after, x, c, True))(x, caches)
  unrolled = jax.jit(lambda x, c: _run(before, after, x, c, "unroll"), donate_argnums=1)
  hlo = unrolled.lower(x, kept).compile().as_text()
  assert not [line for line in hlo.splitlines() if " copy(" in line and "[4,64,3]" in line]
