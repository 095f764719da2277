import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import ModelCacheShape
from kvjax.method_spec import parse_method_spec
from kvjax.rope import RopeScaling, rope_inverse_frequencies
from kvjax.streaming_llm import StreamingLLM
from tests.kvjax.test_snapkv import PROMPTS, run_generate, softmax

B, H, G, D = 2, 2, 2, 8
SHAPE = ModelCacheShape(num_layers=1, num_kv_heads=H, num_query_heads=H * G, head_dim=D)
THETA = 10000.0


def numpy_rope(x, positions, theta=THETA, inv_freq=None):  # x [..., tokens, D], positions [tokens]
  if inv_freq is None:
    inv_freq = 1.0 / theta ** (np.arange(0, x.shape[-1], 2) / x.shape[-1])
  angles = np.asarray(positions, np.float64)[:, None] * inv_freq
  angles = np.concatenate([angles, angles], -1)
  half = x.shape[-1] // 2
  rotated_half = np.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * np.cos(angles) + rotated_half * np.sin(angles)


def numpy_streaming_kept(total, sinks, window):
  """Positions a StreamingLLM cache holds after seeing `total` tokens, in sequence order."""
  sink_positions = np.arange(min(sinks, total))
  return np.concatenate([sink_positions, np.arange(max(sinks, total - window), total)])


def run_stream(method, lengths, prompt_len, steps, seed=0, shape=SHAPE, inv_freq=None):
  """Ingest prompts of `lengths` (unrotated `raw` keys, rotated at their positions), then append."""
  rng = np.random.default_rng(seed)
  total = prompt_len + steps
  batch = len(lengths)
  raw_keys = rng.normal(size=(batch, H, total, D))
  values = rng.normal(size=(batch, H, total, D))
  # Token t of row b: prompt tokens at [0, length), decode step i at position length + i.
  rotated = numpy_rope(raw_keys, np.arange(total), inv_freq=inv_freq)
  cache = method.allocate(
    shape, 0, batch=batch, prompt_len=prompt_len, max_new_tokens=steps, dtype=jnp.float32
  )
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  prompt = np.s_[:, :, :prompt_len]
  cache = cache.ingest(f32(rotated[prompt]), f32(values[prompt]), None, jnp.asarray(lengths))
  for step in range(steps):
    positions = np.asarray(lengths) + step
    rows = np.arange(batch)
    cache = cache.append(f32(rotated[rows, :, positions]), f32(values[rows, :, positions]))
  return cache, raw_keys, rotated, values


@pytest.mark.parametrize("steps", [0, 3, 9])
def test_cache_holds_the_sinks_and_the_most_recent_tokens_while_decoding(steps):
  lengths = np.array([20, 9], np.int32)
  cache, _, rotated, values = run_stream(StreamingLLM(budget=10, sinks=3), lengths, 20, steps)
  assert cache.keys.shape == (B, H, 10, D)  # the budget, whatever the length
  np.testing.assert_array_equal(cache.lengths, lengths + steps)
  rng = np.random.default_rng(1)
  q = rng.normal(size=(B, H, G, D))
  out = np.asarray(cache.attend(jnp.asarray(q, jnp.float32), sm_scale=0.5))
  for b in range(B):
    total = lengths[b] + steps
    kept = numpy_streaming_kept(total, 3, 7)
    held = min(total, 10)
    assert len(kept) == held
    # Slots are a ring: compare as sets of tokens (attention does not depend on slot order).
    stored = np.asarray(cache.keys[b, :, :held])
    order = np.argsort(stored[0, :, 0])
    expected = rotated[b][:, kept]
    expected_order = np.argsort(expected[0, :, 0])
    np.testing.assert_allclose(stored[:, order], expected[:, expected_order], atol=1e-6)
    for h in range(H):
      reference = softmax(q[b, h] @ rotated[b, h, kept].T * 0.5) @ values[b, h, kept]
      np.testing.assert_allclose(out[b, h], reference, atol=1e-5)


# Llama-3 scaling that changes the frequencies these few positions reach (wavelengths past 16).
SHORT_LLAMA3 = RopeScaling(
  factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)


