import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.generate import generate
from kvjax.sampling import SamplingConfig
from tests.kvjax.tiny_decoder import tiny_decoder


def _greedy_reference(decoder, params, prompt, steps):
  """Greedy decoding by re-running the whole sequence each step (no cache reuse at all)."""
  from kvjax.cache_protocol import allocate_model_cache
  from kvjax.dense_cache import FullCache

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
  ],
)
def test_bad_generate_arguments_error_before_tracing(kwargs, message):
  decoder, params = tiny_decoder()
  with pytest.raises(ValueError, match=message):
    generate(decoder, params, [[1, 2, 3]], **kwargs)


def test_decoding_ends_early_once_every_row_stopped():
  decoder, params = tiny_decoder()
  free = generate(decoder, params, [[3, 14, 15]], max_new_tokens=8, cache_dtype=jnp.float32)
  assert free.decode_steps == 7
  stop = int(free.tokens[0, 1])
  first = free.tokens[0].tolist().index(stop)
  stopped = generate(
    decoder, params, [[3, 14, 15]], max_new_tokens=8, cache_dtype=jnp.float32, stop_token_ids=[stop]
  )
  assert stopped.decode_steps == first + 1
