import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import allocate_model_cache
from kvjax.duo_gate_training import (
  GateTraining,
  PasskeySamples,
  gate_caches,
  gated_prompt_attention,
  passkey_training_samples,
  train_duo_gates,
)
from kvjax.method_spec import parse_method_spec
from kvjax.prefill_attention import causal_prompt_attention
from tests.kvjax.tiny_decoder import tiny_decoder


def reference_gated_attention(q, k, v, gates, *, sinks, recent, sm_scale, sliding_window=None):
  """Per query i: gate x softmax over j <= i, + (1 - gate) x softmax over those j with j < sinks
  or i - j < recent."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  batch, heads, group, tokens, _ = q.shape
  out = np.zeros(q.shape)
  for b in range(batch):
    for h in range(heads):
      for i in range(tokens):
        causal = np.arange(tokens) <= i
        if sliding_window is not None:
          causal &= i - np.arange(tokens) < sliding_window
        streaming = causal & ((np.arange(tokens) < sinks) | (i - np.arange(tokens) < recent))
        for g in range(group):
          scores = k[b, h] @ q[b, h, g, i] * sm_scale
          mixed = 0
          for weight, allowed in ((gates[h], causal), (1 - gates[h], streaming)):
            p = np.where(allowed, np.exp(scores - scores[allowed].max()), 0)
            mixed = mixed + weight * (p / p.sum()) @ v[b, h]
          out[b, h, g, i] = mixed
  return out


@pytest.mark.parametrize(
  "tokens, group, sinks, recent, sliding_window, query_chunk",
  [(23, 2, 2, 5, None, 7), (16, 1, 0, 3, None, 16), (19, 4, 3, 4, 9, 5), (12, 2, 4, 20, None, 5)],
)
def test_gated_attention_matches_the_reference(
  tokens, group, sinks, recent, sliding_window, query_chunk
):
  rng = np.random.default_rng(tokens)
  q = rng.normal(size=(2, 3, group, tokens, 8)).astype(np.float32)
  k = rng.normal(size=(2, 3, tokens, 8)).astype(np.float32)
  v = rng.normal(size=(2, 3, tokens, 8)).astype(np.float32)
  gates = np.array([0.0, 0.3, 1.0], np.float32)
  got = gated_prompt_attention(
    q,
    k,
    v,
    jnp.asarray(gates),
    sinks=sinks,
    recent=recent,
    sm_scale=0.35,
    sliding_window=sliding_window,
    query_chunk=query_chunk,
  )
  want = reference_gated_attention(
    q, k, v, gates, sinks=sinks, recent=recent, sm_scale=0.35, sliding_window=sliding_window
  )
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


def test_gates_of_one_are_the_models_causal_attention():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 2, 2, 30, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, 2, 30, 8)), jnp.float32) for _ in range(2))
  got = gated_prompt_attention(q, k, v, jnp.ones(2), sinks=1, recent=4, sm_scale=0.3)
  np.testing.assert_allclose(got, causal_prompt_attention(q, k, v, sm_scale=0.3), atol=1e-5)


def test_the_gradient_of_a_gate_is_full_minus_streaming_attention():
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(1, 2, 1, 12, 4)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, 2, 12, 4)), jnp.float32) for _ in range(2))
  weights = jnp.asarray(rng.normal(size=(1, 2, 1, 12, 4)), jnp.float32)
  attend = lambda gates: gated_prompt_attention(
    q, k, v, gates, sinks=1, recent=3, sm_scale=0.5, query_chunk=5
  )
  grad = jax.grad(lambda gates: (attend(gates) * weights).sum())(jnp.array([0.2, 0.7]))
  difference = (attend(jnp.ones(2)) - attend(jnp.zeros(2))) * weights
  np.testing.assert_allclose(grad, difference.sum(axis=(0, 2, 3, 4)), rtol=1e-4, atol=1e-5)


def test_a_decoder_with_gates_of_one_gives_the_full_models_hidden_states():
  decoder, params = tiny_decoder()
  tokens = jnp.asarray(np.random.default_rng(2).integers(1, 64, (2, 40)), jnp.int32)
  lengths = jnp.array([40, 31], jnp.int32)
  ones = jnp.ones((2, 2), jnp.float32)
  gated, _ = decoder.prefill_hidden_states(
    params, tokens, lengths, gate_caches(ones, sinks=2, recent=4, query_chunk=16)
  )
  caches = allocate_model_cache(
    parse_method_spec("full"),
    decoder.cache_shape,
    batch=2,
    prompt_len=40,
    max_new_tokens=0,
    dtype=jnp.float32,
  )
  full, _ = decoder.prefill_hidden_states(params, tokens, lengths, caches)
  np.testing.assert_allclose(gated, full, atol=1e-5)
  # Gates of zero: the streaming heads change the hidden states past sinks + recent.
  zeros = gate_caches(jnp.zeros((2, 2)), sinks=2, recent=4, query_chunk=16)
  streaming, _ = decoder.prefill_hidden_states(params, tokens, lengths, zeros)
  np.testing.assert_allclose(streaming[:, :6], full[:, :6], atol=1e-5)
  assert np.abs(np.asarray(streaming[:, 6:] - full[:, 6:])).max() > 1e-3


def _tiny_samples():
  rng = np.random.default_rng(3)
  supervised = np.zeros((4, 40), bool)
  supervised[:, 30:] = True
  return PasskeySamples(
    rng.integers(1, 64, (4, 40)).astype(np.int32), np.full((4,), 40, np.int32), supervised
  )


def test_training_starts_at_the_l1_penalty_and_keeps_gates_in_range():
  decoder, params = tiny_decoder()
  settings = GateTraining(sinks=2, recent=4, steps=12, batch=2, query_chunk=16)
  gates, losses = train_duo_gates(decoder, params, _tiny_samples(), settings)
  assert gates.shape == (2, 2) and losses.shape == (12,)
  # Gates of one are the full model: only the penalty l1_weight x mean |gate| = 0.05 is left.
  np.testing.assert_allclose(losses[0], 0.05, rtol=1e-5)
  assert np.all((gates >= 0) & (gates <= 1)) and gates.max() < 1
  assert losses[-1] < losses[0]


def test_without_the_penalty_the_full_model_is_the_optimum_and_gates_stay_at_one():
  """At gates of 1 the distillation error is 0 and so is its gradient: without the penalty and
  without weight decay (the authors' AdamW has none) no step moves a gate."""
  decoder, params = tiny_decoder()
  settings = GateTraining(sinks=2, recent=4, steps=5, l1_weight=0.0, query_chunk=16)
  gates, losses = train_duo_gates(decoder, params, _tiny_samples(), settings)
  assert np.all(gates == 1.0) and np.all(losses < 1e-8)
  # With weight decay the first step pulls every gate off 1 by lr x decay x gate.
  decayed = dataclasses.replace(settings, weight_decay=0.1, steps=1)
  np.testing.assert_allclose(
    train_duo_gates(decoder, params, _tiny_samples(), decayed)[0], 1 - 0.02 * 0.1, rtol=1e-6
  )


def test_the_authors_schedule_warms_up_and_decays_over_a_fifth_of_the_steps():
  rates = lambda **kw: np.asarray(
    GateTraining(steps=10, learning_rate=0.02, **kw).learning_rate_at(jnp.arange(10))
  )
  # fifth = 2: (step + 1) / 2 up, (10 - step) / 2 down, capped at 1, floored at 0.1
  np.testing.assert_allclose(rates(), 0.02 * np.array([0.5] + [1.0] * 8 + [0.5]), rtol=1e-6)
  np.testing.assert_allclose(rates(lr_schedule="constant"), np.full(10, 0.02), rtol=1e-6)
  long = np.asarray(GateTraining(steps=2000).learning_rate_at(jnp.array([0, 399, 1000, 1999])))
  np.testing.assert_allclose(long, 0.02 * np.array([0.1, 1.0, 1.0, 0.1]), rtol=1e-6)
  # A plain int step, and fewer than 5 steps (the authors' formula divides by steps // 5 = 0).
  assert float(GateTraining(steps=10).learning_rate_at(0)) == pytest.approx(0.01)
  np.testing.assert_allclose(GateTraining(steps=3).learning_rate_at(jnp.arange(3)), 0.02)


def test_a_stronger_penalty_lowers_the_gates_further():
  decoder, params = tiny_decoder()
  train = lambda l1: train_duo_gates(
    decoder,
    params,
    _tiny_samples(),
    GateTraining(sinks=2, recent=4, steps=10, l1_weight=l1, query_chunk=16),
  )[0]
  assert train(1.0).mean() < train(0.001).mean()


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(steps=0), "steps=0 must be an int >= 1"),
    (dict(recent=0), "recent=0 must be an int >= 1"),
    (dict(sinks=-1), "sinks=-1 must be an int >= 0"),
    (dict(batch=1.5), "batch=1.5 must be an int >= 1"),
    (dict(learning_rate=-0.1), "learning_rate=-0.1 must be a finite number >= 0"),
    (dict(l1_weight=float("nan")), "l1_weight=nan must be a finite number >= 0"),
    # An infinite rate sets gates to 0 or 1 at once; an infinite penalty makes them NaN.
    (dict(learning_rate=float("inf")), "learning_rate=inf must be a finite number >= 0"),
    (dict(l1_weight=float("inf")), "l1_weight=inf must be a finite number >= 0"),
    (dict(weight_decay=-1e-4), "weight_decay=-0.0001 must be a finite number >= 0"),
    (dict(lr_schedule="cosine"), "lr_schedule='cosine'; allowed: warmup_decay, constant"),
  ],
)
def test_bad_training_settings_raise_clearly(kwargs, message):
  with pytest.raises(ValueError, match=message):
    GateTraining(**kwargs)


