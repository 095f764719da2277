"""Feeding known tokens through a (compressed) cache one decode step at a time.

This is how evaluation scores a continuation *through the compressed cache*: the log-probs of
every forced token. (`kvjax.decode` feeds tokens too, per row and without log-probs, before it
generates: that is how `continue_context` appends a question to a compressed context.)
"""

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache_room import check_room
from kvjax.decoder_protocol import (
  CachedDecoder,
  check_decoder,
  check_decoder_params,
  check_next_token_logits,
)
from kvjax.prompt_batch import as_array, check_positions, check_token_array


def teacher_force(
  decoder: CachedDecoder,
  params: Any,
  first_logits: jax.Array,
  caches: tuple,
  lengths: jax.Array,
  forced: jax.Array,
) -> tuple[jax.Array, jax.Array, tuple]:
  """The jitted loop (`_teacher_force_in_jit`, same arguments and results), after checking on
  the host the forced tokens (integer [batch, steps], ids in the vocabulary of `first_logits`
  [batch, vocab]), `lengths` (integer [batch]), and that the caches have room for every forced token
  (kvjax.cache_room; concrete caches only: inside a caller's jit they cannot be read, so call
  `check_room` before it). `teacher_force.lower` lowers the loop ahead of time, without the
  checks."""
  check_decoder(decoder)
  check_decoder_params(decoder, params)
  batch, vocab_size = check_next_token_logits(first_logits, decoder, name="first_logits")
  shape = np.shape(forced)
  if len(shape) != 2 or shape[0] != batch:
    raise ValueError(f"forced must be [batch={batch}, steps] (rows of first_logits); got {shape}")
  check_positions(lengths, batch=batch, name="lengths")
  check_token_array(forced, vocab_size=vocab_size, name="forced")
  check_room(caches, shape[1], caller="teacher_force")
  lengths, forced = as_array(lengths, name="lengths"), as_array(forced, name="forced")
  return _teacher_force_in_jit(decoder, params, first_logits, caches, lengths, forced)


@partial(jax.jit, static_argnames=("decoder",))
def _teacher_force_in_jit(
  decoder: CachedDecoder,
  params: Any,
  first_logits: jax.Array,  # [batch, vocab]: prediction for forced[:, 0]
  caches: tuple,
  lengths: jax.Array,  # int32 [batch]: position of forced[:, 0]
  forced: jax.Array,  # int32 [batch, steps]
) -> tuple[jax.Array, jax.Array, tuple]:
  """Returns (log-probs [batch, steps, vocab] of each forced token's prediction,
  logits [batch, vocab] predicting the token after the last forced one, caches)."""

  def step(carry, token):
    logits, caches, position = carry
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logits, caches = decoder.decode_step(params, token, position, caches)
    return (logits, caches, position + 1), logprobs

  (logits, caches, _), logprobs = jax.lax.scan(step, (first_logits, caches, lengths), forced.T)
  return jnp.moveaxis(logprobs, 0, 1), logits, caches


teacher_force.lower = _teacher_force_in_jit.lower
