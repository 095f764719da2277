"""A compressed context: a prompt's caches after prefill, kept to be continued many times.

A long document is prefilled and compressed once; each question about it is then appended
through the compressed caches and answered, in the one loop of `kvjax.decode`. JAX arrays are
immutable, so the same context serves any number of questions, and `kvjax.context_checkpoint`
saves it to disk for another process.

    context = compress_context(decoder, params, [document], cache_method=method, room=256)
    answer, num_generated = continue_context(
      decoder, params, context, [question], max_new_tokens=64, stop_token_ids=stop_ids
    )
    # several questions at once: one row per question, the context's caches held once
    shared = share_context(decoder, context, len(questions), room=256)
    answers, _ = continue_context(decoder, params, shared, questions, max_new_tokens=64)

A question fed after the context was compressed is the query-agnostic setting: a selection
method (SnapKV, PyramidKV, H2O) chose its tokens without seeing the question.
"""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvjax.attention_dispatch import choose_kernel_family
from kvjax.cache_protocol import CacheMethod, check_cache_dtype, check_count, model_cache_nbytes
from kvjax.cache_room import check_room
from kvjax.chunked_prefill import (
  check_chunked_prefill_inputs,
  chunked_prefill_refusal,
  prefill_in_chunks,
)
from kvjax.decoder_protocol import (
  CachedDecoder,
  check_decoder,
  check_decoder_params,
  decoder_vocab_size,
)
from kvjax.dense_cache import FullCache
from kvjax.generate import (
  _DECODE_STATIC,
  _decode_loop,
  _prefill_in_jit,
  check_decode_arguments,
  check_emitted_token_ids,
  check_prefill_arguments,
)
from kvjax.kernel_settings import DEFAULT_KERNEL_SETTINGS, KernelSettings, check_kernel_settings
from kvjax.layer_runs import StackedLayerCaches, layer_cache_kinds
from kvjax.prompt_batch import (
  check_ids_fit_int32,
  check_padded_token_ids,
  check_token_lists,
  pack_prompts,
  pack_token_lists,
)
from kvjax.row_sharding import (
  check_row_sharding,
  row_device_count,
  row_shardings,
  rows_split_at,
)
from kvjax.sampling import SamplingConfig
from kvjax.selection.budgets import warn_if_ragged_budgets
from kvjax.shared_context_cache import SharedContextLayerCache, shared_context_refusal


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CompressedContext:
  """What the next decode step needs after a prompt: the caches, each row's position and the
  prediction of its next token."""

  caches: tuple  # as the decoder's prefill returned them (layer caches or stacked runs)
  lengths: jax.Array  # int32 [batch]: tokens each row has seen = position of its next token
  next_logits: jax.Array  # [batch, vocab]: logits predicting each row's next token

  @property
  def cache_bytes(self) -> int:
    """Bytes of every array the caches hold (codes, scales, indices, windows, lengths)."""
    return model_cache_nbytes(self.caches)


def _check_context_fits_decoder(decoder, context: CompressedContext, caller: str) -> None:
  """The context's layers and vocabulary are the decoder's (its heads are checked where the
  caches first attend, by shape)."""
  layers = sum(
    item.num_layers if isinstance(item, StackedLayerCaches) else 1 for item in context.caches
  )
  if layers != decoder.cache_shape.num_layers:
    raise ValueError(
      f"{caller}: the context holds caches for {layers} layers, the decoder has "
      f"{decoder.cache_shape.num_layers}: continue a context with the model that compressed it"
    )
  vocab_size, context_vocab = decoder_vocab_size(decoder), context.next_logits.shape[-1]
  if vocab_size is not None and vocab_size != context_vocab:
    raise ValueError(
      f"{caller}: the context predicts over {context_vocab} tokens, the decoder's vocabulary "
      f"has {vocab_size}: continue a context with the model that compressed it"
    )


def _check_room_argument(room: int) -> None:
  if not isinstance(room, (int, np.integer)) or isinstance(room, bool) or room < 0:
    raise ValueError(
      f"room={room!r} must be an int >= 0: tokens each row can append after the context "
      "(questions and answers)"
    )


