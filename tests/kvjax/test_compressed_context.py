import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_room import rows_room
from kvjax.compressed_context import (
  compress_context,
  context_template,
  continue_context,
)
from kvjax.generate import generate, prefill
from kvjax.method_spec import parse_method_spec
from kvjax.prompt_batch import pack_prompts
from kvjax.sampling import SamplingConfig
from tests.kvjax.test_method_matrix import PROMPTS
from tests.kvjax.tiny_decoder import tiny_decoder

QUESTIONS = [[5, 9, 11], [7, 3, 2]]
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


def test_a_question_fed_after_a_full_cache_answers_like_the_whole_prompt():
  decoder, params = tiny_decoder()
  method = parse_method_spec("full")
  whole = [p + q for p, q in zip(PROMPTS, QUESTIONS)]
  expected = generate(
    decoder, params, whole, max_new_tokens=6, cache_method=method, cache_dtype=jnp.float32
  )
  context = compress_context(
    decoder, params, PROMPTS, cache_method=method, room=3 + 6, cache_dtype=jnp.float32
  )
  tokens, _ = continue_context(decoder, params, context, QUESTIONS, max_new_tokens=6)
  np.testing.assert_array_equal(tokens, expected.tokens)


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


def test_bad_arguments_are_refused_before_anything_runs():
  decoder, params = tiny_decoder()
  method = parse_method_spec(KIVI)
  for room in (-1, True, 2.5):
    with pytest.raises(ValueError, match="room="):
      compress_context(decoder, params, PROMPTS, cache_method=method, room=room)
  with pytest.raises(ValueError, match="prompt_len=0"):
    context_template(decoder, params, batch=1, prompt_len=0, cache_method=method, room=1)
  context = compress_context(decoder, params, PROMPTS, cache_method=method, room=4)
  with pytest.raises(ValueError, match="equally long token lists"):
    continue_context(decoder, params, context, [[1, 2], [3]], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"got shape \(1, 2\)"):
    continue_context(decoder, params, context, [[1, 2]], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"got shape \(2,\)"):
    continue_context(decoder, params, context, [1, 2], max_new_tokens=2)
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
  # The fed tokens and every new token but the last (never appended) must fit.
  room = int(rows_room(context.caches).min())
  continue_context(decoder, params, context, QUESTIONS, max_new_tokens=room - 3 + 1)
  with pytest.raises(ValueError, match=f"continue_context: appends {room + 1} tokens"):
    continue_context(decoder, params, context, QUESTIONS, max_new_tokens=room - 3 + 2)
