"""True cache bytes, read from the shapes the method allocates (no compute).

Caches have static shapes: ingesting a prompt fills the arrays allocated for it and never
reshapes them, so the allocation's shapes are the bytes after the context; allocated with
room for `new_tokens` more, they are the bytes held while those tokens are appended (a cache
that evicts while decoding, `streaming` or `h2o_decode`, stays at its budget).
"""

from kvjax.cache_protocol import model_cache_nbytes, model_cache_shapes


def cache_bytes_after_context(
  decoder,
  params,
  cache_method,
  *,
  context_len: int,
  cache_dtype,
  batch: int = 1,
  new_tokens: int = 0,
) -> int:
  """Bytes every array of the model's caches holds after ingesting a `context_len` prompt, in
  caches allocated to take `new_tokens` more (the bytes after them too)."""
  del params  # the bytes depend on shapes only
  caches = model_cache_shapes(
    cache_method,
    decoder.cache_shape,
    batch=batch,
    prompt_len=context_len,
    max_new_tokens=new_tokens,
    dtype=cache_dtype,
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


def cache_byte_columns(
  decoder,
  cache_method,
  *,
  context_len: int,
  cache_dtype,
  full_bytes: int,
  new_tokens: int | None = None,
) -> dict:
  """A method's byte columns in `kvjax compare`'s records: bytes after the context (allocated
  for it alone), after `new_tokens` more (None: not reported), the full cache's bytes, how many
  times fewer, and bits per context K/V element."""
  held = cache_bytes_after_context(
    decoder, None, cache_method, context_len=context_len, cache_dtype=cache_dtype
  )
  at_end = (
    None
    if new_tokens is None
    else cache_bytes_after_context(
      decoder,
      None,
      cache_method,
      context_len=context_len,
      cache_dtype=cache_dtype,
      new_tokens=new_tokens,
    )
  )
  return dict(
    cache_bytes=held,
    cache_bytes_at_end=at_end,
    full_cache_bytes=full_bytes,
    compression_ratio=full_bytes / held,
    bits_per_element=8 * held / context_elements(decoder.cache_shape, context_len),
  )
