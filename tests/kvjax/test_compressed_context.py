import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_room import rows_room
from kvjax.compressed_context import (
  _continue_in_jit,
  _pack_fed_tokens,
  compress_context,
  context_template,
  continue_context,
  repeat_context,
  share_context,
)
from kvjax.context_checkpoint import save_context
from kvjax.dense_cache import FullCache
from kvjax.generate import decode, generate, prefill
from kvjax.kernel_settings import KernelSettings
from kvjax.method_spec import parse_method_spec
from kvjax.prompt_batch import pack_prompts
from kvjax.sampling import SamplingConfig
from kvjax.teacher_forcing import teacher_force
from tests.kvjax.layer_loop_params import each_in_one_layer_loop
from tests.kvjax.test_method_matrix import PROMPTS
from tests.kvjax.tiny_decoder import TINY_CONFIG, tiny_decoder

QUESTIONS = [[5, 9, 11], [7, 3, 2]]
RAGGED_QUESTIONS = [[5, 9, 11, 4, 8], [7]]
KIVI = "kivi:bits=4,group_size=16,residual=16"


def with_razor_profile(spec: str, profile_path: str) -> str:
  """The spec, or for "razor" a RazorAttention spec with the tiny decoder's head profile."""
  return f"razor:budget=12,sinks=2,profile={profile_path}" if spec == "razor" else spec


