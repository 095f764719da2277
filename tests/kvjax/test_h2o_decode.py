import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import ModelCacheShape, append_and_attend
from kvjax.compressed_context import compress_context, continue_context
from kvjax.generate import generate, prefill
from kvjax.h2o_decode import H2ODecode
from kvjax.kernel_settings import KernelSettings
from kvjax.method_spec import describe_method, parse_method_spec
from kvjax.prompt_batch import pack_prompts
from kvjax.teacher_forcing import teacher_force
from tests.kvjax.test_h2o import numpy_accumulated_attention, numpy_h2o_kept
from tests.kvjax.test_snapkv import numpy_reduce, softmax
from tests.kvjax.tiny_decoder import tiny_decoder

B, H, D, T = 2, 2, 8, 40
LENGTHS = np.array([40, 23], np.int32)
PROMPTS = [
  list(np.random.default_rng(0).integers(1, 64, 40)),
  list(np.random.default_rng(1).integers(1, 64, 29)),
]


def numpy_h2o_stream(queries, keys, values, steps, *, budget, window, gqa_reduce):
  """H2O run token by token, one row and KV head at a time, with Python lists (float64).

  `steps` = (queries [B, H, G, S, D], keys [B, H, S, D], values [B, H, S, D]) of the decode
  steps. Returns (outputs [B, H, G, S, D], {(b, h): {held position: accumulated score}}).
  """
  step_queries, step_keys, step_values = steps
  outputs = np.zeros(step_queries.shape)
  held_positions = {}
  kept = numpy_h2o_kept(queries, keys, LENGTHS, budget=budget, window=window, gqa_reduce=gqa_reduce)
  for b, length in enumerate(LENGTHS):
    accumulated = numpy_accumulated_attention(queries[b], keys[b], length)  # [H, G, length]
    for h in range(H):
      score = numpy_reduce(accumulated[h], gqa_reduce)
      held = [
        dict(position=p, key=keys[b, h, p], value=values[b, h, p], score=score[p])
        for p in kept[b, h]
      ]
      for s in range(step_queries.shape[3]):
        position = length + s
        held.append(
          dict(position=position, key=step_keys[b, h, s], value=step_values[b, h, s], score=0.0)
        )
        q = step_queries[b, h, :, s].astype(np.float64)  # [G, D]
        k = np.stack([t["key"] for t in held]).astype(np.float64)
        v = np.stack([t["value"] for t in held]).astype(np.float64)
        probs = softmax(q @ k.T / np.sqrt(D))  # [G, held]
        outputs[b, h, :, s] = probs @ v
        for token, received in zip(held, numpy_reduce(probs, gqa_reduce), strict=True):
          token["score"] += received
        if len(held) > budget:
          old = [i for i, t in enumerate(held) if t["position"] <= position - window]
          evicted = min(old, key=lambda i: held[i]["score"])
          del held[evicted]
      held_positions[b, h] = {int(t["position"]): t["score"] for t in held}
  return outputs, held_positions