def test_training_refuses_what_it_cannot_train_on():
  decoder, params = tiny_decoder()
  with pytest.raises(ValueError, match="must be longer than sinks \\+ recent = 40"):
    train_duo_gates(decoder, params, _tiny_samples(), GateTraining(sinks=8, recent=32, steps=1))
  with pytest.raises(ValueError, match="batch=5 must be <= the number of samples \\(4\\)"):
    train_duo_gates(decoder, params, _tiny_samples(), GateTraining(sinks=1, recent=4, batch=5))

  class NoHidden:
    cache_shape = decoder.cache_shape

  with pytest.raises(ValueError, match="lacks prefill_hidden_states"):
    train_duo_gates(NoHidden(), params, _tiny_samples(), GateTraining(sinks=1, recent=4))

  class CausalOnly(NoHidden):
    """Hands back hidden states, but would attend causally whatever the gates say: the gates
    would then learn the L1 penalty alone."""

    def prefill_hidden_states(self, *args):
      return decoder.prefill_hidden_states(*args)

  with pytest.raises(ValueError, match="duo gate training's caches say how the prompt attends"):
    train_duo_gates(CausalOnly(), params, _tiny_samples(), GateTraining(sinks=1, recent=4))


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(tokens=np.full((4, 40), 64, np.int32)), "outside the vocabulary|vocab"),
    (dict(lengths=np.full((4,), 41, np.int32)), "lengths"),
    (dict(supervised=np.zeros((4, 40), bool)), "row 0 has no supervised position"),
    (dict(supervised=np.ones((4, 39), bool)), "samples.supervised must be bool of the tokens"),
    (dict(lengths=np.array([40, 20, 40, 40], np.int32)), "row 1 supervises positions past"),
  ],
)
def test_training_refuses_samples_it_would_train_wrongly_on(change, message):
  """Unchecked, ids past the vocabulary gave NaN gates and rows without a supervised position
  trained the gates on the penalty alone, with no error."""
  decoder, params = tiny_decoder()
  samples = dataclasses.replace(_tiny_samples(), **change)
  with pytest.raises(ValueError, match=message):
    train_duo_gates(decoder, params, samples, GateTraining(sinks=2, recent=4, steps=1))


