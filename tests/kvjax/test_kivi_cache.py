import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.cache_protocol import ModelCacheShape
from kvjax.dense_cache import FullCache
from kvjax.gear_cache import Gear
from kvjax.generate import generate, prefill
from kvjax.kivi_cache import Kivi, KiviLayerCache
from kvjax.method_spec import describe_method, parse_method_spec
from kvjax.teacher_forcing import teacher_force
from models.config import DecoderConfig
from models.nnx_decoder import split_decoder
from models.weights import random_decoder
from tests.kvjax.test_snapkv import softmax

B, H, G, D = 2, 2, 3, 32

# head_dim 32, so the authors' group size of 32 channels fits.
TINY_CONFIG = DecoderConfig(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=64,
  num_layers=1,  # one layer keeps compilation short; the layer loop is the model's business
  num_heads=4,
  num_kv_heads=2,
  head_dim=32,
  max_position_embeddings=256,
)


@functools.cache
def tiny_decoder():
  return split_decoder(random_decoder(TINY_CONFIG, seed=1))


def _random(seed, *shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@jax.jit
def _ingest(cache, keys, values, lengths):
  return cache.ingest(keys, values, None, lengths)


@jax.jit
def _append(cache, keys, values):
  return cache.append(keys, values)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _attend(cache, queries, sm_scale):
  return cache.attend(queries, sm_scale=sm_scale)


@jax.jit
def _dequantized(cache):
  return cache.dequantized()


def explicit_attention(cache: KiviLayerCache, queries, sm_scale):
  """Softmax attention over the explicitly dequantized K/V of every valid slot (numpy)."""
  keys, values, _ = (np.asarray(x) for x in _dequantized(cache))
  quantized_lengths = np.asarray(cache.quantized_lengths)
  window_lengths = np.asarray(cache.window_lengths)
  capacity = cache.quantized_capacity
  out = np.zeros(queries.shape, np.float32)
  for row in range(queries.shape[0]):
    slots = np.r_[0 : quantized_lengths[row], capacity : capacity + window_lengths[row]]
    if not slots.size:
      continue  # an empty row attends to nothing: out 0
    scores = np.einsum("hgd,htd->hgt", np.asarray(queries[row]), keys[row][:, slots]) * sm_scale
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out[row] = np.einsum("hgt,htd->hgd", probs, values[row][:, slots])
  return out


# One cache capacity and prompt shape for the streaming and attention tests, so the jitted
# ingest of a configuration compiles once.
CAPACITY, PROMPT = 48, 44


def assert_streaming_equals_ingesting(method, *, dtype, start_lengths, steps, exact=True):
  """Appends one token per step to an ingested prefix; after every step the cache equals the
  cache that ingests each row's tokens so far at once, except that a window the step filled
  still holds its block in full precision (it is quantized at the next append: KIVI attends
  over it first), where ingesting quantizes it."""
  keys = _random(0, B, H, PROMPT, D, dtype=dtype)
  values = _random(1, B, H, PROMPT, D, dtype=dtype)
  start_lengths = np.asarray(start_lengths, np.int32)
  empty = method.allocate_storage(batch=B, kv_heads=H, capacity=CAPACITY, head_dim=D, dtype=dtype)
  window = empty.window
  # One prompt shape for every ingest: one compilation (the lengths say what is real).
  streamed = _ingest(empty, keys, values, jnp.asarray(start_lengths))
  rows = np.arange(B)
  filled_steps = 0
  for step in range(steps):
    position = start_lengths + step
    streamed = _append(streamed, keys[rows, :, position], values[rows, :, position])
    np.testing.assert_array_equal(streamed.lengths, position + 1)
    filled = np.asarray(streamed.window_lengths) == window  # bool [B]
    filled_steps += filled.any()
    quantized = np.where(filled, position + 1 - window, position + 1)
    at_once = _ingest(empty, keys, values, jnp.asarray(quantized))
    for row in np.flatnonzero(filled):
      held = slice(quantized[row], quantized[row] + window)
      np.testing.assert_array_equal(streamed.window_keys[row], keys[row, :, held])
      np.testing.assert_array_equal(streamed.window_values[row], values[row, :, held])
    # Filled windows emptied, the rest of the cache is what ingesting the quantized tokens makes.
    emptied = filled[:, None, None, None]
    settled = dataclasses.replace(
      streamed,
      window_keys=jnp.where(emptied, 0, streamed.window_keys).astype(dtype),
      window_values=jnp.where(emptied, 0, streamed.window_values).astype(dtype),
      window_lengths=jnp.where(filled, 0, streamed.window_lengths),
    )
    pairs = zip(
      jax.tree_util.tree_leaves_with_path(settled),
      jax.tree_util.tree_leaves(at_once),
      strict=True,
    )
    for (path, leaf), other in pairs:
      leaf, other = np.asarray(leaf), np.asarray(other)
      message = f"step {step}: {jax.tree_util.keystr(path)}"
      if exact or not np.issubdtype(leaf.dtype, np.floating):  # codes, indices: always exact
        np.testing.assert_array_equal(leaf, other, err_msg=message)
      else:
        np.testing.assert_allclose(leaf, other, atol=1e-3, rtol=1e-3, err_msg=message)
  assert filled_steps, "no step filled a window: the schedule's flush went untested"
  return streamed


def test_spec_strings_parse_to_kivi_and_round_trip():
  method = parse_method_spec("kivi:bits=2,group_size=32,residual=128")
  assert method == Kivi(bits=2, group_size=32, residual=128) == Kivi()
  assert parse_method_spec("kivi:bits=4") == Kivi(bits=4)
  assert describe_method(Kivi(bits=4, residual=64)) == "kivi:bits=4,residual=64"
  assert parse_method_spec(describe_method(Kivi(bits=8, group_size=16))) == Kivi(8, 16)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(bits=3), "bits=3 is not supported; allowed: 2, 4, 8"),
    (dict(group_size=0), "group_size=0 must be a positive int"),
    (dict(residual=48), "residual=48 must be a multiple of group_size=32"),
    (dict(residual=0), "residual=0 must be a positive int"),
    (dict(residual=True, group_size=1), "residual=True must be a positive int"),
    (dict(implementation="cuda"), "implementation='cuda'"),
  ],
)
def test_bad_configurations_raise_clear_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    Kivi(**kwargs)