@pytest.mark.parametrize(
  "group, gqa_reduce, budget, window",
  [(1, "mean", 12, 4), (3, "mean", 12, 4), (3, "max", 9, 1), (4, "sum", 30, 10)],
)
def test_decode_steps_match_h2o_run_token_by_token(group, gqa_reduce, budget, window):
  rng = np.random.default_rng(group * 100 + budget)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  steps = 15
  queries, keys, values = normal(B, H, group, T, D), normal(B, H, T, D), normal(B, H, T, D)
  step_queries, step_keys, step_values = (
    normal(B, H, group, steps, D),
    normal(B, H, steps, D),
    normal(B, H, steps, D),
  )
  method = H2ODecode(budget=budget, window=window, gqa_reduce=gqa_reduce, query_chunk=7)
  shape = ModelCacheShape(num_layers=1, num_kv_heads=H, num_query_heads=H * group, head_dim=D)
  cache = method.allocate(shape, 0, batch=B, prompt_len=T, max_new_tokens=steps, dtype=jnp.float32)
  assert cache.slots == budget
  cache = cache.ingest(*map(jnp.asarray, (keys, values, queries, LENGTHS)))
  step = jax.jit(lambda c, k, v, q: append_and_attend(c, k, v, q, sm_scale=D**-0.5))
  outputs = []
  for s in range(steps):
    out, cache = step(cache, step_keys[:, :, s], step_values[:, :, s], step_queries[:, :, :, s])
    outputs.append(np.asarray(out))
  expected_outputs, expected_held = numpy_h2o_stream(
    queries,
    keys,
    values,
    (step_queries, step_keys, step_values),
    budget=budget,
    window=window,
    gqa_reduce=gqa_reduce,
  )
  np.testing.assert_allclose(np.stack(outputs, axis=3), expected_outputs, atol=2e-5)
  held_positions, held_scores = np.asarray(cache.positions), np.asarray(cache.scores)
  for b, length in enumerate(LENGTHS):
    held = int(cache.lengths[b])
    assert held == min(budget, length + steps)
    assert int(cache.seen[b]) == length + steps
    for h in range(H):
      scores = dict(zip(held_positions[b, h, :held].tolist(), held_scores[b, h, :held]))
      assert sorted(scores) == sorted(expected_held[b, h])
      for position, score in scores.items():
        np.testing.assert_allclose(score, expected_held[b, h][position], rtol=1e-5, atol=1e-5)


def test_a_short_row_fills_its_free_slots_before_evicting():
  method = H2ODecode(budget=30, window=4)
  shape = ModelCacheShape(num_layers=1, num_kv_heads=H, num_query_heads=H * 2, head_dim=D)
  cache = method.allocate(shape, 0, batch=B, prompt_len=T, max_new_tokens=10, dtype=jnp.float32)
  rng = np.random.default_rng(0)
  queries, keys, values = (
    rng.normal(size=(B, H, 2, T, D)),
    rng.normal(size=(B, H, T, D)),
    rng.normal(size=(B, H, T, D)),
  )
  cache = cache.ingest(*map(jnp.asarray, (keys, values, queries, LENGTHS)))
  assert cache.lengths.tolist() == [30, 23]
  # Padding past each row's kept tokens is zero: nothing of the prompt's padding is stored.
  assert np.all(np.asarray(cache.keys)[1, :, 23:] == 0)
  for s in range(10):
    token = jnp.asarray(rng.normal(size=(B, H, D)), jnp.float32)
    _, cache = append_and_attend(
      cache, token, token, jnp.asarray(rng.normal(size=(B, H, 2, D)), jnp.float32), sm_scale=0.3
    )
    assert cache.lengths.tolist() == [30, min(30, 24 + s)]
  positions = np.asarray(cache.positions)
  # Row 1 kept its whole prompt until its slots were full, then evicted older tokens only.
  for h in range(H):
    held = set(positions[1, h].tolist())
    assert set(range(29, 33)) <= held and len(held) == 30
    assert set(range(50 - 4, 50)) <= set(positions[0, h].tolist())


def test_memory_stays_at_the_budget_however_many_tokens_are_generated():
  decoder, params = tiny_decoder()
  budgeted = {}
  per_step, one_shot = "h2o_decode:budget=16,window=4", "h2o:budget=16,window=4"
  for spec in (per_step, one_shot, "full"):
    for new in (5, 60):
      result = generate(
        decoder,
        params,
        PROMPTS,
        max_new_tokens=new,
        cache_method=parse_method_spec(spec),
        cache_dtype=jnp.bfloat16,
      )
      budgeted[spec, new] = result.cache_bytes
  assert budgeted[per_step, 5] == budgeted[per_step, 60]
  assert budgeted[one_shot, 60] > budgeted[one_shot, 5]
  # Per layer: bf16 K and V of 16 slots per KV head, a float32 score and an int32 position
  # per slot, and two int32 counters per row (slots in use, tokens seen).
  config = decoder.cache_shape
  slots = B * config.num_kv_heads * 16
  per_layer = slots * (2 * config.head_dim * 2 + 4 + 4) + 2 * B * 4
  assert budgeted[per_step, 60] == config.num_layers * per_layer


