import concurrent.futures
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import allocate_model_cache
from kvjax.dense_cache import FullCache
from kvjax.generate import decode, generate, prefill
from kvjax.lru_table import LruTable
from kvjax.prompt_batch import check_token_ids, pack_prompts
from kvjax.sampling import SamplingConfig
from kvjax.teacher_forcing import teacher_force
from tests.kvjax.tiny_decoder import tiny_decoder


def _greedy_reference(decoder, params, prompt, steps):
  """Greedy decoding by re-running the whole sequence each step (no cache reuse at all)."""
  ids = list(prompt)
  for _ in range(steps):
    caches = allocate_model_cache(
      FullCache(),
      decoder.cache_shape,
      batch=1,
      prompt_len=len(ids),
      max_new_tokens=0,
      dtype=jnp.float32,
    )
    logits, _ = decoder.prefill(params, jnp.asarray([ids]), jnp.asarray([len(ids)]), caches)
    ids.append(int(jnp.argmax(logits[0])))
  return ids[len(prompt) :]


def test_greedy_generation_equals_recomputing_without_cache():
  decoder, params = tiny_decoder()
  prompt = [3, 14, 15, 9, 26]
  result = generate(decoder, params, [prompt], max_new_tokens=6, cache_dtype=jnp.float32)
  assert result.tokens[0].tolist() == _greedy_reference(decoder, params, prompt, 6)


def test_batch_rows_equal_their_solo_runs_and_padding_side_does_not_matter():
  decoder, params = tiny_decoder()
  prompts = [[3, 14, 15, 9, 26, 5, 35], [8, 9, 7]]
  batched = generate(decoder, params, prompts, max_new_tokens=5, cache_dtype=jnp.float32)
  for row, prompt in enumerate(prompts):
    solo = generate(decoder, params, [prompt], max_new_tokens=5, cache_dtype=jnp.float32)
    np.testing.assert_array_equal(batched.tokens[row], solo.tokens[0])
  left_padded = np.array([prompts[0], [0] * 4 + prompts[1]])
  mask = np.array([[1] * 7, [0] * 4 + [1] * 3])
  again = generate(
    decoder, params, left_padded, attention_mask=mask, max_new_tokens=5, cache_dtype=jnp.float32
  )
  np.testing.assert_array_equal(again.tokens, batched.tokens)
  # Padded lists of one length (a tokenizer's padded output) go with a mask as the array does.
  as_lists = generate(
    decoder,
    params,
    left_padded.tolist(),
    attention_mask=mask.tolist(),
    max_new_tokens=5,
    cache_dtype=jnp.float32,
  )
  np.testing.assert_array_equal(as_lists.tokens, batched.tokens)
  with pytest.raises(ValueError, match="token lists of different lengths need none"):
    generate(decoder, params, prompts, attention_mask=mask, max_new_tokens=5)


def test_finished_rows_stop_changing():
  decoder, params = tiny_decoder()
  free = generate(decoder, params, [[3, 14, 15]], max_new_tokens=6, cache_dtype=jnp.float32)
  stop = int(free.tokens[0, 2])
  first = free.tokens[0].tolist().index(stop)
  stopped = generate(
    decoder,
    params,
    [[3, 14, 15]],
    max_new_tokens=6,
    cache_dtype=jnp.float32,
    stop_token_ids=[stop],
    pad_token_id=63,
  )
  assert stopped.num_generated[0] == first + 1
  assert stopped.tokens[0, : first + 1].tolist() == free.tokens[0, : first + 1].tolist()
  assert np.all(stopped.tokens[0, first + 1 :] == 63)


def test_sampling_is_reproducible_from_the_key_and_varies_with_it():
  decoder, params = tiny_decoder()
  sampling = SamplingConfig(temperature=1.5, top_k=20, top_p=0.95)
  run = lambda seed: (
    generate(
      decoder,
      params,
      [[1, 2, 3]] * 4,
      max_new_tokens=8,
      sampling=sampling,
      key=jax.random.key(seed),
    ).tokens
  )
  np.testing.assert_array_equal(run(0), run(0))
  assert not np.array_equal(run(0), run(1))