def test_head_dim_checks_raise_before_tracing(monkeypatch):
  with pytest.raises(ValueError, match="bits=3"):
    parse_method_spec("kivi:bits=3")
  with pytest.raises(ValueError, match="kivi: group_size=64 must divide head_dim=32"):
    Kivi(group_size=64).allocate_storage(
      batch=1, kv_heads=1, capacity=64, head_dim=32, dtype=jnp.float32
    )
  decoder, params = tiny_decoder()

  def traced(*args, **kwargs):
    raise AssertionError("the prefill was traced before the method was checked")

  monkeypatch.setattr(importlib.import_module("kvjax.generate"), "_compiled_executables", traced)
  with pytest.raises(ValueError, match="kivi: group_size=64 must divide head_dim=32"):
    generate(
      decoder,
      params,
      [[1, 2, 3]],
      max_new_tokens=2,
      cache_method=Kivi(group_size=64, residual=64),
      cache_dtype=jnp.float32,
    )


def test_sliding_window_models_are_refused():
  shape = ModelCacheShape(
    num_layers=1, num_kv_heads=H, num_query_heads=H * G, head_dim=D, sliding_window=16
  )
  with pytest.raises(ValueError, match="sliding window of 16 tokens"):
    Kivi(group_size=8, residual=16).allocate(
      shape, 0, batch=B, prompt_len=20, max_new_tokens=4, dtype=jnp.float32
    )


