"""Adapts an NNX `Decoder` to kvjax's pure `CachedDecoder` protocol.

The graphdef is static (hashable), the state is the `params` pytree.
"""

import dataclasses
from typing import ClassVar

import jax
from flax import nnx

from kvjax.cache_protocol import ModelCacheShape
from models.decoder import Decoder


@dataclasses.dataclass(frozen=True)
class NNXCachedDecoder:
  graphdef: nnx.GraphDef
  cache_shape: ModelCacheShape
  vocab_size: int
  # The shapes of the parameter arrays `split_decoder` split off, in flattening order (None: not
  # recorded, nothing checked): `check_params` refuses others before kvjax traces anything.
  param_shapes: tuple[tuple[int, ...], ...] | None = None
  # Each layer's prompt attention goes through kvjax's cache_prompt_attention (models/attention.py).
  honours_prompt_attention: ClassVar[bool] = True

  def check_params(self, params) -> None:
    """ValueError unless `params` holds arrays of this decoder's parameter shapes (another
    model's, or None, failed inside the trace: Flax's leaf count or XLA's dot shapes). Dtypes
    are not checked: parameters cast to another float type run."""
    if self.param_shapes is None:
      return
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    if len(leaves) != len(self.param_shapes):
      raise ValueError(
        f"params holds {len(leaves)} arrays ({type(params).__qualname__}); this decoder's "
        f"parameters are {len(self.param_shapes)} arrays (the nnx.State split_decoder returned "
        "with it)"
      )
    for (path, leaf), wanted in zip(leaves, self.param_shapes):
      shape = tuple(getattr(leaf, "shape", ()))
      if shape != wanted:
        raise ValueError(
          f"params{jax.tree_util.keystr(path)} has shape {shape}; this decoder's has {wanted} "
          "(params of another model or configuration)"
        )

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
  shapes = tuple(tuple(leaf.shape) for leaf in jax.tree.leaves(params))
  return NNXCachedDecoder(graphdef, model.cache_shape, model.config.vocab_size, shapes), params