def test_generate_reports_timings_and_cache_bytes():
  decoder, params = tiny_decoder()
  result = generate(decoder, params, [[1, 2, 3]], max_new_tokens=4, cache_dtype=jnp.bfloat16)
  assert result.prefill_s > 0 and result.decode_s > 0 and result.compile_s >= 0
  # 2 layers x (K and V) x [1, 2 heads, 3 + 4 slots, 16] bf16, plus int32 lengths.
  assert result.cache_bytes == 2 * (2 * 2 * 7 * 16 * 2 + 4)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=4, sampling=SamplingConfig(temperature=1.0)), "key is required"),
    (dict(max_new_tokens=500, max_cache_tokens=100), "exceeds max_cache_tokens"),
    (dict(max_new_tokens=4, pad_token_id=64), r"pad_token_id holds token id 64; .* \[0, 63\]"),
    (dict(max_new_tokens=2.5), r"max_new_tokens=2.5 must be an int >= 1"),
    (dict(max_new_tokens="4"), r"max_new_tokens='4' must be an int >= 1"),
    (
      dict(max_new_tokens=4, cache_dtype=jnp.int8),
      "cache_dtype=.*int8.* is not supported; allowed: bfloat16, float16, float32",
    ),
    (dict(max_new_tokens=4, cache_dtype=jnp.bool_), "cache_dtype=.*bool.* is not supported"),
    (dict(max_new_tokens=4, cache_dtype="float64"), "cache_dtype='float64' is not supported"),
    (
      dict(max_new_tokens=4, cache_method="kivi"),
      r"cache_method='kivi' must be a cache method object such as kvjax.parse_method_spec",
    ),
    (
      dict(max_new_tokens=4, cache_method=FullCache),
      r"cache_method=<class .*FullCache'> must be a cache method object",
    ),
    (dict(max_new_tokens=4, max_cache_tokens="64"), r"max_cache_tokens='64' must be an int >= 1"),
    (dict(max_new_tokens=4, sampling="greedy"), "sampling must be a kvjax.SamplingConfig"),
    # A stop id outside the vocabulary would never stop a row.
    (
      dict(max_new_tokens=4, stop_token_ids=[2, 64]),
      r"stop_token_ids holds token id 64; ids must be \[0, 63\]",
    ),
    (dict(max_new_tokens=4, stop_token_ids=[-5]), "stop_token_ids holds token id -5"),
    (dict(max_new_tokens=4, stop_token_ids=[2.0]), r"stop_token_ids=\[2.0\] must be int token ids"),
    # (numpy's own error named neither the argument nor what it takes)
    (
      dict(max_new_tokens=4, stop_token_ids=[[1, 2], [3]]),
      r"stop_token_ids=\[\[1, 2\], \[3\]\] must be int token ids \(one id, or a flat list of ids\)",
    ),
    (dict(max_new_tokens=4, prompts=None), "prompts must be a list of token lists .* got NoneType"),
    (dict(max_new_tokens=4, prompts=5), "prompts must be a list of token lists .* got int"),
  ],
)
def test_bad_generate_arguments_error_before_tracing(kwargs, message):
  decoder, params = tiny_decoder()
  prompts = kwargs.pop("prompts", [[1, 2, 3]])
  with pytest.raises(ValueError, match=message):
    generate(decoder, params, prompts, **kwargs)


@pytest.mark.parametrize("bad_id, allowed", [(64, r"\[0, 63\]"), (-1, r"\[0, 63\]")])
def test_token_ids_outside_the_vocabulary_are_refused(bad_id, allowed):
  # Inside jit the embedding would read NaN past the end and wrap a negative id.
  decoder, params = tiny_decoder()
  with pytest.raises(ValueError, match=rf"prompts holds token id {bad_id}; ids must be {allowed}"):
    generate(decoder, params, [[1, 2, 3], [4, bad_id]], max_new_tokens=2)