class CharacterTokenizer:
  """One token per character; with `bos`, `encode(..., add_special_tokens=True)` prepends it."""

  def __init__(self, bos=None):
    self.bos = bos

  def encode(self, text, add_special_tokens=False):
    ids = [ord(c) % 250 + 1 for c in text]
    return ([self.bos] if add_special_tokens and self.bos is not None else []) + ids


def test_passkey_samples_hide_the_keys_and_supervise_their_recital():
  text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu " * 40
  settings = dict(context_len=900, num_samples=3, passkeys=2, passkey_words=3, seed=4, text=text)
  samples = passkey_training_samples(CharacterTokenizer(), **settings)
  assert samples.tokens.shape == (3, 900) and list(samples.lengths) == [900] * 3
  for row, supervised in zip(samples.tokens, samples.supervised):
    decoded = "".join(chr(t - 1) for t in row)  # the characters are ASCII
    request = decoded.index("\nRecite the pass keys, in order.\n")
    recital = decoded[request + len("\nRecite the pass keys, in order.\n") :]
    assert supervised.sum() == len(recital) and supervised[-len(recital) :].all()
    keys = [line.split(": ")[1].rstrip(".") for line in recital.strip().split("\n")]
    assert len(keys) == 2 and all(len(key.split()) == 3 for key in keys)
    for number, key in enumerate(keys, 1):
      assert f"The pass key number {number} is: {key}. Remember it. " in decoded[:request]
  # Fresh keys per sample, reproducible per seed.
  assert not np.array_equal(samples.tokens[0], samples.tokens[1])
  again = passkey_training_samples(CharacterTokenizer(), **settings)
  np.testing.assert_array_equal(again.tokens, samples.tokens)


def test_passkey_samples_refuse_a_context_too_short_for_the_keys():
  with pytest.raises(ValueError, match="context_len=100 is too short for 10 pass keys of 32"):
    passkey_training_samples(CharacterTokenizer(), context_len=100, num_samples=1, text="a b c")


def test_passkey_samples_start_as_the_tokenizer_starts_any_text():
  """A Llama tokenizer's BOS opens every prompt the model sees (and is its natural sink): the
  training prompts open with it too, within context_len. A tokenizer without one adds nothing."""
  text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu " * 40
  settings = dict(context_len=900, num_samples=2, passkeys=2, passkey_words=3, seed=4, text=text)
  with_bos = passkey_training_samples(CharacterTokenizer(bos=255), **settings)
  without = passkey_training_samples(CharacterTokenizer(), **settings)
  assert with_bos.tokens.shape == without.tokens.shape == (2, 900)
  assert list(with_bos.tokens[:, 0]) == [255, 255] and 255 not in without.tokens
  np.testing.assert_array_equal(with_bos.supervised, without.supervised)