def teacher_forced_logprobs(spec: str, forced: np.ndarray, *, cache_dtype) -> np.ndarray:
  """Log-probs of `forced` [2, steps] after PROMPTS, through caches of `spec`."""
  decoder, params = tiny_decoder()
  tokens, lengths = pack_prompts(PROMPTS)
  logits, caches = prefill(
    decoder,
    params,
    tokens,
    lengths,
    cache_method=parse_method_spec(spec),
    max_new_tokens=forced.shape[1],
    cache_dtype=cache_dtype,
  )
  return np.asarray(teacher_force(decoder, params, logits, caches, lengths, forced)[0])


def test_prefill_choice_is_h2o_and_first_decode_step_agrees_with_it():
  """Before anything is evicted while decoding, h2o_decode holds what one-shot h2o keeps."""
  forced = np.array([[5, 6, 7], [8, 9, 10]], np.int32)
  one_shot, per_step = (
    teacher_forced_logprobs(spec, forced, cache_dtype=jnp.float32)
    for spec in ("h2o:budget=16,window=4", "h2o_decode:budget=16,window=4")
  )
  # Step 0 comes from prefill, step 1 attends over the same 16 kept tokens + the new one;
  # from step 2 on, h2o_decode has evicted a token for the new one and h2o has not.
  np.testing.assert_allclose(per_step[:, :2], one_shot[:, :2], atol=1e-5)
  assert not np.allclose(per_step[:, 2], one_shot[:, 2], atol=1e-5)


def test_a_budget_covering_prompt_and_answer_generates_what_the_full_cache_does():
  decoder, params = tiny_decoder()
  tokens = {
    spec: generate(
      decoder,
      params,
      PROMPTS,
      max_new_tokens=12,
      cache_method=parse_method_spec(spec),
      cache_dtype=jnp.float32,
    ).tokens
    for spec in ("full", "h2o_decode:budget=52")
  }
  np.testing.assert_array_equal(tokens["h2o_decode:budget=52"], tokens["full"])


def test_a_compressed_context_takes_ragged_questions_past_its_room_without_growing():
  decoder, params = tiny_decoder()
  method = parse_method_spec("h2o_decode:budget=16,window=4")
  contexts = {
    room: compress_context(
      decoder, params, PROMPTS, cache_method=method, room=room, cache_dtype=jnp.float32
    )
    for room in (1, 20)
  }
  # The budget is below the prompt: room changes nothing, and the cache never holds more.
  assert contexts[1].cache_bytes == contexts[20].cache_bytes
  answers = {
    room: continue_context(decoder, params, context, [[3, 4, 5, 6], [7]], max_new_tokens=8)
    for room, context in contexts.items()
  }
  assert answers[1][0].shape == (2, 8)
  np.testing.assert_array_equal(answers[1][0], answers[20][0])


@pytest.mark.parametrize("spec", ["h2o_decode:budget=64", "streaming:budget=64"])
def test_a_cache_allocated_under_its_budget_is_refused_past_its_room_not_evicted_early(spec):
  """20 prompt tokens + room 1 fit in 21 slots, less than the budget: evicting there would
  hold fewer tokens than asked for. With the room the continuation needs, it is the full
  cache's."""
  decoder, params = tiny_decoder()
  rng = np.random.default_rng(0)
  prompt, question = [rng.integers(1, 63, 20).tolist()], [rng.integers(1, 63, 12).tolist()]

  def answer(method, room):
    context = compress_context(
      decoder,
      params,
      prompt,
      cache_method=parse_method_spec(method),
      room=room,
      cache_dtype=jnp.float32,
    )
    return continue_context(decoder, params, context, question, max_new_tokens=16)[0]

  with pytest.raises(
    ValueError, match=r"appends 27 tokens per row, but row 0's caches have room for 1"
  ):
    answer(spec, room=1)
  np.testing.assert_array_equal(answer(spec, room=40), answer("full", room=40))