def test_stop_ids_may_be_a_list_an_integer_array_or_one_id():
  decoder, params = tiny_decoder()
  runs = [
    generate(decoder, params, [[1, 2, 3]], max_new_tokens=4, stop_token_ids=stop).token_lists()
    for stop in ([5, 9], np.array([5, 9]), jnp.array([5, 9], jnp.int32), (np.int64(5), 9))
  ]
  assert all(run == runs[0] for run in runs)
  first = generate(decoder, params, [[1, 2, 3]], max_new_tokens=4).tokens[0, 0]
  stopped = generate(decoder, params, [[1, 2, 3]], max_new_tokens=4, stop_token_ids=int(first))
  assert stopped.num_generated.tolist() == [1]


def test_a_prompt_array_of_floats_is_refused_not_truncated():
  decoder, params = tiny_decoder()
  with pytest.raises(
    ValueError, match="prompts array must hold integer token ids; got dtype float32"
  ):
    generate(decoder, params, np.array([[1.6, 2.0, 3.0]], np.float32), max_new_tokens=2)


@pytest.mark.parametrize("shape", [(0, 5), (2, 0)])
def test_an_empty_prompt_array_is_refused_by_its_name(shape):
  """Found by a review: it passed to the allocation, whose error named batch or prompt_len."""
  decoder, params = tiny_decoder()
  with pytest.raises(ValueError, match="prompts array must hold at least one prompt of at least"):
    generate(decoder, params, np.zeros(shape, np.int32), max_new_tokens=2)


PREFILL_STATIC = dict(cache_method=FullCache(), max_new_tokens=2, cache_dtype=jnp.float32)


@pytest.mark.parametrize(
  "tokens, lengths, static, message",
  [
    (
      np.ones((1, 8), np.int32),
      np.array([8, 8]),
      {},
      r"tokens must be \[batch, width\] and lengths \[batch\]; got \(1, 8\) and \(2,\)",
    ),
    (np.ones((1, 8), np.int32), np.array([20]), {}, r"lengths=\[20\] must each lie in \[1, 8\]"),
    (np.ones((2, 8), np.int32), np.array([8, 0]), {}, r"lengths=\[8, 0\] must each lie in"),
    (
      np.ones((1, 8), np.float32),
      np.array([8]),
      {},
      "tokens must hold integer token ids; got dtype float32",
    ),
    (np.full((1, 8), 64, np.int32), np.array([8]), {}, r"tokens holds token id 64"),
    (np.ones((1, 8), np.int32), np.array([8]), dict(cache_dtype=jnp.int32), "cache_dtype="),
    (np.ones((1, 8), np.int32), np.array([8]), dict(max_new_tokens=-1), "max_new_tokens=-1"),
    (
      np.ones((0, 8), np.int32),
      np.ones((0,), np.int32),
      {},
      r"tokens must hold at least one row and one token; got shape \(0, 8\)",
    ),
  ],
)
def test_prefill_checks_its_rows_and_arguments_before_tracing(tokens, lengths, static, message):
  decoder, params = tiny_decoder()
  with pytest.raises(ValueError, match=message):
    prefill(decoder, params, tokens, lengths, **(PREFILL_STATIC | static))


def test_prefill_inside_jit_checks_shapes_and_leaves_values_to_the_trace():
  decoder, params = tiny_decoder()
  tokens, lengths = np.ones((2, 8), np.int32), np.array([8, 5], np.int32)
  inside = jax.jit(lambda t, n: prefill(decoder, params, t, n, **PREFILL_STATIC)[0])
  np.testing.assert_allclose(
    inside(tokens, lengths),
    prefill(decoder, params, tokens, lengths, **PREFILL_STATIC)[0],
    rtol=1e-6,
    atol=1e-6,
  )
  with pytest.raises(ValueError, match="tokens must be"):
    inside(tokens, lengths[:1])


