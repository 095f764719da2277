"""The contract every per-layer KV cache and every cache method implements.

A *layer cache* is an immutable pytree (arrays are leaves, configuration is static metadata);
every operation returns a new cache, so caches thread through `jax.jit`, `lax.scan` and `vmap`.
A *cache method* is a frozen configuration that allocates layer caches with static shapes.

Every array a layer cache holds has the batch on axis 0 (kvjax.compressed_context.repeat_context
relies on it; a run of stacked layers, kvjax.layer_runs, puts its layer axis before it).
Stored K/V layout is `[batch, kv_heads, tokens, head_dim]`; rows are compact: the valid tokens
of row `b` sit in slots `[0, lengths[b])` (prompts of different lengths are right-aligned to
slot 0, whatever padding the caller used). Keys are stored after RoPE at their original
positions unless a method documents otherwise.
"""

import dataclasses
import math
from typing import Protocol, runtime_checkable

import jax
import numpy as np

from kvjax.compact_rows import write_tokens_at_lengths
from kvjax.lru_table import LruTable
from kvjax.rope import RopeScaling


@dataclasses.dataclass(frozen=True)
class ModelCacheShape:
  """What a cache method needs to know about the model it serves."""

  num_layers: int
  num_kv_heads: int
  num_query_heads: int
  head_dim: int
  sliding_window: int | None = None
  # The model's RoPE, for caches that re-rotate keys (StreamingLLM's in-cache positions); None
  # where a decoder does not say.
  rope_theta: float | None = None
  rope_scaling: RopeScaling | None = None

  def __post_init__(self):
    for name in ("num_layers", "num_kv_heads", "num_query_heads", "head_dim"):
      check_count(name, getattr(self, name), 1)
    if self.sliding_window is not None:
      check_count("sliding_window", self.sliding_window, 1)  # None: no window
    if self.num_query_heads % self.num_kv_heads:
      raise ValueError(
        f"num_query_heads={self.num_query_heads} must be a multiple of "
        f"num_kv_heads={self.num_kv_heads}"
      )

  @property
  def group_size(self) -> int:
    return self.num_query_heads // self.num_kv_heads


@runtime_checkable
class LayerCache(Protocol):
  """One decoder layer's cache.

  A cache with a fixed capacity also has `room` (int32 [batch]: tokens each row can still
  take), which kvjax's loops check before appending (kvjax.cache_room); one that evicts by
  design has none once it holds its whole budget (allocated with fewer slots, it reports room).

  A cache whose eviction depends on each decode step's attention (`h2o_decode`) also has
  `append_and_attend` (same arguments and result as the function below); decoders run decode
  steps through `append_and_attend(cache, ...)`, which uses it.

  A cache that can be read by several rows at once (kvjax.compressed_context.share_context)
  also has `attend_with_lse(queries [batch, kv_heads, group, head_dim], *, sm_scale) -> (out
  f32 [batch, kv_heads, group, head_dim], lse f32 [batch, kv_heads, group])`: `attend` with
  the log-sum-exp of each query's logits, for any `group` (the rows' queries are folded into
  it), so that its attention merges with another segment's; every kvjax cache but h2o_decode's
  has it.

  A cache that can take a prompt in chunks (`kvjax.chunked_prefill`) also has
  `attend_chunk(queries [batch, kv_heads, group, chunk, head_dim], *, sm_scale) -> (out f32
  [batch, kv_heads, group, chunk, head_dim], lse f32 [batch, kv_heads, group, chunk])`: the
  chunk's queries over every token held, all of which precede the chunk; and
  `ingest_chunk(keys, values, queries, counts int32 [batch])`: the chunk's first `counts[b]`
  tokens stored after row b's held tokens (compressed as the method compresses). One whose
  support depends on its configuration has `chunked_prefill_refusal` (a reason, or None).
  """

  def ingest(
    self,
    keys: jax.Array,  # [batch, kv_heads, prompt, head_dim], rotated, compact rows
    values: jax.Array,  # [batch, kv_heads, prompt, head_dim]
    queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim], rotated
    lengths: jax.Array,  # int32 [batch]
  ) -> "LayerCache":
    """Stores a prompt (selection methods score tokens with `queries` here)."""
    ...

  def append(
    self,
    keys: jax.Array,  # [batch, kv_heads, head_dim]
    values: jax.Array,  # [batch, kv_heads, head_dim]
  ) -> "LayerCache":
    """Stores one decode step's K/V after each row's last token."""
    ...

  def attend(
    self,
    queries: jax.Array,  # [batch, kv_heads, group, head_dim]
    *,
    sm_scale: float,
  ) -> jax.Array:  # [batch, kv_heads, group, head_dim] float32
    """Attention of one query position per row over everything the cache holds."""
    ...

  @property
  def nbytes(self) -> int:
    """Bytes of every array the cache really stores (codes, scales, indices, padding)."""
    ...

  @property
  def stored_elements(self) -> int:
    """K and V elements the cache represents at capacity (for effective bits per element)."""
    ...


def append_and_attend(
  cache: LayerCache,
  keys: jax.Array,  # [batch, kv_heads, head_dim]
  values: jax.Array,  # [batch, kv_heads, head_dim]
  queries: jax.Array,  # [batch, kv_heads, group, head_dim]
  *,
  sm_scale: float,
) -> tuple[jax.Array, LayerCache]:  # ([batch, kv_heads, group, head_dim] float32, cache)
  """One decode step of one layer: the new token stored, then its query's attention over
  everything the cache holds. A cache that scores tokens by the attention they receive while
  decoding does both in its own `append_and_attend`; every other cache appends, then attends."""
  own = getattr(cache, "append_and_attend", None)
  if own is not None:
    return own(keys, values, queries, sm_scale=sm_scale)
  cache = cache.append(keys, values)
  return cache.attend(queries, sm_scale=sm_scale), cache