def test_a_budget_covering_everything_scores_as_the_full_cache_in_bfloat16():
  """The new token is attended as stored (rounded to the cache dtype), as the full cache does."""
  forced = np.asarray(np.random.default_rng(2).integers(1, 64, (2, 8)), np.int32)
  full, budgeted = (
    teacher_forced_logprobs(spec, forced, cache_dtype=jnp.bfloat16)
    for spec in ("full", "h2o_decode:budget=52")
  )
  np.testing.assert_allclose(budgeted, full, atol=2e-5)


def test_append_alone_is_refused_with_the_step_to_use():
  shape = ModelCacheShape(num_layers=1, num_kv_heads=H, num_query_heads=H, head_dim=D)
  cache = H2ODecode(budget=8, window=2).allocate(
    shape, 0, batch=1, prompt_len=4, max_new_tokens=8, dtype=jnp.float32
  )
  with pytest.raises(TypeError, match="kvjax.append_and_attend"):
    cache.append(jnp.zeros((1, H, D)), jnp.zeros((1, H, D)))


def test_spec_round_trip_and_defaults():
  method = parse_method_spec("h2o_decode:budget=64")
  assert method.recent_window(64) == 32  # the paper's equal heavy and recent shares
  assert describe_method(method) == "h2o_decode:budget=64"
  assert parse_method_spec(describe_method(method)) == method
  assert H2ODecode(ratio=0.25).budget_tokens(400) == 100


@pytest.mark.parametrize(
  "make, match",
  [
    (lambda: H2ODecode(budget=8, window=8), "budget=8 is smaller than window \\+ 1"),
    (lambda: H2ODecode(budget=8, window=0), "window=0 must be an int >= 1"),
    (lambda: H2ODecode(budget=16, window=2.5), "h2o_decode: window=2.5 must be an int >= 1"),
    (lambda: H2ODecode(budget=8, ratio=0.5), "not both"),
    (lambda: H2ODecode(gqa_reduce="median"), "gqa_reduce"),
    (lambda: H2ODecode(query_chunk=0), "query_chunk=0"),
    (lambda: parse_method_spec("h2o_decode:budget=8+kivi:bits=4"), "storage 'kivi'"),
    (
      lambda: parse_method_spec("h2o_decode:budget=8", implementation="pallas"),
      "implementation='pallas'; allowed: auto, reference",
    ),
  ],
)
def test_bad_configurations_are_refused(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize("budget", [32, 8])
def test_a_sliding_window_model_is_refused_past_its_window(budget):
  # Even a budget inside the window holds heavy hitters older than the window.
  shape = ModelCacheShape(
    num_layers=1, num_kv_heads=H, num_query_heads=H, head_dim=D, sliding_window=16
  )
  with pytest.raises(
    ValueError, match=r"h2o_decode: .*sliding_window=16 < prompt \+ new tokens = 44"
  ):
    H2ODecode(budget=budget).allocate(
      shape, 0, batch=1, prompt_len=40, max_new_tokens=4, dtype=jnp.float32
    )
  # A generation inside the window never reaches past it.
  H2ODecode(budget=budget).allocate(
    shape, 0, batch=1, prompt_len=12, max_new_tokens=4, dtype=jnp.float32
  )


def test_kernel_settings_are_named_as_ignored():
  """Its attention is always jnp: settings for kernels it never runs are not taken silently."""
  settings = KernelSettings(full={"lowering": "mosaic_gpu", "block_tokens": 64})
  with pytest.warns(UserWarning, match="h2o_decode ignores its kernel_settings"):
    parse_method_spec("h2o_decode:budget=48", kernel_settings=settings)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    parse_method_spec("h2o_decode:budget=48")