def test_greedy_decode_needs_no_key():
  decoder, params = tiny_decoder()
  logits, caches, lengths = _prefilled_full_cache(decoder, params, [[3, 14], [9, 2, 6]], room=6)
  keyless = decode(decoder, params, logits, caches, lengths, None, **GREEDY_FIVE_TOKENS)
  keyed = decode(decoder, params, logits, caches, lengths, jax.random.key(3), **GREEDY_FIVE_TOKENS)
  np.testing.assert_array_equal(keyless[0], keyed[0])


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(pad_token_id=99), r"pad_token_id holds token id 99; ids must be \[0, 63\]"),
    (dict(pad_token_id=-1), "pad_token_id holds token id -1"),
    (dict(stop_token_ids=(64,)), "stop_token_ids holds token id 64"),
    (dict(lengths=np.array([3, 3, 3])), r"lengths must be \[batch=2\]; got shape \(3,\)"),
    # fractional positions would write no cache slot and rotate keys by a fraction
    (dict(lengths=np.array([2.5, 3.5])), "lengths must hold integers; got dtype float"),
    (dict(lengths=np.array([-7, 3])), r"lengths=\[-7, 3\] must each be >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be an int >= 1"),
    (dict(key=0), "key must be one PRNG key: .* got int of dtype None and shape \\(\\)"),
    (dict(key=jax.random.split(jax.random.key(0))), r"key must be one PRNG key.*shape \(2,\)"),
    (dict(key=np.zeros(4, np.uint32)), r"key must be one PRNG key.*uint32 and shape \(4,\)"),
  ],
)
def test_decode_refuses_bad_arguments_before_tracing(kwargs, message):
  decoder, params = tiny_decoder()
  logits, caches, lengths = _prefilled_full_cache(decoder, params, [[3, 14], [9, 2, 6]], room=6)
  arguments = GREEDY_FIVE_TOKENS | dict(lengths=lengths, key=jax.random.key(0)) | kwargs
  lengths, key = arguments.pop("lengths"), arguments.pop("key")
  with pytest.raises(ValueError, match=message):
    decode(decoder, params, logits, caches, lengths, key, **arguments)


def test_decode_and_teacher_force_refuse_logits_unlike_the_decoders():
  """Logits wider than the decoder's vocabulary let ids past it through to the embedding (fed
  ids 100 and 120 with 128 columns for 64 tokens gave NaN caches and tokens of 0, without a
  word); a 1-D array, a list, integer logits, no decoder and no caches failed inside the trace
  or in numpy, without naming the argument."""
  decoder, params = tiny_decoder()
  logits, caches, lengths = _prefilled_full_cache(decoder, params, [[3, 14], [9, 2, 6]], room=6)
  wide = jnp.pad(logits, ((0, 0), (0, 64)))
  forced = np.ones((2, 2), np.int32)
  for bad, message in [
    (wide, r"logits has 128 columns, but the decoder's vocabulary has 64 tokens"),
    (
      logits[0],
      r"logits must be a float array \[batch, vocab\] .* got dtype float32 and shape \(64,\)",
    ),
    (np.asarray(logits).tolist(), r"logits must be a float array .* got a list"),
    (jnp.zeros(logits.shape, jnp.int32), r"got dtype int32 and shape \(2, 64\)"),
  ]:
    with pytest.raises(ValueError, match=message):
      decode(decoder, params, bad, caches, lengths, None, **GREEDY_FIVE_TOKENS)
    with pytest.raises(ValueError, match=message):  # as first_logits
      teacher_force(decoder, params, bad, caches, lengths, forced)
  with pytest.raises(ValueError, match="decoder: NoneType lacks cache_shape"):
    decode(None, params, logits, caches, lengths, None, **GREEDY_FIVE_TOKENS)
  with pytest.raises(
    ValueError, match="teacher_force: caches must be the model's caches .* got NoneType"
  ):
    teacher_force(decoder, params, logits, None, lengths, forced)