class CacheMethod(Protocol):
  """A frozen configuration that allocates one layer cache per decoder layer."""

  def allocate(
    self,
    shape: ModelCacheShape,
    layer: int,
    *,
    batch: int,
    prompt_len: int,
    max_new_tokens: int,
    dtype,
  ) -> LayerCache: ...


# Floating dtypes a cache may store its keys and values (and quantization statistics) in.
CACHE_DTYPES = ("bfloat16", "float16", "float32")


def check_cache_dtype(cache_dtype) -> None:
  """ValueError unless `cache_dtype` names one of CACHE_DTYPES (an integer dtype would store
  every key and value truncated, and generation would go on from garbage)."""
  check_float_dtype(cache_dtype, name="cache_dtype")


def check_float_dtype(dtype, *, name: str) -> None:
  """ValueError naming argument `name` unless `dtype` is bfloat16, float16 or float32 (the
  dtypes of caches and of model weights)."""
  try:
    dtype_name = np.dtype(dtype).name
  except TypeError:
    dtype_name = None
  if dtype_name not in CACHE_DTYPES:
    raise ValueError(f"{name}={dtype!r} is not supported; allowed: {', '.join(CACHE_DTYPES)}")


def check_cache_method(cache_method) -> None:
  """ValueError unless `cache_method` is a method object (it has `allocate`); a method class
  (`kvjax.FullCache` for `kvjax.FullCache()`) is not one."""
  if isinstance(cache_method, type) or not callable(getattr(cache_method, "allocate", None)):
    raise ValueError(
      f"cache_method={cache_method!r} must be a cache method object such as "
      "kvjax.parse_method_spec('kivi:bits=4') (a spec string goes through parse_method_spec)"
    )


def check_count(name: str, value, minimum: int) -> None:
  """ValueError unless `value` is an int (not a bool) >= `minimum`."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def check_prompt_width(method: str, prompt_width: int, allocated_prompt_len: int | None) -> None:
  """ValueError when a prompt is wider than the `prompt_len` a cache was allocated for, in caches
  whose budget or slots were sized from it (a selection's kept tokens, an evicting cache's
  slots): they would keep fewer tokens than asked, with nothing to say so. None: unchecked (a
  cache built directly rather than by its method's `allocate`)."""
  if allocated_prompt_len is not None and prompt_width > allocated_prompt_len:
    raise ValueError(
      f"{method}: a prompt of {prompt_width} tokens, but the cache was allocated for "
      f"prompt_len={allocated_prompt_len} (its budget and slots were sized for that); allocate "
      f"with prompt_len >= {prompt_width}"
    )


def allocate_model_cache(
  method: CacheMethod,
  shape: ModelCacheShape,
  *,
  batch: int,
  prompt_len: int,
  max_new_tokens: int,
  dtype,
) -> tuple[LayerCache, ...]:
  """One layer cache per decoder layer (layers may differ in static shape)."""
  check_cache_method(method)
  check_count("batch", batch, 1)
  check_count("prompt_len", prompt_len, 1)
  check_count("max_new_tokens", max_new_tokens, 0)
  check_cache_dtype(dtype)
  return tuple(
    method.allocate(
      shape,
      layer,
      batch=batch,
      prompt_len=prompt_len,
      max_new_tokens=max_new_tokens,
      dtype=dtype,
    )
    for layer in range(shape.num_layers)
  )


def model_cache_shapes(method: CacheMethod, shape: ModelCacheShape, **allocation) -> tuple:
  """`allocate_model_cache(method, shape, **allocation)`'s caches as `jax.ShapeDtypeStruct`
  leaves (batch, prompt_len, max_new_tokens, dtype): nothing allocated. Memoised: shaping a
  codec's caches traces its encoder for every layer (about a second for GEAR on 30 layers)."""
  key = (method, shape, tuple(sorted(allocation.items(), key=lambda item: item[0])))
  shaped = lambda: jax.eval_shape(lambda: allocate_model_cache(method, shape, **allocation))
  try:
    hash(key)
  except TypeError:  # an unhashable argument (a dtype object some caller built): not memoised
    return shaped()
  return _SHAPED_CACHES.get_or_compute(key, shaped)


_SHAPED_CACHES = LruTable(max_entries=64)


class KeyValueArrays:
  """Size accounting of a cache whose storage is full-precision `keys` and `values` arrays
  (plus small bookkeeping leaves such as lengths, counted in `nbytes` too)."""

  @property
  def nbytes(self) -> int:
    return tree_nbytes(self)

  @property
  def stored_elements(self) -> int:
    return self.keys.size + self.values.size

  def with_chunk_written(self, keys, values, slots, counts):
    """This cache with a prompt chunk's tokens written at `slots` (int32 [batch, chunk]; a slot
    past the storage drops its token) and `counts[b]` more tokens seen per row."""
    return dataclasses.replace(
      self,
      keys=write_tokens_at_lengths(self.keys, keys, slots),
      values=write_tokens_at_lengths(self.values, values, slots),
      lengths=self.lengths + counts,
    )


def tree_nbytes(tree) -> int:
  """Bytes of all array leaves of a pytree (concrete arrays or `jax.eval_shape` structs)."""
  return sum(
    math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    for leaf in jax.tree_util.tree_leaves(tree)
  )


def model_cache_nbytes(caches) -> int:
  return sum(cache.nbytes for cache in caches)
