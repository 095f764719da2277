"""What kvjax requires of a decoder, refused with the missing part named before anything runs."""

import dataclasses
import re

import pytest

from kvjax.compressed_context import compress_context, context_template
from kvjax.decoder_protocol import check_decoder, decoder_vocab_size
from kvjax.dense_cache import FullCache
from kvjax.generate import generate
from tests.kvjax.tiny_decoder import tiny_decoder


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
