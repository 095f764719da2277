"""The model protocol kvjax's generate loop and evaluation are written against.

Any decoder that threads kvjax layer caches can be used: research code with its own model
implements these two pure functions and a `cache_shape`; nothing in kvjax imports `models`.

`prefill` may hand back the caches in another arrangement than it got them, for instance
look-alike layers' caches stacked (`kvjax.layer_runs.StackedLayerCaches`, which
`kvjax.layer_runs.run_layers` returns to save restacking on every decode step), as long as
`decode_step` takes that arrangement and returns it unchanged in structure, and every item of
the tuple reports `nbytes`.
"""

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from kvjax.cache_protocol import ModelCacheShape


class CachedDecoder(Protocol):
  """Must be hashable (it is a static argument of jitted functions). A decoder may also have
  `vocab_size` (int): kvjax then refuses prompt ids past it before anything runs
  (`decoder_vocab_size`); without it, only negative ids are refused up front. It may have
  `check_params(params)`: kvjax's entry points call it before tracing (`check_decoder_params`;
  the bundled NNX decoder compares the params' shapes with its own).

  A layer cache may say how its layer's prompt attends (`prompt_attention`: DuoAttention's
  streaming heads see only their sinks and recent tokens in the prompt too). A decoder whose
  `prefill` computes every layer's prompt attention with
  `kvjax.prefill_attention.cache_prompt_attention(cache, ...)` sets `honours_prompt_attention =
  True`; caches that need it are refused, before tracing, for a one-piece prefill by a decoder
  that does not (its prompt would attend causally where the method says otherwise).
  """

  @property
  def cache_shape(self) -> ModelCacheShape: ...

  def prefill(
    self,
    params: Any,
    tokens: jax.Array,  # int32 [batch, prompt], right-padded (compact rows)
    lengths: jax.Array,  # int32 [batch]
    caches: tuple,  # freshly allocated layer caches, one per layer
  ) -> tuple[jax.Array, tuple]:  # logits at each row's last prompt token [batch, vocab]
    ...

  # Optional, for chunked prefill (`kvjax.chunked_prefill`): the chunk of prompt positions
  # [start, start + chunk) through the caches holding the positions before it. `start` is one
  # position for every row, or each row's own (int32 [batch]: feeding tokens in chunks after
  # a context whose rows have different lengths, `continue_context(feed_chunk=...)`).
  # def prefill_chunk(self, params, tokens: int32 [batch, chunk], start: int32 [] or [batch],
  #                   lengths: int32 [batch], caches) -> (logits [batch, vocab] at each row's
  #                   last prompt token when it lies in the chunk, caches)

  def decode_step(
    self,
    params: Any,
    tokens: jax.Array,  # int32 [batch]
    positions: jax.Array,  # int32 [batch]
    caches: tuple,  # as `prefill` or the previous step returned them
  ) -> tuple[jax.Array, tuple]:  # next-token logits [batch, vocab]
    ...


def check_decoder(decoder) -> None:
  """ValueError unless `decoder` has what kvjax calls (`cache_shape`, `prefill`, `decode_step`)
  and can be hashed (it is a static argument of jitted functions)."""
  kind = type(decoder).__qualname__
  missing = [
    name for name in ("prefill", "decode_step") if not callable(getattr(decoder, name, None))
  ]
  if not isinstance(getattr(decoder, "cache_shape", None), ModelCacheShape):
    missing.insert(0, "cache_shape (a kvjax.ModelCacheShape)")
  if missing:
    raise ValueError(
      f"decoder: {kind} lacks {', '.join(missing)}; a decoder implements kvjax.CachedDecoder "
      "(cache_shape, prefill, decode_step; see examples/own_model_protocol.py)"
    )
  try:
    hash(decoder)
  except TypeError as error:
    raise ValueError(
      f"decoder: {kind} must be hashable, as jitted functions take it as a static argument "
      f"({error}); e.g. a frozen dataclass holding only hashable fields (for a Flax NNX module, "
      "its nnx.GraphDef, with its nnx.State passed as params: models/nnx_decoder.py)"
    ) from None


def decoder_vocab_size(decoder) -> int | None:
  """The decoder's `vocab_size` when it has one."""
  size = getattr(decoder, "vocab_size", None)
  return int(size) if size is not None else None


def check_decoder_params(decoder, params) -> None:
  """The decoder's own check of `params` (its `check_params`, where it has one), before tracing:
  kvjax passes params through unread, and a decoder given another model's (or None) fails deep
  inside the trace with an error that names no argument."""
  check = getattr(decoder, "check_params", None)
  if callable(check):
    check(params)


def check_next_token_logits(logits, decoder, *, name: str) -> tuple[int, int]:
  """(batch, vocab) of `logits`, which must be a float array [batch, vocab] as the decoder's
  prefill returns (as wide as the decoder's vocabulary where it has a `vocab_size`: a wider one
  would let ids past the vocabulary be sampled or fed, which the embedding reads as garbage)."""
  shape, dtype = getattr(logits, "shape", None), getattr(logits, "dtype", None)
  if shape is None or dtype is None or len(shape) != 2 or not jnp.issubdtype(dtype, jnp.floating):
    got = (
      f"dtype {dtype} and shape {tuple(shape)}"
      if shape is not None
      else f"a {type(logits).__qualname__}"
    )
    raise ValueError(
      f"{name} must be a float array [batch, vocab] (next-token logits, as prefill returns "
      f"them); got {got}"
    )
  vocab_size = decoder_vocab_size(decoder)
  if vocab_size is not None and shape[1] != vocab_size:
    raise ValueError(
      f"{name} has {shape[1]} columns, but the decoder's vocabulary has {vocab_size} tokens: "
      f"{name} must be [batch, {vocab_size}], as its prefill returns them"
    )
  return int(shape[0]), int(shape[1])


def check_prompt_attention(decoder, caches, *, method_name: str) -> None:
  """ValueError when a layer cache defines its prompt's attention (`prompt_attention`) and the
  decoder does not say that its prefill asks the caches for it (`honours_prompt_attention`)."""
  if getattr(decoder, "honours_prompt_attention", False):
    return
  if any(callable(getattr(cache, "prompt_attention", None)) for cache in caches):
    raise ValueError(
      f"cache_method: {method_name or 'this method'}'s caches say how the prompt attends "
      f"(prompt_attention), and decoder {type(decoder).__qualname__} does not say it asks them "
      "(honours_prompt_attention = True): compute each layer's prompt attention with "
      "kvjax.prefill_attention.cache_prompt_attention(cache, ...) and set it, or prefill in "
      "chunks (prefill_chunk=), where attend_chunk serves"
    )
