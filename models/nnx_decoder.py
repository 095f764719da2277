"""Adapts an NNX `Decoder` to kvjax's pure `CachedDecoder` protocol.

The graphdef is static (hashable), the state is the `params` pytree.
"""

import dataclasses
from typing import ClassVar

from flax import nnx

from kvjax.cache_protocol import ModelCacheShape
from models.decoder import Decoder


@dataclasses.dataclass(frozen=True)
class NNXCachedDecoder:
  graphdef: nnx.GraphDef
  cache_shape: ModelCacheShape
  vocab_size: int
  # Each layer's prompt attention goes through kvjax's cache_prompt_attention (models/attention.py).
  honours_prompt_attention: ClassVar[bool] = True

  def prefill(self, params, tokens, lengths, caches):
    return nnx.merge(self.graphdef, params).prefill(tokens, lengths, caches)

  def prefill_all_logits(self, params, tokens, lengths, caches):
    """Like `prefill`, with logits at every prompt position [batch, prompt, vocab]."""
    return nnx.merge(self.graphdef, params).prefill(tokens, lengths, caches, all_logits=True)

  def prefill_hidden_states(self, params, tokens, lengths, caches):
    """Like `prefill`, with the final normalized hidden states [batch, prompt, hidden] (float32)
    instead of logits (`kvjax.duo_gate_training` distils them)."""
    return nnx.merge(self.graphdef, params).prefill(tokens, lengths, caches, final_hidden=True)

  def prefill_chunk(self, params, tokens, start, lengths, caches):
    """One chunk of a chunked prefill (`kvjax.chunked_prefill`)."""
    return nnx.merge(self.graphdef, params).prefill_chunk(tokens, start, lengths, caches)

  def decode_step(self, params, tokens, positions, caches):
    return nnx.merge(self.graphdef, params).decode_step(tokens, positions, caches)


def split_decoder(model: Decoder) -> tuple[NNXCachedDecoder, nnx.State]:
  """(the pure decoder for kvjax.generate, its parameters)."""
  graphdef, params = nnx.split(model)
  return NNXCachedDecoder(graphdef, model.cache_shape, model.config.vocab_size), params
