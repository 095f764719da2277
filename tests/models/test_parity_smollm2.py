"""SmolLM2-135M-Instruct from the embedded GGUF against transformers loading the same file.

Fixture: scripts/make_smollm2_fixtures.py (transformers + torch, float32, eager attention).
"""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.generate import generate
from kvjax.prompt_batch import pack_prompts

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "smollm2_reference.npz"


@pytest.fixture(scope="module")
def smollm2():
  from models.loading import load_model

  return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def reference():
  return np.load(FIXTURE)


def test_config_from_gguf_metadata(smollm2):
  c = smollm2.config
  assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == (
    30,
    9,
    3,
    64,
    576,
  )
  assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (49152, 100000.0, True)


def test_last_position_logits_match_transformers_on_three_prompts(smollm2, reference):
  import jax

  from kvjax.cache_protocol import allocate_model_cache
  from kvjax.dense_cache import FullCache

  prompts = [reference[f"prompt_ids_{i}"].tolist() for i in range(3)]
  tokens, lengths = pack_prompts(prompts)
  caches = allocate_model_cache(
    FullCache(),
    smollm2.decoder.cache_shape,
    batch=3,
    prompt_len=tokens.shape[1],
    max_new_tokens=0,
    dtype=jnp.float32,
  )
  logits, _ = jax.jit(smollm2.decoder.prefill)(smollm2.params, tokens, lengths, caches)
  np.testing.assert_allclose(np.asarray(logits), reference["last_logits"], atol=1e-3, rtol=0)


def test_32_greedy_tokens_identical_to_transformers(smollm2, reference):
  result = generate(
    smollm2.decoder,
    smollm2.params,
    [reference["prompt_ids_0"].tolist()],
    max_new_tokens=32,
    cache_dtype=jnp.float32,
  )
  np.testing.assert_array_equal(result.tokens[0], reference["greedy_ids"])
