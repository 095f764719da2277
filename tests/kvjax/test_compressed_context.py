import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_room import rows_room
from kvjax.compressed_context import (
  compress_context,
  context_template,
  continue_context,
  repeat_context,
)
from kvjax.dense_cache import FullCache
from kvjax.generate import decode, generate, prefill
from kvjax.method_spec import parse_method_spec
from kvjax.prompt_batch import pack_prompts
from kvjax.sampling import SamplingConfig
from kvjax.teacher_forcing import teacher_force
from tests.kvjax.test_method_matrix import PROMPTS
from tests.kvjax.tiny_decoder import tiny_decoder

QUESTIONS = [[5, 9, 11], [7, 3, 2]]
RAGGED_QUESTIONS = [[5, 9, 11, 4, 8], [7]]
KIVI = "kivi:bits=4,group_size=16,residual=16"


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
  "spec", ["full", KIVI, "snapkv:budget=16,window=4", "streaming:budget=16,sinks=2"]
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


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
@pytest.mark.parametrize(
  "spec",
  [KIVI, f"snapkv:budget=16,window=4+{KIVI}", "h2o_decode:budget=16,window=4", "razor"],
)
def test_a_repeated_context_answers_each_question_as_the_context_alone(
  spec, layer_loop, profile_path
):
  if spec == "razor":
    spec = f"razor:budget=12,sinks=2,profile={profile_path}"
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
  context = compress_context(decoder, params, PROMPTS, cache_method=method, room=4)
  with pytest.raises(ValueError, match="got 1 items of types"):
    continue_context(decoder, params, context, [[1, 2]], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"got 2 items of types \['int'\]"):
    continue_context(decoder, params, context, [1, 2], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"got a int32 array of shape \(1, 2\)"):
    continue_context(decoder, params, context, np.ones((1, 2), np.int32), max_new_tokens=2)
  with pytest.raises(ValueError, match=r"got a float32 array"):
    continue_context(decoder, params, context, np.ones((2, 2), np.float32), max_new_tokens=2)
  with pytest.raises(ValueError, match=r"tokens\[1\] must be a list of int token ids"):
    continue_context(decoder, params, context, [[1, 2], [3.5]], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"tokens holds token id 64; ids must be \[0, 63\]"):
    continue_context(decoder, params, context, [[1, 64], [3]], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"pad_token_id holds token id -1"):
    continue_context(decoder, params, context, [[1, 2], [3]], max_new_tokens=2, pad_token_id=-1)
  with pytest.raises(ValueError, match=r"prompts holds token id 70; ids must be \[0, 63\]"):
    compress_context(decoder, params, [[1, 70]], cache_method=method, room=2)
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
  with pytest.raises(ValueError, match=f"continue_context: appends {room + 1} tokens"):
    continue_context(decoder, params, context, [[], [1, 2, 3]], max_new_tokens=room - 3 + 2)