def _prefill_context(
  decoder, params, tokens, lengths, *, cache_method, room, cache_dtype, prefill_chunk=None
) -> CompressedContext:
  logits, caches = _prefill_in_jit(  # its callers checked the arguments (or only trace shapes)
    decoder,
    params,
    tokens,
    lengths,
    cache_method=cache_method,
    max_new_tokens=room,
    cache_dtype=cache_dtype,
    prefill_chunk=prefill_chunk,
  )
  return CompressedContext(caches=caches, lengths=jnp.asarray(lengths), next_logits=logits)


def compress_context(
  decoder: CachedDecoder,
  params: Any,
  prompts: Sequence[Sequence[int]],
  *,
  cache_method: CacheMethod,
  room: int,
  cache_dtype=jnp.bfloat16,
  pad_token_id: int = 0,
  row_sharding: NamedSharding | None = None,
  prefill_chunk: int | None = None,
) -> CompressedContext:
  """Prefills `prompts` (token lists, any lengths) into caches of `cache_method` with `room`
  tokens of space left per row. A method that evicts by design (StreamingLLM, h2o_decode) has
  no limit once its caches hold their whole budget (prompt + room >= budget); with fewer slots
  it is limited to `room` like the others, rather than evict down to less than its budget.

  `prefill_chunk` feeds the prompts that many tokens at a time, compressing as they arrive
  (`kvjax.chunked_prefill`); the context has the same structure and shapes either way, so
  `context_template` serves both.

  `row_sharding` (e.g. `NamedSharding(mesh, PartitionSpec("data"))`) spreads the rows over
  devices: the prompts are placed that way, and every array of the context keeps its rows split
  over the same devices (its batch axis, wherever it lies; arrays without one are replicated).
  """
  _check_room_argument(room)
  tokens, lengths = pack_prompts(prompts, pad_token_id=pad_token_id)
  warn_if_ragged_budgets(cache_method, lengths, caller="compress_context")
  check_padded_token_ids(
    tokens, pad_token_id=pad_token_id, vocab_size=decoder_vocab_size(decoder), name="prompts"
  )
  settings = dict(cache_method=cache_method, room=int(room), cache_dtype=cache_dtype)
  check_decoder_params(decoder, params)
  check_prefill_arguments(
    decoder,
    batch=tokens.shape[0],
    prompt_len=tokens.shape[1],
    cache_method=cache_method,
    max_new_tokens=int(room),
    cache_dtype=cache_dtype,
    prefill_chunk=prefill_chunk,
  )
  if row_sharding is None:
    context = _prefill_context(
      decoder, params, tokens, lengths, prefill_chunk=prefill_chunk, **settings
    )
    # Committed where they are, as a restored context's arrays are: jit keys its compiled
    # programs on commitment too, so the two would otherwise compile continue_context apart.
    return jax.device_put(context, jax.tree.map(lambda leaf: leaf.sharding, context))
  batch, prompt_len = tokens.shape
  check_row_sharding(row_sharding, batch)
  tokens, lengths = jax.device_put((tokens, lengths), row_sharding)
  context = _prefill_context(
    decoder, params, tokens, lengths, prefill_chunk=prefill_chunk, **settings
  )
  one_more_row = _context_shapes(decoder, params, batch + 1, prompt_len=prompt_len, **settings)
  return jax.device_put(context, row_shardings(context, one_more_row, row_sharding))


def _context_shapes(
  decoder, params, batch, *, prompt_len, cache_method, room, cache_dtype
) -> CompressedContext:
  return jax.eval_shape(
    functools.partial(
      _prefill_context,
      decoder,
      params,
      cache_method=cache_method,
      room=room,
      cache_dtype=cache_dtype,
    ),
    jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
    jax.ShapeDtypeStruct((batch,), jnp.int32),
  )