@pytest.mark.parametrize("scaling", [None, SHORT_LLAMA3], ids=["plain", "llama3"])
def test_in_cache_positions_equal_rotating_raw_keys_at_their_cache_index(scaling):
  lengths = np.array([20, 9], np.int32)
  steps = 6
  shape = dataclasses.replace(SHAPE, rope_theta=THETA, rope_scaling=scaling)
  inv_freq = rope_inverse_frequencies(D, THETA, scaling).astype(np.float64)
  method = StreamingLLM(budget=10, sinks=3, positions="in_cache", rope_theta=THETA)
  cache, raw_keys, rotated, values = run_stream(
    method, lengths, 20, steps, shape=shape, inv_freq=inv_freq
  )
  original, _, _, _ = run_stream(
    StreamingLLM(budget=10, sinks=3), lengths, 20, steps, shape=shape, inv_freq=inv_freq
  )
  rng = np.random.default_rng(2)
  raw_q = rng.normal(size=(B, H, G, D))
  q_at_original = np.stack(
    [
      numpy_rope(raw_q[b][:, :, None], [lengths[b] + steps - 1], inv_freq=inv_freq)[:, :, 0]
      for b in range(B)
    ]
  )
  out = np.asarray(cache.attend(jnp.asarray(q_at_original, jnp.float32), sm_scale=0.5))
  out_original = np.asarray(original.attend(jnp.asarray(q_at_original, jnp.float32), sm_scale=0.5))
  for b in range(B):
    kept = numpy_streaming_kept(lengths[b] + steps, 3, 7)
    in_cache = np.arange(len(kept))  # the authors' scheme: keys at 0..n-1, the query at n-1
    k = numpy_rope(raw_keys[b][:, kept], in_cache, inv_freq=inv_freq)
    q = numpy_rope(raw_q[b][:, :, None], [len(kept) - 1], inv_freq=inv_freq)[:, :, 0]
    for h in range(H):
      reference = softmax(q[h] @ k[h].T * 0.5) @ values[b, h, kept]
      np.testing.assert_allclose(out[b, h], reference, atol=1e-5)
  if scaling is not None:
    # the same keys re-rotated without the model's scaling would attend elsewhere
    plain = dataclasses.replace(shape, rope_scaling=None)
    unscaled, *_ = run_stream(method, lengths, 20, steps, shape=plain, inv_freq=inv_freq)
    q = jnp.asarray(q_at_original, jnp.float32)
    assert not np.allclose(unscaled.attend(q, sm_scale=0.5), out, atol=1e-3)
  # Row 0 has evicted tokens, so its sinks moved; row 1 (15 tokens) also; both differ from
  # the original-position variant. Before any eviction the two variants agree.
  assert not np.allclose(out, out_original, atol=1e-4)
  short = np.array([5, 4], np.int32)
  early, *_ = run_stream(method, short, 5, 2, shape=shape, inv_freq=inv_freq)
  early_original, *_ = run_stream(
    StreamingLLM(budget=10, sinks=3), short, 5, 2, shape=shape, inv_freq=inv_freq
  )
  q = jnp.asarray(rng.normal(size=(B, H, G, D)), jnp.float32)
  np.testing.assert_allclose(
    early.attend(q, sm_scale=0.5), early_original.attend(q, sm_scale=0.5), atol=1e-6
  )


def test_in_cache_positions_attend_the_same_jitted_at_batch_one():
  """The sinks' re-rotation written into the keys by `.at[].set` and then attended was
  miscompiled by XLA's CPU backend at batch 1 (jax 0.12.0.1): the jitted call's output was off
  by up to 0.3 from the same call run eagerly, and generate's tokens with it. A batch of one
  row that has evicted tokens, attended jitted, against numpy."""
  method = StreamingLLM(budget=8, sinks=2, positions="in_cache", rope_theta=THETA)
  shape = dataclasses.replace(SHAPE, rope_theta=THETA)
  lengths = np.array([30], np.int32)
  cache, raw_keys, _, values = run_stream(method, lengths, 30, 0, shape=shape)
  raw_q = np.random.default_rng(3).normal(size=(1, H, G, D))
  kept = numpy_streaming_kept(30, 2, 6)
  q_at_original = numpy_rope(raw_q[0][:, :, None], [29])[:, :, 0]  # what the model hands in
  attend = jax.jit(lambda cache, q: cache.attend(q, sm_scale=0.5))
  out = np.asarray(attend(cache, jnp.asarray(q_at_original[None], jnp.float32)))
  # The authors' scheme: keys at 0..n-1, the query at n-1.
  q = numpy_rope(raw_q[0][:, :, None], [len(kept) - 1])[:, :, 0]
  k = numpy_rope(raw_keys[0][:, kept], np.arange(len(kept)))
  for h in range(H):
    reference = softmax(q[h] @ k[h].T * 0.5) @ values[0, h, kept]
    np.testing.assert_allclose(out[0, h], reference, atol=1e-5)


