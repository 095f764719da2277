"""The model protocol kvjax's generate loop and evaluation are written against.

Any decoder that threads kvjax layer caches can be used: research code with its own model
implements these two pure functions and a `cache_shape`; nothing in kvjax imports `models`.
"""

from typing import Any, Protocol

import jax

from kvjax.cache_protocol import ModelCacheShape


class CachedDecoder(Protocol):
  """Must be hashable (it is a static argument of jitted functions)."""

  @property
  def cache_shape(self) -> ModelCacheShape: ...

  def prefill(
    self,
    params: Any,
    tokens: jax.Array,  # int32 [batch, prompt], right-padded (compact rows)
    lengths: jax.Array,  # int32 [batch]
    caches: tuple,  # freshly allocated layer caches
  ) -> tuple[jax.Array, tuple]:  # logits at each row's last prompt token [batch, vocab]
    ...

  def decode_step(
    self,
    params: Any,
    tokens: jax.Array,  # int32 [batch]
    positions: jax.Array,  # int32 [batch]
    caches: tuple,
  ) -> tuple[jax.Array, tuple]:  # next-token logits [batch, vocab]
    ...