def context_template(
  decoder: CachedDecoder,
  params: Any,
  *,
  batch: int,
  prompt_len: int,
  cache_method: CacheMethod,
  room: int,
  cache_dtype=jnp.bfloat16,
  row_sharding: NamedSharding | None = None,
) -> CompressedContext:
  """The structure, shapes and dtypes (`jax.ShapeDtypeStruct` leaves, nothing computed) of the
  context `compress_context` makes from `batch` prompts whose longest has `prompt_len` tokens:
  what `kvjax.context_checkpoint.restore_context` restores into. With `row_sharding`, the leaves
  carry the shardings `compress_context` gives with it, so a context is restored spread over
  the devices."""
  check_decoder(decoder)
  check_decoder_params(decoder, params)
  _check_room_argument(room)
  check_count("batch", batch, 1)
  check_count("prompt_len", prompt_len, 1)
  shapes = functools.partial(
    _context_shapes,
    decoder,
    params,
    prompt_len=int(prompt_len),
    cache_method=cache_method,
    room=int(room),
    cache_dtype=cache_dtype,
  )
  if row_sharding is None:
    return shapes(int(batch))
  check_row_sharding(row_sharding, int(batch))
  template = shapes(int(batch))
  return jax.tree.map(
    lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
    template,
    row_shardings(template, shapes(int(batch) + 1), row_sharding),
  )