def assert_same_arrays(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_compress_context_is_the_prefill_of_the_packed_prompts():
  decoder, params = tiny_decoder()
  method = parse_method_spec(KIVI)
  context = compress_context(decoder, params, PROMPTS, cache_method=method, room=6)
  tokens, lengths = pack_prompts(PROMPTS)
  logits, caches = prefill(
    decoder,
    params,
    tokens,
    lengths,
    cache_method=method,
    max_new_tokens=6,
    cache_dtype=jnp.bfloat16,
  )
  assert_same_arrays(context.caches, caches)
  np.testing.assert_array_equal(context.next_logits, logits)
  np.testing.assert_array_equal(context.lengths, [40, 29])
  assert context.cache_bytes == sum(c.nbytes for c in caches)


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_context_template_has_the_context_structure_shapes_and_dtypes(layer_loop):
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  method = parse_method_spec(f"snapkv:budget=16,window=4+{KIVI}")
  context = compress_context(decoder, params, PROMPTS, cache_method=method, room=6)
  template = context_template(decoder, params, batch=2, prompt_len=40, cache_method=method, room=6)
  assert jax.tree.structure(template) == jax.tree.structure(context)
  for t, c in zip(jax.tree.leaves(template), jax.tree.leaves(context)):
    assert isinstance(t, jax.ShapeDtypeStruct)
    assert (t.shape, t.dtype) == (c.shape, c.dtype)
  assert template.cache_bytes == context.cache_bytes


@pytest.mark.parametrize("spec", ["full", KIVI, "snapkv:budget=16,window=4"])
def test_continuing_with_nothing_fed_is_generate(spec):
  decoder, params = tiny_decoder()
  method = parse_method_spec(spec)
  expected = generate(decoder, params, PROMPTS, max_new_tokens=5, cache_method=method)
  context = compress_context(decoder, params, PROMPTS, cache_method=method, room=5)
  tokens, count = continue_context(decoder, params, context, [[], []], max_new_tokens=5)
  np.testing.assert_array_equal(tokens, expected.tokens)
  np.testing.assert_array_equal(count, expected.num_generated)


@pytest.mark.parametrize("questions", [QUESTIONS, RAGGED_QUESTIONS], ids=["equal", "ragged"])
def test_questions_fed_after_a_full_cache_answer_like_their_whole_prompts(questions):
  decoder, params = tiny_decoder()
  method = parse_method_spec("full")
  whole = [p + q for p, q in zip(PROMPTS, questions)]
  expected = generate(
    decoder, params, whole, max_new_tokens=6, cache_method=method, cache_dtype=jnp.float32
  )
  room = max(map(len, questions)) + 6
  context = compress_context(
    decoder, params, PROMPTS, cache_method=method, room=room, cache_dtype=jnp.float32
  )
  tokens, count = continue_context(decoder, params, context, questions, max_new_tokens=6)
  np.testing.assert_array_equal(tokens, expected.tokens)
  np.testing.assert_array_equal(count, [6, 6])


@pytest.mark.parametrize(
  "spec",
  [
    "full",
    KIVI,
    pytest.param("snapkv:budget=16,window=4", marks=pytest.mark.slow),  # a full storage, as full
    "streaming:budget=16,sinks=2",
  ],
)
def test_feeding_in_the_decode_loop_is_teacher_forcing_then_decoding(spec):
  decoder, params = tiny_decoder()
  context = compress_context(decoder, params, PROMPTS, cache_method=parse_method_spec(spec), room=9)
  _, logits, caches = teacher_force(
    decoder, params, context.next_logits, context.caches, context.lengths, np.array(QUESTIONS)
  )
  expected, expected_count, _, _ = decode(
    decoder,
    params,
    logits,
    caches,
    context.lengths + 3,
    jax.random.key(0),
    max_new_tokens=6,
    sampling=SamplingConfig(),
    stop_token_ids=(),
    pad_token_id=0,
  )
  tokens, count = continue_context(decoder, params, context, QUESTIONS, max_new_tokens=6)
  np.testing.assert_array_equal(tokens, expected)
  np.testing.assert_array_equal(count, expected_count)


@pytest.mark.parametrize("spec", [KIVI, "snapkv:budget=16,window=4", "streaming:budget=16,sinks=2"])
def test_each_row_of_a_ragged_batch_answers_as_with_an_equal_length_batch(spec):
  decoder, params = tiny_decoder()
  context = compress_context(
    decoder, params, PROMPTS, cache_method=parse_method_spec(spec), room=11
  )
  tokens, count = continue_context(decoder, params, context, RAGGED_QUESTIONS, max_new_tokens=6)
  long_question, short_question = RAGGED_QUESTIONS
  first, _ = continue_context(decoder, params, context, [long_question, [1] * 5], max_new_tokens=6)
  second, _ = continue_context(
    decoder, params, context, [[1] * 1, short_question], max_new_tokens=6
  )
  np.testing.assert_array_equal(tokens, np.stack([first[0], second[1]]))
  np.testing.assert_array_equal(count, [6, 6])


def test_a_row_that_stops_early_waits_while_a_longer_question_is_fed():
  decoder, params = tiny_decoder()
  context = compress_context(
    decoder, params, PROMPTS, cache_method=parse_method_spec(KIVI), room=11
  )
  free, _ = continue_context(decoder, params, context, RAGGED_QUESTIONS, max_new_tokens=6)
  stop = int(free[1, 1])  # the short question's second answer token
  tokens, count = continue_context(
    decoder, params, context, RAGGED_QUESTIONS, max_new_tokens=6, stop_token_ids=[stop]
  )
  row_stop = int(np.argmax(free[1] == stop)) + 1
  np.testing.assert_array_equal(count[1], row_stop)
  np.testing.assert_array_equal(tokens[1, :row_stop], free[1, :row_stop])
  np.testing.assert_array_equal(tokens[1, row_stop:], 0)
  first_stop = np.flatnonzero(free[0] == stop)
  expected_first = first_stop[0] + 1 if first_stop.size else 6
  np.testing.assert_array_equal(count[0], expected_first)
  np.testing.assert_array_equal(tokens[0, :expected_first], free[0, :expected_first])


def test_a_context_is_unchanged_by_continuing_and_answers_again_the_same():
  decoder, params = tiny_decoder()
  context = compress_context(decoder, params, PROMPTS, cache_method=parse_method_spec(KIVI), room=9)
  before = jax.tree.map(np.asarray, context)
  first, _ = continue_context(decoder, params, context, QUESTIONS, max_new_tokens=6)
  assert_same_arrays(context, before)
  other, _ = continue_context(decoder, params, context, [[1], [2]], max_new_tokens=6)
  again, _ = continue_context(decoder, params, context, QUESTIONS, max_new_tokens=6)
  np.testing.assert_array_equal(first, again)
  assert not np.array_equal(first, other)


def test_sampling_follows_the_key():
  decoder, params = tiny_decoder()
  context = compress_context(decoder, params, PROMPTS, cache_method=parse_method_spec(KIVI), room=9)
  sampling = SamplingConfig(temperature=1.0)

  def sample(seed):
    key = jax.random.key(seed)
    return continue_context(
      decoder, params, context, QUESTIONS, max_new_tokens=6, sampling=sampling, key=key
    )[0]

  np.testing.assert_array_equal(sample(0), sample(0))
  assert not np.array_equal(sample(0), sample(1))


# Each method under one layer loop (the loops score alike: test_layer_runs), each loop twice.
@pytest.mark.parametrize(
  "spec, layer_loop",
  [
    (KIVI, "unroll"),
    (f"snapkv:budget=16,window=4+{KIVI}", "scan"),
    ("h2o_decode:budget=16,window=4", "unroll"),
    pytest.param("razor", "scan", marks=pytest.mark.slow),  # razor: shared in the default run
  ],
)
def test_a_repeated_context_answers_each_question_as_the_context_alone(
  spec, layer_loop, profile_path
):
  spec = with_razor_profile(spec, profile_path)
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  context = compress_context(
    decoder, params, PROMPTS[:1], cache_method=parse_method_spec(spec), room=11
  )
  questions = [[5, 9, 11, 4, 8], [7], [2, 2, 3]]
  repeated = repeat_context(context, len(questions))
  assert repeated.cache_bytes == 3 * context.cache_bytes
  np.testing.assert_array_equal(repeated.lengths, [40, 40, 40])
  tokens, count = continue_context(decoder, params, repeated, questions, max_new_tokens=6)
  for row, question in enumerate(questions):
    alone, alone_count = continue_context(decoder, params, context, [question], max_new_tokens=6)
    np.testing.assert_array_equal(tokens[row], alone[0])
    np.testing.assert_array_equal(count[row], alone_count[0])


def test_repeating_a_context_of_several_rows_keeps_each_rows_copies_together():
  decoder, params = tiny_decoder(layer_loop="scan")
  context = compress_context(decoder, params, PROMPTS, cache_method=parse_method_spec(KIVI), room=4)
  repeated = repeat_context(context, 2)
  np.testing.assert_array_equal(repeated.lengths, [40, 40, 29, 29])
  for run, repeated_run in zip(context.caches, repeated.caches, strict=True):
    for x, y in zip(jax.tree.leaves(run), jax.tree.leaves(repeated_run), strict=True):
      # Stacked layers keep the batch on axis 1.
      np.testing.assert_array_equal(np.repeat(np.asarray(x), 2, axis=1), y)
  assert_same_arrays(repeat_context(context, 1), context)


def test_repeat_context_refuses_bad_copies_and_caches_without_the_batch_in_place():
  decoder, params = tiny_decoder(layer_loop="unroll")
  context = compress_context(decoder, params, PROMPTS[:1], cache_method=FullCache(), room=4)
  for copies in (0, -2, 2.0, True, "3"):
    with pytest.raises(ValueError, match=r"copies=.* must be an int >= 1"):
      repeat_context(context, copies)
  with pytest.raises(ValueError, match="must be a CompressedContext"):
    repeat_context(context.caches, 2)
  first = context.caches[0]
  moved = dataclasses.replace(first, lengths=jnp.zeros((3,), jnp.int32))  # not [rows]
  misplaced = dataclasses.replace(context, caches=(moved,) + tuple(context.caches[1:]))
  with pytest.raises(ValueError, match=r"caches\[0\].*lengths.* has shape \(3,\)"):
    repeat_context(misplaced, 2)
  with pytest.raises(ValueError, match=r"continue kvjax.repeat_context\(context, 3\)"):
    continue_context(decoder, params, context, [[1], [2], [3]], max_new_tokens=2)


def test_bad_arguments_are_refused_before_anything_runs():
  decoder, params = tiny_decoder()
  method = parse_method_spec(KIVI)
  for room in (-1, True, 2.5):
    with pytest.raises(ValueError, match="room="):
      compress_context(decoder, params, PROMPTS, cache_method=method, room=room)
  with pytest.raises(ValueError, match="prompt_len=0"):
    context_template(decoder, params, batch=1, prompt_len=0, cache_method=method, room=1)
  with pytest.raises(ValueError, match="prompts must be a list of token lists .* got NoneType"):
    compress_context(decoder, params, None, cache_method=method, room=4)
  context = compress_context(decoder, params, PROMPTS, cache_method=method, room=4)
  for tokens in (None, 5):
    with pytest.raises(ValueError, match="tokens must be a list of token lists .* got "):
      continue_context(decoder, params, context, tokens, max_new_tokens=2)
  with pytest.raises(ValueError, match="got 1 items of types"):
    continue_context(decoder, params, context, [[1, 2]], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"got 2 items of types \['int'\]"):
    continue_context(decoder, params, context, [1, 2], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"got a int32 array of shape \(1, 2\)"):
    continue_context(decoder, params, context, np.ones((1, 2), np.int32), max_new_tokens=2)
  as_lists, _ = continue_context(decoder, params, context, [[1, 2], [3]], max_new_tokens=2)
  as_arrays, _ = continue_context(
    decoder, params, context, [np.array([1, 2]), jnp.array([3])], max_new_tokens=2
  )
  np.testing.assert_array_equal(as_arrays, as_lists)
  with pytest.raises(ValueError, match=r"tokens\[1\] must be a list of int token ids"):
    continue_context(decoder, params, context, [[1], np.array([3.5])], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"tokens\[0\] must be a list of int token ids"):
    continue_context(decoder, params, context, [np.zeros((0, 3), int), [3]], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"got a float32 array"):
    continue_context(decoder, params, context, np.ones((2, 2), np.float32), max_new_tokens=2)
  with pytest.raises(ValueError, match=r"tokens\[1\] must be a list of int token ids"):
    continue_context(decoder, params, context, [[1, 2], [3.5]], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"tokens holds token id 64; ids must be \[0, 63\]"):
    continue_context(decoder, params, context, [[1, 64], [3]], max_new_tokens=2)
  for wrapping in ([[1, 2**32 + 5], [3]], np.array([[1, 2**32 + 5], [3, 4]])):
    with pytest.raises(ValueError, match=r"holds token id 4294967301"):  # not wrapped to 5
      continue_context(decoder, params, context, wrapping, max_new_tokens=2)
  with pytest.raises(ValueError, match=r"pad_token_id holds token id -1"):
    continue_context(decoder, params, context, [[1, 2], [3]], max_new_tokens=2, pad_token_id=-1)
  with pytest.raises(ValueError, match=r"stop_token_ids holds token id 999; ids must be \[0, 63\]"):
    continue_context(decoder, params, context, [[1], [3]], max_new_tokens=2, stop_token_ids=[999])
  # One stop id as an int, as generate takes it.
  _, count = continue_context(
    decoder, params, context, [[1], [3]], max_new_tokens=2, stop_token_ids=2
  )
  assert count.shape == (2,)
  with pytest.raises(ValueError, match=r"prompts holds token id 70; ids must be \[0, 63\]"):
    compress_context(decoder, params, [[1, 70]], cache_method=method, room=2)
  with pytest.raises(ValueError, match="cache_dtype=.*int8.* is not supported"):
    compress_context(decoder, params, PROMPTS, cache_method=method, room=2, cache_dtype=jnp.int8)
  with pytest.raises(ValueError, match="cache_method=None must be a cache method object"):
    compress_context(decoder, params, PROMPTS, cache_method=None, room=2)
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    continue_context(decoder, params, context, [[1], [2]], max_new_tokens=0)
  with pytest.raises(ValueError, match="key is required"):
    continue_context(
      decoder,
      params,
      context,
      [[1], [2]],
      max_new_tokens=2,
      sampling=SamplingConfig(temperature=1.0),
    )
  with pytest.raises(ValueError, match="context must be a CompressedContext"):
    continue_context(decoder, params, (context.caches,), [[1], [2]], max_new_tokens=2)
  # The longest fed list and every new token but the last (never appended) must fit.
  room = int(rows_room(context.caches).min())
  continue_context(decoder, params, context, [[1, 2, 3], []], max_new_tokens=room - 3 + 1)
  with pytest.raises(
    ValueError, match=f"continue_context: appends {room + 1} tokens.* room \\(of compress_context"
  ):
    continue_context(decoder, params, context, [[], [1, 2, 3]], max_new_tokens=room - 3 + 2)


def test_a_context_of_another_model_is_refused_before_it_is_continued():
  decoder, params = tiny_decoder()
  one_head, one_head_params = tiny_decoder(config=dataclasses.replace(TINY_CONFIG, num_kv_heads=1))
  three_layers, _ = tiny_decoder(config=dataclasses.replace(TINY_CONFIG, num_layers=3))
  wider, _ = tiny_decoder(config=dataclasses.replace(TINY_CONFIG, vocab_size=80))
  context = compress_context(decoder, params, PROMPTS[:1], cache_method=FullCache(), room=4)
  for other, message in (
    (three_layers, "caches for 2 layers, the decoder has 3"),
    (wider, "over 64 tokens, the decoder's vocabulary has 80"),
  ):
    for call in (
      lambda other=other: continue_context(other, params, context, [[1]], max_new_tokens=2),
      lambda other=other: share_context(other, context, 2, room=4),
    ):
      with pytest.raises(ValueError, match=message):
        call()
  # Heads that differ are refused where the caches first attend, not broadcast over the heads.
  one_head_context = compress_context(
    one_head, one_head_params, PROMPTS[:1], cache_method=FullCache(), room=0
  )
  shared = share_context(decoder, one_head_context, 2, room=4)
  with pytest.raises(ValueError, match=r"keys must be \[1, 2, tokens, 16\] to match the queries"):
    continue_context(decoder, params, shared, [[5], [6]], max_new_tokens=2)


def test_a_scanned_context_continues_in_an_unrolled_decoder():
  unrolled, params = tiny_decoder()
  scanned, scanned_params = tiny_decoder(layer_loop="scan")
  for spec in ("full", KIVI):
    method = parse_method_spec(spec)
    context = compress_context(scanned, scanned_params, PROMPTS, cache_method=method, room=8)
    want, _ = continue_context(scanned, scanned_params, context, QUESTIONS, max_new_tokens=4)
    got, _ = continue_context(unrolled, params, context, QUESTIONS, max_new_tokens=4)
    np.testing.assert_array_equal(got, want)


def test_pallas_on_a_backend_without_kernels_is_refused_before_anything_runs():
  if jax.default_backend() != "cpu":
    pytest.skip("kernels run here")
  decoder, params = tiny_decoder()
  message = "implementation='pallas' needs a GPU or TPU backend"
  with pytest.raises(ValueError, match=message):
    compress_context(
      decoder,
      params,
      PROMPTS,
      cache_method=parse_method_spec(KIVI, implementation="pallas"),
      room=2,
    )
  context = compress_context(decoder, params, PROMPTS, cache_method=FullCache(), room=0)
  with pytest.raises(ValueError, match=message):
    share_context(decoder, context, 2, room=4, implementation="pallas")


def test_a_shared_contexts_own_cache_takes_the_kernel_settings_given(monkeypatch):
  """The rows' own full-precision cache attends with the settings share_context was given (the
  context's caches keep theirs); settings naming the other backend's kernels are refused
  before anything is allocated."""
  decoder, params = tiny_decoder(layer_loop="scan")
  context = compress_context(decoder, params, PROMPTS, cache_method=FullCache(), room=0)
  settings = KernelSettings(full={"block_tokens": 16}, kernel_backend="tpu")
  shared = share_context(decoder, context, 2, room=4, kernel_settings=settings)
  (stacked,) = shared.caches
  assert stacked.stacked.own.kernel_settings == settings
  assert stacked.stacked.context.kernel_settings == KernelSettings()
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # read by the dispatch's check only
  with pytest.raises(ValueError, match="kernel_backend='tpu' cannot run compiled on the 'gpu'"):
    share_context(decoder, context, 2, room=4, kernel_settings=settings)


@pytest.mark.parametrize(
  "spec, layer_loop",
  each_in_one_layer_loop(
    [("full", "scan"), ("snapkv:budget=16,window=4", "unroll"), ("razor", "scan")]
  ),
)
def test_a_shared_context_answers_as_the_repeated_context(spec, layer_loop, profile_path):
  """Methods whose decoding only appends to a full-precision storage: the context held once
  answers every question as its copies do."""
  spec = with_razor_profile(spec, profile_path)
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  method = parse_method_spec(spec)
  questions = [[5, 9, 11, 4, 8], [7], [2, 2, 3], [1, 4], [], [9, 9, 9]]  # 3 per prompt
  compress = lambda room: compress_context(
    decoder, params, PROMPTS, cache_method=method, room=room, cache_dtype=jnp.float32
  )
  shared = share_context(decoder, compress(0), 3, room=11, cache_dtype=jnp.float32)
  np.testing.assert_array_equal(shared.lengths, [40, 40, 40, 29, 29, 29])
  tokens, count = continue_context(decoder, params, shared, questions, max_new_tokens=6)
  expected, expected_count = continue_context(
    decoder, params, repeat_context(compress(11), 3), questions, max_new_tokens=6
  )
  np.testing.assert_array_equal(tokens, expected)
  np.testing.assert_array_equal(count, expected_count)


def test_a_shared_context_holds_the_context_once_and_a_full_cache_per_row():
  decoder, params = tiny_decoder(layer_loop="scan")
  context = compress_context(decoder, params, PROMPTS, cache_method=parse_method_spec(KIVI), room=0)
  shared = share_context(decoder, context, 4, room=7)
  shape = decoder.cache_shape
  rows = 2 * 4
  # bf16 keys and values of 7 tokens per row and layer, and each row's int32 length.
  own_bytes = shape.num_layers * rows * (2 * shape.num_kv_heads * 7 * shape.head_dim * 2 + 4)
  assert shared.cache_bytes == context.cache_bytes + own_bytes
  assert shared.cache_bytes < repeat_context(context, 4).cache_bytes
  np.testing.assert_array_equal(rows_room(shared.caches), [7] * rows)
  tokens, count = continue_context(decoder, params, shared, [[1, 2]] * rows, max_new_tokens=6)
  assert tokens.shape == (rows, 6) and np.all(count == 6)
  with pytest.raises(ValueError, match="continue_context: appends 8 tokens"):
    continue_context(decoder, params, shared, [[1, 2, 3]] * rows, max_new_tokens=6)
  # The context is not changed by continuing it: asked again, it answers the same.
  again, _ = continue_context(decoder, params, shared, [[1, 2]] * rows, max_new_tokens=6)
  np.testing.assert_array_equal(again, tokens)


@pytest.mark.parametrize("layer_loop", ["scan", "unroll"])
def test_continuing_a_shared_context_holds_no_second_copy_of_it(layer_loop):
  """Found by a review: the decode loop returned every cache, and the layer scan wrote each
  layer's frozen context arrays back into its carry, so a continue_context call held the
  context twice (its program grew by 1.75x the context's growth). It now returns no caches and
  writes back only what a step changed: what grows with the context is attention's working
  memory, under one layer's keys and values plus its scores."""
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  fed, fed_lengths = _pack_fed_tokens([[1, 2, 3]] * 4, 4, 0)

  def compiled_bytes(context_len):
    prompt = [int(i % 60) + 1 for i in range(context_len)]
    context = compress_context(
      decoder, params, [prompt], cache_method=FullCache(), room=0, cache_dtype=jnp.float32
    )
    shared = share_context(decoder, context, 4, room=8, cache_dtype=jnp.float32)
    memory = (
      _continue_in_jit.lower(
        decoder,
        params,
        shared.next_logits,
        shared.caches,
        shared.lengths,
        jax.random.key(0),
        fed,
        fed_lengths,
        feed_chunk=None,
        max_new_tokens=4,
        sampling=SamplingConfig(),
        stop_token_ids=(),
        pad_token_id=0,
      )
      .compile()
      .memory_analysis()
    )
    return context.cache_bytes, memory.output_size_in_bytes + memory.temp_size_in_bytes

  short_context, short_program = compiled_bytes(400)
  long_context, long_program = compiled_bytes(1200)
  # Measured 2026-12-05: 0.75 of the context's growth in both layer loops (1.75 before).
  assert long_program - short_program < long_context - short_context


def test_share_context_refuses_bad_arguments_and_what_cannot_be_shared(tmp_path):
  decoder, params = tiny_decoder()
  context = compress_context(decoder, params, PROMPTS[:1], cache_method=FullCache(), room=0)
  for copies in (0, 2.0, True, "3"):
    with pytest.raises(ValueError, match=r"copies=.* must be an int >= 1"):
      share_context(decoder, context, copies, room=4)
  for room in (-1, True, 2.5):
    with pytest.raises(ValueError, match="room="):
      share_context(decoder, context, 2, room=room)
  message = "implementation='gpu' is not supported; allowed: auto, pallas"
  with pytest.raises(ValueError, match=message):
    share_context(decoder, context, 2, room=4, implementation="gpu")
  for dtype in (jnp.int8, "float64"):
    with pytest.raises(ValueError, match="cache_dtype=.* is not supported; allowed: bfloat16"):
      share_context(decoder, context, 2, room=4, cache_dtype=dtype)
  with pytest.raises(ValueError, match="kernel_settings must be a kvjax.kernel_settings"):
    share_context(decoder, context, 2, room=4, kernel_settings={"kernel_backend": "tpu"})
  with pytest.raises(ValueError, match="must be a CompressedContext"):
    share_context(decoder, context.caches, 2, room=4)
  shared = share_context(decoder, context, 2, room=4)
  for refused in (
    lambda: share_context(decoder, shared, 2, room=4),
    lambda: repeat_context(shared, 2),
  ):
    with pytest.raises(ValueError, match="the context is shared already"):
      refused()
  with pytest.raises(ValueError, match="save the context it was shared from"):
    save_context(tmp_path / "shared", shared)
  evicting = compress_context(
    decoder, params, PROMPTS[:1], cache_method=parse_method_spec("h2o_decode:budget=16"), room=0
  )
  with pytest.raises(ValueError, match="layer 0's cache cannot be shared: HeavyHitterEviction"):
    share_context(decoder, evicting, 2, room=4)


@pytest.mark.parametrize(
  "spec, layer_loop",
  [("full", "unroll"), (KIVI, "scan"), pytest.param("razor", "scan", marks=pytest.mark.slow)],
)
def test_a_shared_context_fed_in_chunks_answers_as_fed_token_by_token(
  spec, layer_loop, profile_path
):
  spec = with_razor_profile(spec, profile_path)
  decoder, params = tiny_decoder(layer_loop=layer_loop)
  context = compress_context(
    decoder, params, PROMPTS, cache_method=parse_method_spec(spec), room=0, cache_dtype=jnp.float32
  )
  shared = share_context(decoder, context, 3, room=14, cache_dtype=jnp.float32)
  # Ragged, one empty: rows of different context lengths (40, 29) start at their own positions.
  questions = [[5, 9, 11, 4, 8, 3, 3], [7], [], [1, 4], [2, 2, 3, 3, 1], [9, 9, 9, 9, 9, 9, 9, 1]]
  expected, expected_count = continue_context(decoder, params, shared, questions, max_new_tokens=6)
  for chunk in (3, 16):  # several chunks, the last partial; one chunk past the longest
    tokens, count = continue_context(
      decoder, params, shared, questions, max_new_tokens=6, feed_chunk=chunk
    )
    np.testing.assert_array_equal(tokens, expected, err_msg=f"feed_chunk={chunk}")
    np.testing.assert_array_equal(count, expected_count)


def test_feed_chunk_is_refused_where_it_cannot_append_exactly():
  decoder, params = tiny_decoder()
  context = compress_context(decoder, params, PROMPTS, cache_method=FullCache(), room=8)
  with pytest.raises(ValueError, match=r"feed_chunk=4: only a shared context"):
    continue_context(decoder, params, context, [[1], [2]], max_new_tokens=2, feed_chunk=4)
  shared = share_context(decoder, context, 1, room=8)
  for chunk in (0, 2.0, True):
    with pytest.raises(ValueError, match=r"feed_chunk=.* must be None"):
      continue_context(decoder, params, shared, [[1], [2]], max_new_tokens=2, feed_chunk=chunk)
  with pytest.raises(ValueError, match="continue_context: appends 9 tokens"):
    continue_context(decoder, params, shared, [[1] * 8, [2]], max_new_tokens=2, feed_chunk=4)


def test_a_sliding_window_model_shares_a_context_only_within_its_window():
  decoder, params = tiny_decoder(config=dataclasses.replace(TINY_CONFIG, sliding_window=16))
  short = [PROMPTS[0][:9], PROMPTS[1][:6]]
  method = FullCache()
  context = compress_context(
    decoder, params, short, cache_method=method, room=0, cache_dtype=jnp.float32
  )
  questions = [[5, 9], [7], [1, 2, 3], [4]]
  # 9 + 7 = 16 tokens at most: every token the rows see stays in the window.
  shared = share_context(decoder, context, 2, room=7, cache_dtype=jnp.float32)
  tokens, _ = continue_context(decoder, params, shared, questions, max_new_tokens=4)
  roomy = compress_context(
    decoder, params, short, cache_method=method, room=7, cache_dtype=jnp.float32
  )
  expected, _ = continue_context(
    decoder, params, repeat_context(roomy, 2), questions, max_new_tokens=4
  )
  np.testing.assert_array_equal(tokens, expected)
  with pytest.raises(ValueError, match="sliding window of 16 tokens, and a row may reach 17"):
    share_context(decoder, context, 2, room=8)