def test_decode_and_teacher_force_take_lists():
  """Nested lists pass their checks; jit would then take them as pytrees of scalars and fail
  inside the trace without naming the argument."""
  decoder, params = tiny_decoder()
  logits, caches, lengths = _prefilled_full_cache(decoder, params, [[3, 14], [9, 2, 6]], room=6)
  feed = dict(feed_tokens=np.array([[1], [2]]), feed_lengths=np.array([1, 1]))
  arrays = decode(decoder, params, logits, caches, lengths, None, **GREEDY_FIVE_TOKENS, **feed)
  listed = decode(
    decoder,
    params,
    logits,
    caches,
    np.asarray(lengths).tolist(),
    None,
    **GREEDY_FIVE_TOKENS,
    feed_tokens=[[1], [2]],
    feed_lengths=[1, 1],
  )
  np.testing.assert_array_equal(arrays[0], listed[0])
  forced = np.array([[1, 2], [3, 4]])
  from_arrays = teacher_force(decoder, params, logits, caches, lengths, forced)
  from_lists = teacher_force(
    decoder, params, logits, caches, np.asarray(lengths).tolist(), forced.tolist()
  )
  np.testing.assert_array_equal(from_arrays[0], from_lists[0])


def test_the_loop_lowered_without_decodes_checks_still_refuses_no_new_tokens():
  """decode.lower skips decode's checks; with nothing to emit the loop would never end."""
  decoder, params = tiny_decoder()
  logits, caches, lengths = _prefilled_full_cache(decoder, params, [[3, 14], [9, 2, 6]], room=6)
  arguments = dict(GREEDY_FIVE_TOKENS, max_new_tokens=0)
  feed = np.ones((2, 2), np.int32), np.array([2, 1], np.int32)
  with pytest.raises(ValueError, match="max_new_tokens=0 must be an int >= 1"):
    decode.lower(decoder, params, logits, caches, lengths, jax.random.key(0), *feed, **arguments)


def test_decode_takes_a_legacy_uint32_key():
  decoder, params = tiny_decoder()
  logits, caches, lengths = _prefilled_full_cache(decoder, params, [[3, 14], [9, 2, 6]], room=6)
  sampling = dict(GREEDY_FIVE_TOKENS, sampling=SamplingConfig(temperature=1.0))
  typed = decode(decoder, params, logits, caches, lengths, jax.random.key(5), **sampling)
  legacy = decode(decoder, params, logits, caches, lengths, jax.random.PRNGKey(5), **sampling)
  np.testing.assert_array_equal(typed[0], legacy[0])


@pytest.mark.parametrize(
  "forced, message",
  [
    (np.array([[64, 1], [2, 3]]), r"forced holds token id 64; ids must be \[0, 63\]"),
    (np.array([[-7, 1], [2, 3]]), "forced holds token id -7"),
    (np.ones((2, 2), np.float32), "forced must hold integer token ids; got dtype float32"),
    (np.ones((2,), np.int32), r"forced must be \[batch=2, steps\] \(rows of first_logits\)"),
    (np.ones((3, 2), np.int32), r"got \(3, 2\)"),
  ],
)
def test_teacher_force_refuses_bad_forced_tokens_before_tracing(forced, message):
  # Inside jit an id past the vocabulary would make every later logit NaN, and -7 would wrap.
  decoder, params = tiny_decoder()
  logits, caches, lengths = _prefilled_full_cache(decoder, params, [[3, 14], [9, 2, 6]], room=6)
  with pytest.raises(ValueError, match=message):
    teacher_force(decoder, params, logits, caches, lengths, forced)


@pytest.mark.parametrize(
  "lengths, message",
  [
    (np.array([2.5, 3.5]), "lengths must hold integers; got dtype float"),
    (np.array([-7, 100]), r"lengths=\[-7, 100\] must each be >= 0"),
    (np.array([2]), r"lengths must be \[batch=2\]; got shape \(1,\)"),
  ],
)
def test_teacher_force_refuses_bad_lengths_before_tracing(lengths, message):
  decoder, params = tiny_decoder()
  logits, caches, _ = _prefilled_full_cache(decoder, params, [[3, 14], [9, 2, 6]], room=6)
  with pytest.raises(ValueError, match=message):
    teacher_force(decoder, params, logits, caches, lengths, np.ones((2, 2), np.int32))


