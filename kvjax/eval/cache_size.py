"""True cache bytes after a context, read from the shapes the method allocates (no compute)."""

import jax
import numpy as np

from kvjax.cache_protocol import model_cache_nbytes
from kvjax.generate import prefill


def cache_bytes_after_context(
  decoder, params, cache_method, *, context_len: int, cache_dtype, batch: int = 1
) -> int:
  """Bytes every array of the model's caches holds after ingesting a `context_len` prompt."""
  tokens = np.zeros((batch, context_len), np.int32)
  lengths = np.full((batch,), context_len, np.int32)
  _, caches = jax.eval_shape(
    lambda p: prefill(
      decoder,
      p,
      tokens,
      lengths,
      cache_method=cache_method,
      max_new_tokens=0,
      cache_dtype=cache_dtype,
    ),
    params,
  )
  return model_cache_nbytes(caches)


def context_elements(cache_shape, context_len: int, batch: int = 1) -> int:
  """K and V elements of a full cache holding the context (the denominator of bits/element)."""
  return (
    2
    * batch
    * cache_shape.num_layers
    * cache_shape.num_kv_heads
    * context_len
    * cache_shape.head_dim
  )
