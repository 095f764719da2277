"""The Flax decoder against Hugging Face transformers on tiny random Llama and Mistral models.

Fixtures come from scripts/make_tiny_model_fixtures.py (transformers + torch, float32, eager).
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache_protocol import allocate_model_cache
from kvjax.dense_cache import DenseLayerCache, FullCache
from kvjax.generate import generate
from kvjax.layer_runs import flatten_layer_caches
from kvjax.prompt_batch import compact_padded_batch
from kvjax.sliding_window_cache import SlidingWindowLayerCache
from models.config import DecoderConfig
from models.hf_checkpoint import read_hf_checkpoint
from models.nnx_decoder import split_decoder
from models.weights import decoder_from_tensors

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
MODELS = ("tiny_llama", "tiny_mistral")


@pytest.fixture(
  scope="module", params=[(m, loop) for m in MODELS for loop in ("unroll", "scan")], ids=str
)
def tiny(request):
  """Every parity test runs with the layers unrolled and with look-alike layers scanned."""
  name, layer_loop = request.param
  directory = FIXTURES / name
  checkpoint = read_hf_checkpoint(directory)
  config = DecoderConfig.from_hf_dict(checkpoint.config)
  model = decoder_from_tensors(config, checkpoint.tensors, layer_loop=layer_loop)
  decoder, params = split_decoder(model)
  return name, config, decoder, params, np.load(directory / "reference.npz")


def _compact_reference_logits(reference_logits, attention_mask):
  rows = []
  for logits, mask in zip(reference_logits, attention_mask.astype(bool)):
    real = logits[mask]
    rows.append(np.pad(real, ((0, logits.shape[0] - real.shape[0]), (0, 0))))
  return np.stack(rows)


def _prefill_all_logits(decoder, params, tokens, lengths, *, max_new_tokens=0):
  caches = allocate_model_cache(
    FullCache(),
    decoder.cache_shape,
    batch=tokens.shape[0],
    prompt_len=tokens.shape[1],
    max_new_tokens=max_new_tokens,
    dtype=jnp.float32,
  )
  return jax.jit(decoder.prefill_all_logits)(params, tokens, lengths, caches)


def test_config_reads_rope_scaling_and_window(tiny):
  name, config, *_ = tiny
  if name == "tiny_llama":
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    assert config.num_kv_heads == 2 and config.head_dim == 16
  else:
    assert config.sliding_window == 5 and config.num_kv_heads == 1 and config.tie_word_embeddings


def test_rope_frequencies_match_reference(tiny):
  from kvjax.rope import rope_inverse_frequencies

  _, config, *_, reference = tiny
  inv_freq = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
  np.testing.assert_allclose(inv_freq, reference["inv_freq"], rtol=1e-6)


def test_full_forward_matches_transformers_on_padded_batch(tiny):
  _, _, decoder, params, reference = tiny
  tokens, lengths = compact_padded_batch(reference["input_ids"], reference["attention_mask"])
  logits, _ = _prefill_all_logits(decoder, params, tokens, lengths)
  expected = _compact_reference_logits(reference["logits"], reference["attention_mask"])
  for row, length in enumerate(lengths):
    np.testing.assert_allclose(logits[row, :length], expected[row, :length], atol=1e-4, rtol=0)


def test_long_sequence_forward_matches_transformers(tiny):
  _, _, decoder, params, reference = tiny
  tokens = reference["long_input_ids"]
  logits, _ = _prefill_all_logits(decoder, params, tokens, np.array([tokens.shape[1]], np.int32))
  np.testing.assert_allclose(logits, reference["long_logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("prefix", [1, 3, 17])
def test_prefill_then_token_by_token_decode_matches_full_forward(tiny, prefix):
  """Prefill a prefix, then teacher-force the rest one token at a time through the cache."""
  name, config, decoder, params, reference = tiny
  tokens = reference["long_input_ids"]
  total = tokens.shape[1]
  logits, caches = _prefill_all_logits(
    decoder,
    params,
    tokens[:, :prefix],
    np.array([prefix], np.int32),
    max_new_tokens=total - prefix,
  )
  expected_cache = SlidingWindowLayerCache if name == "tiny_mistral" else DenseLayerCache
  assert all(isinstance(c, expected_cache) for c in flatten_layer_caches(caches))
  step = jax.jit(decoder.decode_step)
  got = [logits[0, prefix - 1]]
  for position in range(prefix, total - 1):
    logit, caches = step(
      params, jnp.asarray(tokens[:, position]), jnp.array([position], jnp.int32), caches
    )
    got.append(logit[0])
  np.testing.assert_allclose(
    np.stack(got), reference["long_logits"][0, prefix - 1 : total - 1], atol=1e-4, rtol=0
  )


def test_batched_decode_matches_transformers_on_padded_batch(tiny):
  """Rows of different lengths decode at their own positions: same logits as the full forward."""
  _, _, decoder, params, reference = tiny
  tokens, lengths = compact_padded_batch(reference["input_ids"], reference["attention_mask"])
  expected = _compact_reference_logits(reference["logits"], reference["attention_mask"])
  prefix = 3
  _, caches = _prefill_all_logits(
    decoder,
    params,
    tokens[:, :prefix],
    np.full((2,), prefix, np.int32),
    max_new_tokens=tokens.shape[1],
  )
  step = jax.jit(decoder.decode_step)
  for offset in range(prefix, int(lengths.max())):
    positions = np.minimum(offset, lengths - 1).astype(np.int32)
    step_tokens = tokens[np.arange(2), positions]
    # A row already past its length keeps re-feeding its last token; only real rows are checked.
    logit, caches = step(
      params, jnp.asarray(step_tokens), jnp.asarray(np.full((2,), offset, np.int32)), caches
    )
    for row in range(2):
      if offset < lengths[row]:
        np.testing.assert_allclose(logit[row], expected[row, offset], atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(tiny):
  _, _, decoder, params, reference = tiny
  result = generate(
    decoder,
    params,
    reference["input_ids"],
    attention_mask=reference["attention_mask"],
    max_new_tokens=reference["greedy_ids"].shape[1],
    cache_dtype=jnp.float32,
  )
  np.testing.assert_array_equal(result.tokens, reference["greedy_ids"])