def test_without_a_vocab_size_only_negative_and_int32_overflowing_ids_are_refused_up_front():
  check_token_ids(np.array([0, 10**6, 2**31 - 1]), vocab_size=None, name="prompts")
  with pytest.raises(ValueError, match=r"prompts holds token id -3; ids must be >= 0"):
    check_token_ids(np.array([5, -3]), vocab_size=None, name="prompts")
  with pytest.raises(
    ValueError, match=r"holds token id 2147483648; ids must be >= 0 and < 2\*\*31"
  ):
    check_token_ids(np.array([5, 2**31]), vocab_size=None, name="prompts")


@pytest.mark.parametrize(
  "prompts",
  [[[1, 2, 2**32 + 5]], np.array([[1, 2, 2**32 + 5]], np.int64)],
  ids=["list", "int64-array"],
)
def test_ids_int32_would_wrap_into_the_vocabulary_are_refused(prompts):
  """int32 holds 2**32 + 5 as 5, an id of the vocabulary: the id given must be named."""
  decoder, params = tiny_decoder()
  with pytest.raises(ValueError, match=r"holds token id 4294967301"):
    generate(decoder, params, prompts, max_new_tokens=2)


def test_decoding_ends_early_once_every_row_stopped():
  decoder, params = tiny_decoder()
  free = generate(decoder, params, [[3, 14, 15]], max_new_tokens=8, cache_dtype=jnp.float32)
  assert free.decode_steps == 7
  stop = int(free.tokens[0, 1])
  first = free.tokens[0].tolist().index(stop)
  stopped = generate(
    decoder, params, [[3, 14, 15]], max_new_tokens=8, cache_dtype=jnp.float32, stop_token_ids=[stop]
  )
  # one pass per token fed back: none for the stop token, after which no row is left
  assert stopped.decode_steps == first
  assert stopped.tokens[0, : first + 1].tolist() == free.tokens[0, : first + 1].tolist()
  on_first = generate(
    decoder, params, [[3, 14, 15]], max_new_tokens=8, stop_token_ids=[int(free.tokens[0, 0])]
  )
  assert on_first.decode_steps == 0 and on_first.num_generated.tolist() == [1]


GREEDY_FIVE_TOKENS = dict(
  max_new_tokens=5, sampling=SamplingConfig(), stop_token_ids=(), pad_token_id=0
)


def _prefilled_full_cache(decoder, params, prompts, room):
  tokens, lengths = pack_prompts(prompts)
  logits, caches = prefill(
    decoder,
    params,
    tokens,
    lengths,
    cache_method=FullCache(),
    max_new_tokens=room,
    cache_dtype=jnp.float32,
  )
  return logits, caches, lengths


def test_decode_feeds_each_row_its_tokens_before_generating():
  decoder, params = tiny_decoder()
  prompts, fed = [[3, 14, 15], [9, 2, 6, 5]], [[8, 9, 7, 9], [3]]
  logits, caches, lengths = _prefilled_full_cache(decoder, params, prompts, room=4 + 5)
  tokens, count, _, steps = decode(
    decoder,
    params,
    logits,
    caches,
    lengths,
    jax.random.key(0),
    feed_tokens=np.array([[8, 9, 7, 9], [3, 0, 0, 0]], np.int32),
    feed_lengths=np.array([4, 1], np.int32),
    **GREEDY_FIVE_TOKENS,
  )
  whole = generate(
    decoder,
    params,
    [p + f for p, f in zip(prompts, fed)],
    max_new_tokens=5,
    cache_dtype=jnp.float32,
  )
  np.testing.assert_array_equal(tokens, whole.tokens)
  np.testing.assert_array_equal(count, [5, 5])
  assert int(steps) == 4 + 5 - 1  # the longest feed, then every new token but the last