def test_slots_are_the_budget_or_less_when_everything_fits():
  method = StreamingLLM(budget=64)
  assert method.slots(prompt_len=100, max_new_tokens=10) == 64
  assert method.slots(prompt_len=20, max_new_tokens=10) == 30  # nothing will ever be evicted
  assert StreamingLLM(ratio=0.25).slots(prompt_len=100, max_new_tokens=10) == 25
  assert StreamingLLM().slots(prompt_len=5000, max_new_tokens=10) == 1024


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(budget=4), r"streaming: budget=4 is smaller than sinks \+ a window of 1 = 5"),
    (dict(ratio=0.0), r"ratio=0.0 must be in \(0, 1\]"),
    (dict(positions="relative"), "positions='relative'; allowed: original, in_cache"),
    (dict(positions="in_cache"), "positions=in_cache re-rotates keys and needs rope_theta"),
    (dict(rope_theta=1e4), "rope_theta is only used with positions=in_cache"),
    (dict(sinks=-1), "sinks=-1 must be an int >= 0"),
    (dict(sinks=2.5), "streaming: sinks=2.5 must be an int >= 0"),
    # The default budget (1024) cannot hold 2000 sinks and a window: refused, not truncated.
    (dict(sinks=2000), r"streaming: the default budget=1024 is smaller than sinks \+ a window"),
    (
      dict(positions="in_cache", rope_theta=float("nan")),
      "rope_theta=nan; it must be a finite number > 0",
    ),
    (dict(positions="in_cache", rope_theta="1e4"), "rope_theta='1e4'; it must be a finite"),
    (dict(positions="in_cache", rope_theta=True), "rope_theta=True; it must be a finite"),
  ],
)
def test_bad_configurations_raise_clearly(kwargs, message):
  with pytest.raises(ValueError, match=message):
    StreamingLLM(**kwargs)


@pytest.mark.parametrize("prompt_len", [3, 4])
def test_a_ratio_budget_under_the_sinks_still_keeps_a_window_for_new_tokens(prompt_len):
  """ratio=1 of a prompt no longer than the sinks is a budget of only sinks: it must still hold
  the newest token (a ring of 0 slots dropped every decoded token, and attention never saw it)."""
  method = StreamingLLM(ratio=1.0, sinks=4)
  steps = 3
  cache, _, rotated, values = run_stream(
    method, np.array([prompt_len, prompt_len]), prompt_len, steps
  )
  assert cache.window >= 1 and cache.sinks == 4
  q = np.random.default_rng(3).normal(size=(B, H, G, D))
  out = np.asarray(cache.attend(jnp.asarray(q, jnp.float32), sm_scale=0.5))
  kept = numpy_streaming_kept(prompt_len + steps, 4, cache.window)
  for b in range(B):
    for h in range(H):
      reference = softmax(q[b, h] @ rotated[b, h, kept].T * 0.5) @ values[b, h, kept]
      np.testing.assert_allclose(out[b, h], reference, atol=1e-5)


def test_in_cache_rope_theta_other_than_the_models_is_refused():
  method = StreamingLLM(budget=10, positions="in_cache", rope_theta=THETA)
  shape = dataclasses.replace(SHAPE, rope_theta=500000.0)
  with pytest.raises(
    ValueError, match="rope_theta=10000.0 differs from the model's RoPE base 500000.0"
  ):
    method.allocate(shape, 0, batch=1, prompt_len=4, max_new_tokens=2, dtype=jnp.float32)


def test_codec_storage_is_refused_clearly():
  with pytest.raises(ValueError, match="streaming: storage 'kivi' is not supported"):
    parse_method_spec("streaming:budget=64+kivi:bits=4")


def test_generate_batch_of_two_lengths_evicting_while_decoding():
  """Row 0 (37 tokens) is cut at prefill; row 1 (10 tokens) fills the 12-token budget after
  two decode steps and evicts from the third. Each row generates what it generates alone (rows
  evict independently, at their own steps); row 1 generates the full cache's first 3 tokens
  (predicted from at most 12 tokens) and, once its middle tokens are evicted, not its 7th.
  Which tokens the cache holds while decoding is checked slot by slot by
  `test_cache_holds_the_sinks_and_the_most_recent_tokens_while_decoding`."""
  method = parse_method_spec("streaming:budget=12,sinks=2")
  prompts = [PROMPTS[0], PROMPTS[1][:10]]
  result = run_generate(method, max_new_tokens=8, prompts=prompts)
  assert result.cache_bytes == 2 * (2 * 2 * 2 * 12 * 16 * 4 + 2 * 4)
  for row, prompt in enumerate(prompts):
    alone = run_generate(method, max_new_tokens=8, prompts=[prompt])
    np.testing.assert_array_equal(result.tokens[row], alone.tokens[0])
  full = run_generate(parse_method_spec("full"), max_new_tokens=8, prompts=prompts)
  np.testing.assert_array_equal(result.tokens[1, :3], full.tokens[1, :3])
  assert not np.array_equal(result.tokens[1], full.tokens[1])
