"""What kvjax requires of a decoder, refused with the missing part named before anything runs."""

import dataclasses
import pathlib
import re

import pytest

from kvjax.compressed_context import compress_context, context_template
from kvjax.decoder_protocol import check_decoder, decoder_vocab_size
from kvjax.dense_cache import FullCache
from kvjax.generate import generate, prefill
from tests.kvjax.tiny_decoder import tiny_decoder

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "own_model_protocol.py"


def _delegating(decoder, **overrides):
  """A decoder class calling `decoder`'s functions, with `overrides` replacing attributes."""
  attributes = {
    "cache_shape": decoder.cache_shape,
    "prefill": lambda self, *args: decoder.prefill(*args),
    "decode_step": lambda self, *args: decoder.decode_step(*args),
  } | overrides
  return type("UserDecoder", (), {k: v for k, v in attributes.items() if v is not None})()


def test_the_bundled_decoder_passes():
  decoder, _ = tiny_decoder()
  check_decoder(decoder)
  assert decoder_vocab_size(decoder) == decoder.vocab_size


@pytest.mark.parametrize(
  ("missing", "named"),
  [
    ("cache_shape", "lacks cache_shape (a kvjax.ModelCacheShape)"),
    ("decode_step", "lacks decode_step"),
    ("prefill", "lacks prefill"),
  ],
)
def test_a_decoder_missing_a_part_is_refused_by_every_entry_point(missing, named):
  decoder, params = tiny_decoder()
  user = _delegating(decoder, **{missing: None})
  with pytest.raises(ValueError, match=re.escape(f"decoder: UserDecoder {named}")):
    generate(user, params, [[1, 2]], max_new_tokens=2)
  with pytest.raises(ValueError, match=re.escape(named)):
    compress_context(user, params, [[1, 2]], cache_method=FullCache(), room=2)
  with pytest.raises(ValueError, match=re.escape(named)):
    context_template(user, params, batch=1, prompt_len=2, cache_method=FullCache(), room=2)


def test_an_unhashable_decoder_is_refused_with_the_way_out():
  decoder, params = tiny_decoder()

  @dataclasses.dataclass  # not frozen: dataclasses then set __hash__ to None
  class MutableDecoder:
    inner: object

    @property
    def cache_shape(self):
      return self.inner.cache_shape

    def prefill(self, *args):
      return self.inner.prefill(*args)

    def decode_step(self, *args):
      return self.inner.decode_step(*args)

  with pytest.raises(ValueError, match="MutableDecoder must be hashable.*frozen dataclass"):
    generate(MutableDecoder(decoder), params, [[1, 2]], max_new_tokens=2)


def _duo_streaming_everywhere(shape):
  """DuoAttention with every head streaming over 1 sink + 2 recent tokens."""
  from kvjax.duo_attention import DuoAttention
  from kvjax.duo_gate_profile import DuoGateProfile

  gates = DuoGateProfile.from_gates(shape, [[0.5] * shape.num_kv_heads] * shape.num_layers)
  return DuoAttention(profile=gates, full_fraction=0.0, sinks=1, recent=2)


def test_caches_saying_how_the_prompt_attends_need_a_decoder_that_asks_them():
  """DuoAttention's streaming heads attend over their sinks and recent tokens in the prompt too;
  a decoder that attends causally regardless would serve them what they were not trained for.
  Refused before tracing unless the decoder says it asks (honours_prompt_attention), or the
  prompt comes in chunks (each chunk attends through the caches' attend_chunk)."""
  import runpy

  import jax.numpy as jnp
  import numpy as np

  from kvjax.method_spec import parse_method_spec

  example = runpy.run_path(str(EXAMPLE))
  toy, params = example["ToyDecoder"](), example["toy_params"]()
  method = _duo_streaming_everywhere(toy.cache_shape)
  prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 3]
  run = lambda decoder, cache_method, **kw: generate(
    decoder, params, prompts, max_new_tokens=1, cache_method=cache_method, **kw
  )
  # The same model, without honours_prompt_attention.
  causal_only = _delegating(toy, prefill_chunk=lambda self, *args: toy.prefill_chunk(*args))
  with pytest.raises(ValueError, match="does not say it asks them \\(honours_prompt_attention"):
    run(causal_only, method)
  with pytest.raises(ValueError, match="honours_prompt_attention"):
    compress_context(causal_only, params, prompts, cache_method=method, room=1)
  run(causal_only, method, prefill_chunk=8)  # chunks: allowed
  run(causal_only, FullCache())  # a cache without prompt_attention: allowed
  # The example's decoder asks: its prompt attends as the streaming heads keep it.
  tokens, lengths = jnp.asarray(prompts, jnp.int32), jnp.array([24], jnp.int32)
  logits = lambda cache_method: np.asarray(
    prefill(
      toy,
      params,
      tokens,
      lengths,
      cache_method=cache_method,
      max_new_tokens=1,
      cache_dtype=jnp.float32,
    )[0]
  )
  assert np.abs(logits(method) - logits(parse_method_spec("full"))).max() > 1e-3