def continue_context(
  decoder: CachedDecoder,
  params: Any,
  context: CompressedContext,
  tokens: Sequence[Sequence[int]] | np.ndarray,
  *,
  max_new_tokens: int,
  sampling: SamplingConfig = SamplingConfig(),
  key: jax.Array | None = None,
  stop_token_ids: Sequence[int] = (),
  pad_token_id: int = 0,
  feed_chunk: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Feeds `tokens` (one token list per row, e.g. a question; lists may differ in length or be
  empty; or an int array [batch, n]) through the context's caches, then generates up to
  `max_new_tokens` per row: (tokens int32 [batch, max_new_tokens], pad after a row's stop token;
  num_generated int32 [batch]).

  Feeding and generating run in one loop on device: a row fed a shorter list starts generating
  sooner. `context` is not changed, so it can be continued again. The caches need room for the
  longest list plus `max_new_tokens - 1` (checked before anything runs).

  `feed_chunk` (a shared context only, `share_context`): the lists are fed that many tokens at
  a time, each chunk in one step of the decoder's `prefill_chunk` (every row's tokens at once,
  attending over its context row, its tokens before the chunk and causally within it), instead
  of one decode step per token; then the rows generate. The same attention, so the same
  greedy tokens up to rounding; sampling draws other keys.
  """
  if not isinstance(context, CompressedContext):
    raise ValueError(f"context must be a CompressedContext, got {type(context).__qualname__}")
  _check_context_fits_decoder(decoder, context, "continue_context")
  check_decoder_params(decoder, params)
  vocab_size = context.next_logits.shape[-1]
  stop_token_ids = check_emitted_token_ids(stop_token_ids, pad_token_id, vocab_size=vocab_size)
  feed_tokens, feed_lengths = _pack_fed_tokens(tokens, context.lengths.shape[0], pad_token_id)
  check_padded_token_ids(
    feed_tokens, pad_token_id=pad_token_id, vocab_size=vocab_size, name="tokens"
  )
  key = check_decode_arguments(max_new_tokens, sampling, key)
  _check_feed_chunk(decoder, context, feed_chunk)
  check_room(
    context.caches,
    int(feed_lengths.max()) + max_new_tokens - 1,
    caller="continue_context",
    setting="room (of compress_context, or of share_context for a shared context)",
  )
  if feed_chunk is not None and feed_tokens.shape[1]:
    check_chunked_prefill_inputs(
      decoder,
      feed_tokens,
      feed_lengths,
      context.caches,
      chunk=feed_chunk,
      offsets=context.lengths,
    )
  else:
    feed_chunk = None
  out_tokens, count = _continue_in_jit(
    decoder,
    params,
    context.next_logits,
    context.caches,
    context.lengths,
    key,
    feed_tokens,
    feed_lengths,
    feed_chunk=feed_chunk,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    stop_token_ids=stop_token_ids,
    pad_token_id=pad_token_id,
  )
  return np.asarray(out_tokens), np.asarray(count)


def _check_copies(copies) -> None:
  if not isinstance(copies, (int, np.integer)) or isinstance(copies, bool) or copies < 1:
    raise ValueError(f"copies={copies!r} must be an int >= 1 (rows made of each context row)")


def _check_feed_chunk(decoder, context: CompressedContext, feed_chunk) -> None:
  if feed_chunk is None:
    return
  if not isinstance(feed_chunk, (int, np.integer)) or isinstance(feed_chunk, bool):
    raise ValueError(
      f"feed_chunk={feed_chunk!r} must be None (one decode step per fed token) or an int >= 1"
    )
  if feed_chunk < 1:
    raise ValueError(f"feed_chunk={feed_chunk} must be None or an int >= 1")
  if not is_shared(context):
    raise ValueError(
      f"feed_chunk={feed_chunk}: only a shared context (share_context) takes fed tokens in "
      "chunks, appending them exactly; a method's own caches would compress each chunk as a "
      "chunked prefill does. Share the context, or feed_chunk=None"
    )
  refusal = chunked_prefill_refusal(decoder, context.caches)
  if refusal is not None:
    raise ValueError(f"feed_chunk={feed_chunk}: {refusal}")


def _continue(
  decoder, params, next_logits, caches, lengths, key, feed_tokens, feed_lengths, **static
) -> tuple[jax.Array, jax.Array]:
  """`continue_context`'s program: the fed tokens (in chunks of `static["feed_chunk"]`, or by
  the decode loop), then the generated ones; (tokens, num_generated). One program returning no
  caches: a shared context's frozen arrays only pass through it (the layer loops write back only
  what a step changed), so they are not copied, and the context is held once while it runs."""
  feed_chunk = static.pop("feed_chunk")
  if feed_chunk is not None:
    next_logits, caches, lengths = _feed_in_chunks(
      decoder, params, next_logits, caches, lengths, feed_tokens, feed_lengths, chunk=feed_chunk
    )
    feed_tokens, feed_lengths = None, None
  fed = (feed_tokens, feed_lengths)
  tokens, count, _, _ = _decode_loop(
    decoder, params, next_logits, caches, lengths, key, *fed, **static
  )
  return tokens, count


_continue_in_jit = jax.jit(_continue, static_argnames=(*_DECODE_STATIC, "feed_chunk"))


def _feed_in_chunks(
  decoder, params, next_logits, caches, lengths, feed_tokens, feed_lengths, *, chunk
):
  """(logits predicting each row's token after its fed ones, caches, new lengths)."""
  logits, caches = prefill_in_chunks(
    decoder, params, feed_tokens, feed_lengths, caches, chunk=chunk, offsets=lengths
  )
  logits = jnp.where((feed_lengths > 0)[:, None], logits, next_logits)
  return logits, caches, lengths + feed_lengths


def repeat_context(
  context: CompressedContext, copies: int, *, row_sharding: NamedSharding | None = None
) -> CompressedContext:
  """Each row of `context` repeated `copies` times, in order (row b becomes rows
  `b * copies ... b * copies + copies - 1`): one compressed document asked `copies` questions
  in one batch, `continue_context(decoder, params, repeat_context(context, n), questions)`.

  The copies are made on device (`jnp.repeat`); they cost `copies` times the context's bytes.
  `row_sharding` (as in `compress_context`) spreads the repeated rows over devices, so the
  questions are answered data-parallel. The caches must keep every array's batch on axis 0 of a
  layer cache and axis 1 of a run of stacked layers (kvjax.cache_protocol), as kvjax's methods
  and `kvjax.layer_runs` do; an array that does not is refused by name.
  """
  if not isinstance(context, CompressedContext):
    raise ValueError(f"context must be a CompressedContext, got {type(context).__qualname__}")
  _check_copies(copies)
  _refuse_shared(context, "repeat_context")
  batch = context.lengths.shape[0]
  if row_sharding is not None:
    check_row_sharding(row_sharding, batch * int(copies))
  axes = _batch_axes(context, "repeat_context")
  repeated = jax.tree.map(
    lambda leaf, axis: jnp.repeat(leaf, int(copies), axis=axis), context, axes
  )
  if row_sharding is None:
    return repeated
  return jax.device_put(
    repeated, jax.tree.map(functools.partial(rows_split_at, row_sharding), axes)
  )


def share_context(
  decoder: CachedDecoder,
  context: CompressedContext,
  copies: int,
  *,
  room: int,
  cache_dtype=jnp.bfloat16,
  implementation: str = "auto",
  kernel_settings: KernelSettings = DEFAULT_KERNEL_SETTINGS,
  row_sharding: NamedSharding | None = None,
) -> CompressedContext:
  """Each row of `context` made `copies` rows, as `repeat_context` orders them, with the
  context's caches held once: `continue_context(decoder, params, share_context(decoder, context,
  n, room=R), questions)` answers n questions about one compressed document in one batch.

  Each row appends its own tokens (question, answer: up to `room` per row) to a full-precision
  cache of its own (`cache_dtype`, decode attention by `implementation` and `kernel_settings`;
  the context's caches keep the settings they were compressed with), and a decode step attends
  over its context row and its own tokens, merged by log-sum-exp (kvjax.shared_context_cache).
  The context then costs its bytes once, not `copies` times, and is read once per step for all
  its copies. The context's caches need no room of their own (compress it with `room=0`).

  What differs from `repeat_context`: tokens after the context are kept as computed, never
  quantized or evicted, and the context's caches stay as compressed (a KIVI window is not
  flushed, a StreamingLLM ring does not move). h2o_decode, which evicts by each step's
  attention, cannot be shared, nor can a cache without `attend_with_lse`; both are refused by
  name. A shared context is continued, not saved: save the context, and share it after
  restoring. On a sliding-window model (Mistral) a row must stay within the window (context
  + `room` tokens), since the context's tokens cannot leave it; longer is refused.

  `row_sharding` (as in `compress_context`) spreads the rows over devices, each row's own cache
  with it. The context goes with its copies where its rows split evenly over the devices
  (each device then holds and reads only its context rows); otherwise (one document asked
  questions on several devices) every device holds the whole context and reads it once per
  step for the rows it answers.
  """
  if not isinstance(context, CompressedContext):
    raise ValueError(f"context must be a CompressedContext, got {type(context).__qualname__}")
  _check_context_fits_decoder(decoder, context, "share_context")
  _check_copies(copies)
  _check_room_argument(room)
  check_cache_dtype(cache_dtype)
  check_kernel_settings(kernel_settings)
  # "pallas" needs a GPU or TPU backend, and a kernel_backend the backend's family.
  choose_kernel_family(implementation, kernel_settings.kernel_backend)
  _refuse_shared(context, "share_context")
  check_shareable(context.caches)
  batch = context.lengths.shape[0]
  if row_sharding is not None:
    check_row_sharding(row_sharding, batch * int(copies))
    context = _place_context_for_sharing(context, row_sharding)
  shape = decoder.cache_shape
  longest = int(np.max(np.asarray(context.lengths))) + int(room)
  if shape.sliding_window is not None and longest > shape.sliding_window:
    raise ValueError(
      f"share_context: the model attends over a sliding window of {shape.sliding_window} "
      f"tokens, and a row may reach {longest} (context + room={room}); a shared context "
      "cannot move its window past its tokens: use repeat_context"
    )
  own = FullCache(implementation=implementation, kernel_settings=kernel_settings).allocate_storage(
    batch=batch * int(copies),
    kv_heads=shape.num_kv_heads,
    capacity=int(room),
    head_dim=shape.head_dim,
    dtype=cache_dtype,
  )
  # Rows at axis 0 of a layer's arrays, at axis 1 of a run of stacked layers.
  by_rows = lambda tree, axis: (
    tree
    if row_sharding is None
    else jax.device_put(tree, jax.tree.map(lambda _: rows_split_at(row_sharding, axis), tree))
  )

  def shared(item):
    if not isinstance(item, StackedLayerCaches):
      return SharedContextLayerCache(context=item, own=by_rows(own, 0), copies=int(copies))
    layers = item.num_layers
    own_stack = jax.tree.map(lambda leaf: jnp.zeros((layers,) + leaf.shape, leaf.dtype), own)
    return StackedLayerCaches(
      SharedContextLayerCache(context=item.stacked, own=by_rows(own_stack, 1), copies=int(copies))
    )

  return CompressedContext(
    caches=tuple(shared(item) for item in context.caches),
    lengths=by_rows(jnp.repeat(context.lengths, int(copies)), 0),
    next_logits=by_rows(jnp.repeat(context.next_logits, int(copies), axis=0), 0),
  )


def _place_context_for_sharing(
  context: CompressedContext, row_sharding: NamedSharding
) -> CompressedContext:
  """`context` split by rows over `row_sharding`'s devices where its rows divide evenly (each
  row's copies, made in order, then land on its device), else replicated on every device."""
  split = context.lengths.shape[0] % row_device_count(row_sharding) == 0
  replicated = NamedSharding(row_sharding.mesh, jax.sharding.PartitionSpec())
  return jax.device_put(
    context,
    jax.tree.map(
      lambda axis: rows_split_at(row_sharding, axis) if split else replicated,
      _batch_axes(context, "share_context"),
    ),
  )


def check_shareable(caches) -> None:
  """ValueError naming the first layer whose cache `share_context` cannot share (`caches`: a
  context's caches, or their `model_cache_shapes`, so a caller can check before prefilling)."""
  for layer, cache in layer_cache_kinds(caches):
    refusal = shared_context_refusal(cache)
    if refusal is not None:
      raise ValueError(f"share_context: layer {layer}'s cache cannot be shared: {refusal}")


def is_shared(context: CompressedContext) -> bool:
  """Whether `context` came from `share_context` (its caches are read by several rows each)."""
  return any(
    isinstance(cache, SharedContextLayerCache) for _, cache in layer_cache_kinds(context.caches)
  )


def _refuse_shared(context: CompressedContext, caller: str) -> None:
  if is_shared(context):
    raise ValueError(
      f"{caller}: the context is shared already (share_context); share the original context "
      "with all the copies needed instead"
    )


def _batch_axes(context: CompressedContext, caller: str) -> CompressedContext:
  """The batch axis of every array of `context` (the cache protocol's layout), checked."""
  batch = context.lengths.shape[0]

  def axes_of(tree, axis: int, where: str):
    def checked(path, leaf):
      if jnp.ndim(leaf) <= axis or jnp.shape(leaf)[axis] != batch:
        raise ValueError(
          f"{caller}: {where}{jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)}, "
          f"not the context's {batch} rows on axis {axis} (kvjax.cache_protocol: a layer "
          "cache keeps its batch on axis 0)"
        )
      return axis

    return jax.tree_util.tree_map_with_path(checked, tree)

  caches = tuple(
    axes_of(item, 1 if isinstance(item, StackedLayerCaches) else 0, f"caches[{index}]")
    for index, item in enumerate(context.caches)
  )
  return CompressedContext(caches=caches, lengths=0, next_logits=0)


def _pack_fed_tokens(tokens, batch: int, pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Token lists (any lengths, possibly empty) or an int array -> (int32 [batch, longest]
  right-padded, lengths int32 [batch])."""
  if isinstance(tokens, (np.ndarray, jax.Array)):
    array = np.asarray(tokens)
    if array.ndim != 2 or array.shape[0] != batch or not np.issubdtype(array.dtype, np.integer):
      raise ValueError(
        f"tokens must be {batch} token lists (one per context row) or an int array "
        f"[{batch}, n]; got a {array.dtype} array of shape {array.shape}"
      )
    check_ids_fit_int32(array, name="tokens")
    return array.astype(np.int32), np.full((batch,), array.shape[1], np.int32)
  # A row may be a 1-D array, as compress_context takes its prompts (pack_token_lists checks
  # its ids like a list's: a float array is refused, not truncated).
  check_token_lists(tokens, name="tokens")
  rows = list(tokens)
  is_row = lambda row: isinstance(row, (Sequence, np.ndarray, jax.Array))
  if len(rows) != batch or not all(is_row(row) for row in rows):
    several = len(rows) > batch and all(is_row(row) for row in rows)
    hint = (
      f"; to ask each context row {len(rows) // batch} questions, continue "
      f"kvjax.repeat_context(context, {len(rows) // batch})"
      if several and len(rows) % batch == 0
      else ""
    )
    raise ValueError(
      f"tokens must be {batch} token lists (one per context row) or an int array "
      f"[{batch}, n]; got {len(rows)} items of types "
      f"{sorted({type(r).__name__ for r in rows})}{hint}"
    )
  return pack_token_lists(rows, pad_token_id=pad_token_id, name="tokens")