def test_storage_is_codes_and_true_granularity_stats_and_nbytes_counts_everything():
  method = Kivi(bits=2, group_size=8, residual=16)
  cache = method.allocate_storage(batch=B, kv_heads=H, capacity=70, head_dim=D, dtype=jnp.bfloat16)
  assert cache.quantized_capacity == 64 and cache.capacity == 80
  segment = cache.segment
  assert segment.k_codes.dtype == segment.v_codes.dtype == jnp.uint32
  assert segment.k_codes.shape == segment.v_codes.shape == (B, H, 64, D * 2 // 32)
  assert segment.k_scale.shape == segment.k_min.shape == (B, H, 64 // 8, D)
  assert segment.v_scale.shape == segment.v_min.shape == (B, H, 64, D // 8)
  assert segment.k_scale.dtype == jnp.bfloat16
  assert segment.lowrank is None and segment.outliers is None
  codes = 2 * B * H * 64 * (D // 16) * 4
  stats = 2 * B * H * (64 // 8) * D * 2 + 2 * B * H * 64 * (D // 8) * 2
  window = 2 * B * H * 16 * D * 2
  assert cache.nbytes == codes + stats + window + 2 * B * 4
  assert cache.stored_elements == 2 * B * H * (64 + 16) * D
  assert cache.bits_per_element == pytest.approx(8 * cache.nbytes / cache.stored_elements)
  # At the authors' settings and a long context: ~2 bits of codes + ~1 bit of stats per
  # element for each of K and V, far below bfloat16's 16.
  long = Kivi().allocate_storage(
    batch=1, kv_heads=1, capacity=4096, head_dim=64, dtype=jnp.bfloat16
  )
  assert 3.0 < long.bits_per_element < 3.6


def test_streaming_tokens_one_by_one_equals_ingesting_them_at_once_across_flushes():
  # Rows start mid-window and cross two window boundaries each, at different steps.
  assert_streaming_equals_ingesting(
    Kivi(bits=2, group_size=8, residual=16),
    dtype=jnp.bfloat16,
    start_lengths=[3, 14],
    steps=30,
  )


def test_the_token_that_fills_the_window_attends_over_the_block_in_full_precision():
  # KIVI's order: the new key joins the window, the query attends, then the block is quantized.
  method = Kivi(bits=2, group_size=8, residual=16)
  cache = method.allocate_storage(
    batch=B, kv_heads=H, capacity=CAPACITY, head_dim=D, dtype=jnp.float32
  )
  keys, values = _random(0, B, H, PROMPT, D), _random(1, B, H, PROMPT, D)
  cache = _ingest(cache, keys, values, jnp.asarray([15, 31], jnp.int32))
  cache = _append(cache, keys[:, :, 31], values[:, :, 31])  # row 0's token 15, row 1's token 31
  np.testing.assert_array_equal(cache.window_lengths, [16, 16])
  np.testing.assert_array_equal(cache.quantized_lengths, [0, 16])
  queries = _random(5, B, H, G, D)
  attended = np.asarray(_attend(cache, queries, 0.2))
  np.testing.assert_allclose(attended, explicit_attention(cache, queries, 0.2), atol=1e-5)
  # Row 0 holds tokens 0..14 and the appended one, all unquantized: exact attention.
  row_keys = np.concatenate([keys[0, :, :15], keys[0, :, 31:32]], axis=1)
  row_values = np.concatenate([values[0, :, :15], values[0, :, 31:32]], axis=1)
  scores = np.einsum("hgd,htd->hgt", np.asarray(queries[0]), row_keys) * 0.2
  probs = softmax(scores)
  np.testing.assert_allclose(attended[0], np.einsum("hgt,htd->hgd", probs, row_values), atol=1e-5)
  # The next append quantizes the filled block first, then starts a new window.
  cache = _append(cache, keys[:, :, 32], values[:, :, 32])
  np.testing.assert_array_equal(cache.window_lengths, [1, 1])
  np.testing.assert_array_equal(cache.quantized_lengths, [16, 32])
  np.testing.assert_allclose(
    _attend(cache, queries, 0.2), explicit_attention(cache, queries, 0.2), atol=1e-5
  )


@pytest.mark.parametrize(
  "method",
  [
    Kivi(bits=8, group_size=8, residual=16),
    Gear(bits=4, group_size=8, rank=2, outliers=0.05, block=16),
  ],
  ids=["kivi", "gear"],
)
@pytest.mark.parametrize("asked", [40, 48])
def test_a_row_filled_to_capacity_holds_the_same_tokens_however_they_arrived(method, asked):
  # Capacity is a full segment plus a full window (the window is quantized lazily); a chunk
  # or a prompt that fills it must not quantize a block the segment has no room for. Asked
  # for 48 = 3 blocks, the cache holds exactly 48: the last block stays in the window.
  empty = method.allocate_storage(
    batch=B, kv_heads=H, capacity=asked, head_dim=D, dtype=jnp.float32
  )
  assert (empty.quantized_capacity, empty.capacity) == (32, 48)
  keys, values = _random(0, B, H, 48, D), _random(1, B, H, 48, D)
  held = _ingest(empty, keys[:, :, :40], values[:, :, :40], jnp.asarray([40, 40], jnp.int32))
  appended = held
  for position in range(40, 48):
    appended = _append(appended, keys[:, :, position], values[:, :, position])
  chunked = held.ingest_chunk(
    keys[:, :, 40:], values[:, :, 40:], None, jnp.asarray([8, 8], jnp.int32)
  )
  at_once = _ingest(empty, keys, values, jnp.asarray([48, 48], jnp.int32))
  queries = _random(5, B, H, G, D)
  for cache in (appended, chunked, at_once):
    np.testing.assert_array_equal(cache.quantized_lengths, [32, 32])
    np.testing.assert_array_equal(cache.window_lengths, [16, 16])
    np.testing.assert_array_equal(cache.room, [0, 0])
    np.testing.assert_array_equal(cache.window_keys, keys[:, :, 32:])
    np.testing.assert_allclose(
      _attend(cache, queries, 0.2), explicit_attention(cache, queries, 0.2), atol=1e-5
    )
  for leaf, other in zip(jax.tree.leaves(chunked), jax.tree.leaves(at_once), strict=True):
    np.testing.assert_allclose(leaf, other, atol=1e-5)


@pytest.mark.parametrize("method", [Kivi(residual=16, group_size=8), Gear(block=16, group_size=8)])
def test_a_cache_holds_what_it_was_asked_for_plus_less_than_one_block(method):
  for asked in range(1, 5 * 16 + 2):
    # Shapes only (`eval_shape`): 81 allocations of zeros would each compile their own fills.
    cache = jax.eval_shape(
      lambda asked=asked: method.allocate_storage(
        batch=B, kv_heads=H, capacity=asked, head_dim=D, dtype=jnp.bfloat16
      )
    )
    surplus = cache.capacity - asked
    assert 0 <= surplus < 16, (asked, cache.capacity)
    if asked % 16 == 0 or asked <= 16:
      assert surplus == 0, (asked, cache.capacity)
    assert cache.quantized_capacity % 16 == 0 and cache.window_slots == min(asked, 16)
    assert cache.stored_elements == 2 * B * H * cache.capacity * D


@pytest.mark.parametrize("method", [Kivi(residual=16, group_size=8), Gear(block=16, group_size=8)])
@pytest.mark.parametrize("asked, prompt", [(48, 40), (48, 32), (40, 17)])
def test_a_cache_sized_to_what_it_holds_attends_as_one_with_room_to_spare(method, asked, prompt):
  # Trimming the allocation to whole blocks for all but the last tokens never changes which
  # tokens are quantized: every step attends as a cache one block larger does.
  exact, spare = (
    method.allocate_storage(batch=B, kv_heads=H, capacity=n, head_dim=D, dtype=jnp.bfloat16)
    for n in (asked, asked + 16)
  )
  keys, values = _random(2, B, H, asked, D), _random(3, B, H, asked, D)
  queries = _random(4, B, H, G, D)
  lengths = jnp.asarray([prompt, prompt - 1], jnp.int32)
  exact = _ingest(exact, keys[:, :, :prompt], values[:, :, :prompt], lengths)
  spare = _ingest(spare, keys[:, :, :prompt], values[:, :, :prompt], lengths)

  def assert_same_tokens_quantized():
    np.testing.assert_array_equal(exact.quantized_lengths, spare.quantized_lengths)
    np.testing.assert_array_equal(exact.window_lengths, spare.window_lengths)
    # Equal up to float32 summation order over segments of other sizes.
    np.testing.assert_allclose(
      _attend(exact, queries, 0.2), _attend(spare, queries, 0.2), rtol=1e-5, atol=1e-6
    )

  for position in range(prompt, asked):
    assert_same_tokens_quantized()
    exact = _append(exact, keys[:, :, position], values[:, :, position])
    spare = _append(spare, keys[:, :, position], values[:, :, position])
  np.testing.assert_array_equal(exact.room, np.asarray([0, 1]) + exact.capacity - asked)
  assert_same_tokens_quantized()


def test_a_cache_smaller_than_one_block_keeps_everything_in_the_window():
  method = Kivi(bits=4, group_size=8, residual=64)
  cache = method.allocate_storage(
    batch=B, kv_heads=H, capacity=CAPACITY, head_dim=D, dtype=jnp.float32
  )
  assert cache.quantized_capacity == 0
  # It never flushes, so its window has the slots it was asked for, not the residual's 64: it
  # costs what the full cache of that capacity costs (plus one more lengths array).
  assert cache.window_slots == cache.capacity == CAPACITY
  full = FullCache().allocate_storage(
    batch=B, kv_heads=H, capacity=CAPACITY, head_dim=D, dtype=jnp.float32
  )
  assert cache.nbytes == full.nbytes + B * 4
  keys, values = _random(0, B, H, CAPACITY, D), _random(1, B, H, CAPACITY, D)
  cache = _ingest(cache, keys, values, jnp.asarray([1, 40], jnp.int32))
  cache = _append(cache, keys[:, :, 40], values[:, :, 40])
  np.testing.assert_array_equal(cache.window_lengths, [2, 41])
  queries = _random(5, B, H, G, D)
  np.testing.assert_allclose(
    _attend(cache, queries, 0.2), explicit_attention(cache, queries, 0.2), atol=1e-5
  )
  # Row 1 fills every slot; its last token is kept and attended to.
  rows = np.arange(B)
  for step in range(CAPACITY - 41):
    position = np.asarray([2, 41]) + step
    cache = _append(cache, keys[rows, :, position], values[rows, :, position])
  np.testing.assert_array_equal(cache.window_lengths, [9, CAPACITY])
  np.testing.assert_array_equal(cache.room, [CAPACITY - 9, 0])
  np.testing.assert_array_equal(cache.window_keys[1], keys[1])
  np.testing.assert_allclose(
    _attend(cache, queries, 0.2), explicit_attention(cache, queries, 0.2), atol=1e-5
  )


@settings(max_examples=12, deadline=None)
@given(
  bits=st.sampled_from([2, 4, 8]),
  lengths=st.tuples(st.integers(0, PROMPT), st.integers(1, PROMPT)),
  seed=st.integers(0, 2**31 - 1),
)
def test_attention_through_the_decomposition_equals_attention_over_dequantized_kv(
  bits, lengths, seed
):
  # allocate_storage + ingest of compact rows is also how a selection method stores survivors.
  # (Appending is covered by the streaming test: it gives the same cache as ingesting.)
  method = Kivi(bits=bits, group_size=8, residual=16)
  cache = method.allocate_storage(
    batch=B, kv_heads=H, capacity=CAPACITY, head_dim=D, dtype=jnp.bfloat16
  )
  keys = _random(seed, B, H, PROMPT, D) * 2 + 1
  values = _random(seed + 1, B, H, PROMPT, D)
  cache = _ingest(cache, keys, values, jnp.asarray(lengths, jnp.int32))
  queries = _random(seed + 20, B, H, G, D)
  got = np.asarray(_attend(cache, queries, 0.3))
  expected = explicit_attention(cache, queries, 0.3)
  np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)


@settings(max_examples=8, deadline=None)
@given(
  gear=st.booleans(),
  lengths=st.tuples(st.integers(0, PROMPT), st.integers(1, PROMPT)),
  more_blocks=st.integers(0, 3),
  more_slots=st.sampled_from([0, 1, 128]),
  seed=st.integers(0, 2**31 - 1),
)
def test_a_segment_relaid_with_more_rows_and_slots_attends_alike_and_relays_back(
  gear, lengths, more_blocks, more_slots, seed
):
  """`with_segment_layout` (how a context saved on one backend is read into another's layout):
  rows and GEAR outlier slots added as zeros change no attention output, and cutting them off
  again gives the cache back, bit for bit."""
  if gear:
    method = Gear(bits=2, group_size=8, rank=2, outliers=0.05, block=16)
  else:
    method = Kivi(bits=2, group_size=8, residual=16)
  cache = method.allocate_storage(
    batch=B, kv_heads=H, capacity=CAPACITY, head_dim=D, dtype=jnp.bfloat16
  )
  keys = _random(seed, B, H, PROMPT, D) * 2 + 1
  values = _random(seed + 1, B, H, PROMPT, D)
  cache = _ingest(cache, keys, values, jnp.asarray(lengths, jnp.int32))
  codec = cache.codec
  if gear:
    assert codec.stored_outliers == codec.outlier_count == 2 * 13  # 5% of 16 x 32, each side
    wider_codec = dataclasses.replace(codec, outlier_slots=codec.stored_outliers + more_slots)
  else:
    wider_codec = codec
  rows = cache.quantized_capacity + more_blocks * cache.window
  wider = cache.with_segment_layout(rows, wider_codec)
  assert wider.quantized_capacity == rows and wider.codec == wider_codec
  if gear:
    assert wider.segment.outliers[0].shape[-1] == wider_codec.stored_outliers
  for added, held in zip(jax.tree.leaves(wider), jax.tree.leaves(cache), strict=True):
    added = np.asarray(added)
    past = np.ones(added.shape, bool)
    past[tuple(slice(0, size) for size in held.shape)] = False
    assert not added[past].any()  # zeros: an empty row, a padding slot (index 0, value 0)
  queries = _random(seed + 20, B, H, G, D)
  np.testing.assert_allclose(
    np.asarray(_attend(wider, queries, 0.3)),
    np.asarray(_attend(cache, queries, 0.3)),
    rtol=1e-6,
    atol=1e-6,
  )
  back = wider.with_segment_layout(cache.quantized_capacity, codec)
  assert jax.tree.structure(back) == jax.tree.structure(cache)
  for relaid, held in zip(jax.tree.leaves(back), jax.tree.leaves(cache), strict=True):
    np.testing.assert_array_equal(np.asarray(relaid), np.asarray(held))


def test_a_bad_segment_layout_is_refused_by_name():
  cache = Kivi(bits=2, group_size=8, residual=16).allocate_storage(
    batch=B, kv_heads=H, capacity=CAPACITY, head_dim=D, dtype=jnp.bfloat16
  )
  with pytest.raises(ValueError, match="tokens=40 must be a multiple of the cache's block of 16"):
    cache.with_segment_layout(40, cache.codec)
  with pytest.raises(ValueError, match="tokens=-16 must be"):
    cache.with_segment_layout(-16, cache.codec)
  other = dataclasses.replace(cache.codec, bits=4)
  with pytest.raises(ValueError, match="codec=KiviCodec\\(bits=4.* must quantize as the cache's"):
    cache.with_segment_layout(32, other)


def _forced_logprobs(method, tokens, lengths, forced):
  decoder, params = tiny_decoder()
  logits, caches = prefill(
    decoder,
    params,
    tokens,
    lengths,
    cache_method=method,
    max_new_tokens=forced.shape[1],
    cache_dtype=jnp.float32,
  )
  logprobs, _, caches = teacher_force(decoder, params, logits, caches, lengths, forced)
  return np.asarray(logprobs), caches


def test_kivi8_in_the_model_is_close_to_the_full_cache():
  decoder, params = tiny_decoder()
  rng = np.random.default_rng(0)
  lengths = np.array([37, 22], np.int32)
  tokens = rng.integers(1, 64, size=(B, 37)).astype(np.int32)
  forced = rng.integers(1, 64, size=(B, 20)).astype(np.int32)
  method = parse_method_spec("kivi:bits=8,group_size=16,residual=16")
  # Both rows flush a block while decoding, at different steps (row 1 reaches 32 tokens after
  # 10 steps, row 0 reaches 48 after 11), inside jit + lax.scan.
  full, _ = _forced_logprobs(FullCache(), tokens, lengths, forced)
  kivi, caches = _forced_logprobs(method, tokens, lengths, forced)
  assert isinstance(caches[0], KiviLayerCache)
  np.testing.assert_array_equal(caches[0].quantized_lengths, [48, 32])
  np.testing.assert_array_equal(caches[0].window_lengths, [9, 10])
  # 8-bit steps are 1/255 of each group's range: log-probs move by ~1e-3 (at most a few 1e-2
  # on this random model, whose log-probs reach -8), 16x less than at 4 bits.
  np.testing.assert_allclose(kivi, full, atol=0.05)
  assert np.median(np.abs(kivi - full)) < 0.01

  prompts = [tokens[0].tolist(), tokens[1, :22].tolist()]
  expected = generate(decoder, params, prompts, max_new_tokens=12, cache_dtype=jnp.float32)
  result = generate(
    decoder, params, prompts, max_new_tokens=12, cache_method=method, cache_dtype=jnp.float32
  )
  np.testing.assert_array_equal(result.tokens, expected.tokens)
  assert result.cache_bytes < expected.cache_bytes


def test_composes_with_a_token_selection_policy():
  """The selection decides which prompt tokens survive, KIVI how they are stored."""
  rng = np.random.default_rng(1)
  lengths = np.array([37, 30], np.int32)
  tokens = rng.integers(1, 64, size=(B, 37)).astype(np.int32)
  forced = rng.integers(1, 64, size=(B, 12)).astype(np.int32)
  selection = "snapkv:budget=20,window=4,kernel=3"
  dense, _ = _forced_logprobs(parse_method_spec(selection), tokens, lengths, forced)
  quantized, caches = _forced_logprobs(
    parse_method_spec(selection + "+kivi:bits=8,group_size=16,residual=16"),
    tokens,
    lengths,
    forced,
  )
  storage = caches[0].storage
  assert isinstance(storage, KiviLayerCache)
  # 20 kept tokens + 12 appended: one quantized block of 16, and a window the last append
  # filled (it is quantized at the next append).
  np.testing.assert_array_equal(storage.quantized_lengths, [16, 16])
  np.testing.assert_array_equal(storage.window_lengths, [16, 16])
  np.testing.assert_allclose(quantized, dense, atol=0.05)


@pytest.mark.parametrize(
  "method",
  [Kivi(bits=2, group_size=8, residual=16), Gear(bits=4, group_size=8, rank=2, block=16)],
  ids=["kivi", "gear"],
)
def test_the_tpu_segment_writes_store_what_the_scatter_stores(method, monkeypatch):
  # On a TPU the segment's blocks are written by per-row update slices with the kernel's
  # layouts pinned (`compact_rows.write_blocks_by_row_slices`), and the windows of the rows that
  # flush are emptied inside the flush branch (v66); elsewhere by one scatter, the windows
  # emptied outside it. Both are run here, on the CPU, over appends that flush at different
  # steps per row and a chunk that writes two blocks to one row and none to the other.
  from kvjax import attention_dispatch
  from pallas_kernels import quantized_decode_attention_tpu

  keys, values = _random(0, B, H, PROMPT, D), _random(1, B, H, PROMPT, D)
  empty = method.allocate_storage(
    batch=B, kv_heads=H, capacity=CAPACITY, head_dim=D, dtype=jnp.float32
  )
  start = jnp.asarray([3, 14], jnp.int32)
  rows = np.arange(B)

  def run():  # fresh jits: the layouts are read while tracing
    ingest = jax.jit(lambda cache, k, v, lengths: cache.ingest(k, v, None, lengths))
    append = jax.jit(lambda cache, k, v: cache.append(k, v))
    chunk = jax.jit(lambda c, k, v, n: c.ingest_chunk(k, v, None, n))
    cache = ingest(empty, keys, values, start)
    for step in range(20):
      position = np.asarray(start) + step
      cache = append(cache, keys[rows, :, position], values[rows, :, position])
    chunked = chunk(
      ingest(empty, keys, values, jnp.asarray([2, 0], jnp.int32)),
      keys[:, :, :34],
      values[:, :, :34],
      jnp.asarray([32, 0], jnp.int32),
    )
    return cache, chunked

  scattered = run()
  assert attention_dispatch.quantized_segment_layouts("auto", D) is None  # the CPU
  # At 128 channels the key statistics are pinned row-major (the rest is left to XLA).
  pinned_layouts = quantized_decode_attention_tpu.segment_layouts(128)
  monkeypatch.setattr(
    attention_dispatch,
    "quantized_segment_layouts",
    lambda implementation, head_dim, kernel_backend=None: pinned_layouts,
  )
  sliced = run()
  np.testing.assert_array_equal(sliced[0].quantized_lengths, [16, 32])
  np.testing.assert_array_equal(sliced[1].quantized_lengths, [32, 0])
  for path, leaf, other in zip(
    (jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(scattered)),
    jax.tree.leaves(sliced),
    jax.tree.leaves(scattered),
    strict=True,
  ):
    np.testing.assert_array_equal(leaf, other, err_msg=path)


def test_the_segment_layouts_are_the_tpu_kernels_only_where_it_runs_compiled(monkeypatch):
  from kvjax import attention_dispatch

  assert attention_dispatch.quantized_segment_layouts("interpret", 128) is None
  assert attention_dispatch.quantized_segment_layouts("reference", 128) is None
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert attention_dispatch.quantized_segment_layouts("auto", 128) is None
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert attention_dispatch.quantized_segment_layouts("interpret", 128) is None
  at_128 = attention_dispatch.quantized_segment_layouts("auto", 128)
  at_64 = attention_dispatch.quantized_segment_layouts("pallas", 64)
  # Codes and value statistics tokens-minor; key statistics channels-minor at 128 channels,
  # groups-minor below (the kernel's `tokens_on_lanes`).
  assert at_128["k_codes"] == at_128["v_scale"] == at_64["v_min"] == (0, 1, 3, 2)
  assert at_128["k_scale"] == at_128["k_min"] == (0, 1, 2, 3)
  assert at_64["k_scale"] == (0, 1, 3, 2)


def test_on_a_tpu_the_segment_holds_whole_tiles_of_key_statistic_rows(monkeypatch):
  """20100 tokens asked: 20096 in whole 128-token blocks, 628 key groups of 32, whose TPU
  default layout is not the kernel's (not a multiple of 8 rows). Where the compiled TPU kernel
  reads the segment (`quantized_segment_granule`) it is rounded up to whole tiles of the key
  statistics' rows at 128 channels: 640 groups of bfloat16 (16 rows a tile), 632 of float32
  (8); at 64 channels their groups lie on lanes, and nothing is rounded but GEAR's outliers."""

  def quantized_capacity(method, head_dim, dtype=jnp.bfloat16):
    cache = jax.eval_shape(
      lambda: method.allocate_storage(
        batch=1, kv_heads=1, capacity=20100, head_dim=head_dim, dtype=dtype
      )
    )
    assert cache.segment.k_scale.shape[2] * 32 == cache.quantized_capacity
    return cache.quantized_capacity

  kivi, gear = Kivi(bits=2, group_size=32, residual=128), Gear(bits=2, group_size=32)
  assert quantized_capacity(kivi, 128) == 20096  # the CPU
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert quantized_capacity(kivi, 128) == 20096
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert quantized_capacity(kivi, 128) == 20480
  assert quantized_capacity(kivi, 128, jnp.float32) == 20224
  assert quantized_capacity(gear, 128) == 20480
  assert quantized_capacity(kivi, 64) == 20096
  # GEAR's outliers [B, H, J, s] in whole 8-row tiles: J a multiple of 8 (512 tokens a GEAR
  # block of 64), at 64 channels too (`segment_token_granule`).
  assert quantized_capacity(gear, 64) == 20480
  assert quantized_capacity(dataclasses.replace(gear, outliers=0), 64) == 20096
  assert quantized_capacity(dataclasses.replace(kivi, implementation="interpret"), 128) == 20096


@pytest.mark.parametrize("method", [Kivi(bits=2, group_size=16, residual=16), FullCache()])
@pytest.mark.parametrize("capacity", [-5, 40.9, True])
def test_a_capacity_that_is_not_a_count_is_refused(method, capacity):
  """It was made a count: -5 a cache of one slot, 40.9 one of 48."""
  with pytest.raises(ValueError, match=f"capacity={capacity!r} must be an int >= 0"):
    method.allocate_storage(batch=1, kv_heads=1, capacity=capacity, head_dim=32, dtype=jnp.float32)