@pytest.mark.parametrize(
  "feed, message",
  [
    (dict(feed_tokens=np.ones((2, 3), np.int32)), "give both or neither"),
    (dict(feed_lengths=np.ones((2,), np.int32)), "give both or neither"),
    (
      dict(feed_tokens=np.ones((1, 3), np.int32), feed_lengths=np.ones((1,), np.int32)),
      r"feed_tokens must be \[batch=2, width\]; got \(1, 3\)",
    ),
    (
      dict(feed_tokens=np.ones((2, 3), np.int32), feed_lengths=np.ones((1,), np.int32)),
      r"feed_lengths must be \[batch=2\]; got shape \(1,\)",
    ),
    (
      dict(feed_tokens=np.ones((2, 3), np.int32), feed_lengths=np.array([1.5, 1.0])),
      "feed_lengths must hold integers; got dtype float",
    ),
    (
      dict(feed_tokens=np.ones((2, 3), np.float32), feed_lengths=np.ones((2,), np.int32)),
      "integer token ids",
    ),
    (
      dict(feed_tokens=np.ones((2, 3), np.int32), feed_lengths=np.array([4, 1], np.int32)),
      r"feed_lengths=\[4, 1\] must lie in \[0, 3\]",
    ),
    (
      dict(feed_tokens=np.ones((2, 3), np.int32), feed_lengths=np.array([3, 3], np.int32)),
      "decode: appends 7 tokens per row",
    ),
    (  # only the fed part of a row counts: the 99 past row 1's length is never read
      dict(feed_tokens=np.array([[1, 64], [2, 99]]), feed_lengths=np.array([2, 1], np.int32)),
      r"feed_tokens holds token id 64; ids must be \[0, 63\]",
    ),
  ],
)
def test_decode_refuses_bad_fed_tokens_before_tracing(feed, message):
  decoder, params = tiny_decoder()
  logits, caches, lengths = _prefilled_full_cache(decoder, params, [[3, 14], [9, 2, 6]], room=6)
  with pytest.raises(ValueError, match=message):
    decode(
      decoder, params, logits, caches, lengths, jax.random.key(0), **GREEDY_FIVE_TOKENS, **feed
    )


def test_threads_calling_generate_at_once_get_what_calls_in_turn_get(monkeypatch):
  # generate memoises compiled programs in one table that threads share. With no room in it,
  # every program is evicted as soon as it is stored, as another thread's store could evict it:
  # each call must still run the program it compiled.
  module = importlib.import_module("kvjax.generate")
  monkeypatch.setattr(module, "_COMPILED", LruTable(max_entries=0))
  decoder, params = tiny_decoder()
  requests = [[[3, 14, 15, 9]], [[8, 9, 7, 1, 2, 6]]] * 3
  run = lambda prompts: (
    generate(decoder, params, prompts, max_new_tokens=4, cache_dtype=jnp.float32).tokens
  )
  expected = [run(prompts) for prompts in requests[:2]] * 3
  with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
    results = list(pool.map(run, requests))
  for result, wanted in zip(results, expected, strict=True):
    np.testing.assert_array_equal(result, wanted)


def test_prefill_takes_nested_lists_as_the_arrays_they_make():
  decoder, params = tiny_decoder()
  tokens, lengths = [[5, 6, 7], [8, 9, 0]], [3, 2]
  common = dict(cache_method=FullCache(), max_new_tokens=2, cache_dtype=jnp.float32)
  from_lists, _ = prefill(decoder, params, tokens, lengths, **common)
  from_arrays, _ = prefill(
    decoder, params, np.asarray(tokens, np.int32), np.asarray(lengths, np.int32), **common
  )
  np.testing.assert_array_equal(from_lists, from_arrays)
  with pytest.raises(ValueError, match="tokens must be rectangular"):
    prefill(decoder, params, [[5, 6, 7], [8]], [3, 1], **common)
