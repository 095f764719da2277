"""Generation: one jitted prefill, then decoding in a `lax.while_loop` inside jit.

No Python loop per token and no host round-trip while decoding: stop tokens are handled on
device (finished rows emit `pad_token_id` and stop changing; the loop ends when all rows
have stopped).
"""

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvjax.attention_dispatch import choose_kernel_family
from kvjax.cache_protocol import (
  CacheMethod,
  allocate_model_cache,
  check_cache_dtype,
  check_cache_method,
  check_count,
  model_cache_nbytes,
  model_cache_shapes,
)
from kvjax.cache_room import check_room
from kvjax.chunked_prefill import check_chunked_prefill, check_prefill_chunk, prefill_in_chunks
from kvjax.decoder_protocol import (
  CachedDecoder,
  check_decoder,
  check_decoder_params,
  check_next_token_logits,
  check_prompt_attention,
  decoder_vocab_size,
)
from kvjax.dense_cache import FullCache
from kvjax.kernel_settings import KernelSettings
from kvjax.layer_runs import pytree_signature
from kvjax.lru_table import LruTable
from kvjax.prompt_batch import (
  as_array,
  check_ids_fit_int32,
  check_pad_token_id,
  check_padded_token_ids,
  check_positions,
  check_row_lengths,
  check_token_ids,
  compact_padded_batch,
  pack_prompts,
)
from kvjax.row_sharding import check_row_sharding, row_shardings
from kvjax.sampling import SamplingConfig, sample_next_token
from kvjax.selection.budgets import warn_if_ragged_budgets


@dataclasses.dataclass(frozen=True)
class GenerateResult:
  tokens: np.ndarray  # int32 [batch, max_new_tokens]; pad after a row's stop token
  num_generated: np.ndarray  # int32 [batch]: tokens up to and including the stop token
  prompt_lengths: np.ndarray  # int32 [batch]
  cache_bytes: int  # bytes the caches hold after decoding
  compile_s: float
  prefill_s: float
  decode_s: float
  decode_steps: int  # decode forward passes run (fewer than max_new_tokens - 1 if all rows stopped)

  @property
  def decode_tokens_per_s(self) -> float:
    """Tokens decoded per second, summed over the batch (every row runs every step)."""
    tokens = self.tokens.shape[0] * self.decode_steps
    return tokens / self.decode_s if self.decode_s > 0 else float("nan")

  def token_lists(self) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(self.tokens, self.num_generated)]


def prefill(
  decoder: CachedDecoder,
  params: Any,
  tokens: jax.Array,  # int32 [batch, prompt], right-padded
  lengths: jax.Array,  # int32 [batch]
  *,
  cache_method: CacheMethod,
  max_new_tokens: int,
  cache_dtype,
  prefill_chunk: int | None = None,
) -> tuple[jax.Array, tuple]:
  """Allocates the caches and ingests the prompts: (last-token logits [batch, vocab], caches).

  `prefill_chunk`: None feeds the prompt in one piece; an int feeds it that many tokens at a
  time, compressing as it goes (`kvjax.chunked_prefill`). Jitted (`_prefill_in_jit`), after
  checking on the host the rows (`tokens` integer [batch, width] with ids in the vocabulary,
  `lengths` [batch] in [1, width]) and the static arguments (`check_prefill_arguments`).
  `prefill.lower` lowers it ahead of time, without the checks."""
  check_row_lengths(tokens, lengths, vocab_size=decoder_vocab_size(decoder), name="tokens")
  # Nested lists pass the checks as the arrays they make; jit takes arrays.
  tokens, lengths = as_array(tokens, name="tokens"), as_array(lengths, name="lengths")
  check_decoder_params(decoder, params)
  check_prefill_arguments(
    decoder,
    batch=np.shape(tokens)[0],
    prompt_len=np.shape(tokens)[1],
    cache_method=cache_method,
    max_new_tokens=max_new_tokens,
    cache_dtype=cache_dtype,
    prefill_chunk=prefill_chunk,
  )
  return _prefill_in_jit(
    decoder,
    params,
    tokens,
    lengths,
    cache_method=cache_method,
    max_new_tokens=max_new_tokens,
    cache_dtype=cache_dtype,
    prefill_chunk=prefill_chunk,
  )


_PREFILL_STATIC = ("decoder", "cache_method", "max_new_tokens", "cache_dtype", "prefill_chunk")


def _prefill_work(
  decoder, params, tokens, lengths, *, cache_method, max_new_tokens, cache_dtype, prefill_chunk=None
):
  """`prefill`'s work, unchecked: allocates the caches and ingests the prompts."""
  caches = allocate_model_cache(
    cache_method,
    decoder.cache_shape,
    batch=tokens.shape[0],
    prompt_len=tokens.shape[1],
    max_new_tokens=max_new_tokens,
    dtype=cache_dtype,
  )
  if prefill_chunk is None:
    return decoder.prefill(params, tokens, lengths, caches)
  check_chunked_prefill(
    decoder, caches, prefill_chunk, method_name=getattr(cache_method, "method_name", "")
  )
  return prefill_in_chunks(decoder, params, tokens, lengths, caches, chunk=prefill_chunk)


_prefill_in_jit = jax.jit(_prefill_work, static_argnames=_PREFILL_STATIC)


def check_implementations_run_here(cache_method: CacheMethod) -> None:
  """Refuses a method whose attention cannot run on this backend ("pallas" on CPU, or kernel
  settings naming the other kernel family) before anything is traced: the method's own
  `implementation` and its storage's (a composition)."""
  for part in (cache_method, getattr(cache_method, "storage", None)):
    implementation = getattr(part, "implementation", None)
    if not isinstance(implementation, str):
      continue
    settings = getattr(part, "kernel_settings", None)
    kernel_backend = settings.kernel_backend if isinstance(settings, KernelSettings) else None
    try:
      choose_kernel_family(implementation, kernel_backend)
    except ValueError as error:
      raise ValueError(f"cache_method {cache_method!r}: {error}") from None


def check_prefill_arguments(
  decoder: CachedDecoder,
  *,
  batch: int,
  prompt_len: int,
  cache_method: CacheMethod,
  max_new_tokens: int,
  cache_dtype,
  prefill_chunk: int | None,
) -> None:
  """Refuses, before the prefill is traced, a cache method, cache dtype or `max_new_tokens`
  that is not one, a method that does not fit the model (its allocation checks: a sliding
  window, a head_dim its groups do not divide, a profile of another model), and a
  `prefill_chunk` the decoder or the method's caches cannot take (the caches are only shaped,
  not allocated)."""
  check_decoder(decoder)
  check_cache_method(cache_method)
  check_cache_dtype(cache_dtype)
  check_count("max_new_tokens", max_new_tokens, 0)
  check_prefill_chunk(prefill_chunk)
  check_implementations_run_here(cache_method)
  caches = model_cache_shapes(
    cache_method,
    decoder.cache_shape,
    batch=batch,
    prompt_len=prompt_len,
    max_new_tokens=max_new_tokens,
    dtype=cache_dtype,
  )
  method_name = getattr(cache_method, "method_name", "")
  if prefill_chunk is None:
    check_prompt_attention(decoder, caches, method_name=method_name)
    return
  check_chunked_prefill(decoder, caches, prefill_chunk, method_name=method_name)


def _decode_loop(
  decoder: CachedDecoder,
  params: Any,
  logits: jax.Array,  # [batch, vocab]: prediction for each row's next token
  caches: tuple,
  lengths: jax.Array,  # int32 [batch]: position of each row's next token
  key: jax.Array,
  feed_tokens: jax.Array | None = None,  # int32 [batch, width]: fed before generating
  feed_lengths: jax.Array | None = None,  # int32 [batch], each <= width
  *,
  max_new_tokens: int,
  sampling: SamplingConfig,
  stop_token_ids: tuple[int, ...],
  pad_token_id: int,
) -> tuple[jax.Array, jax.Array, tuple, jax.Array]:
  """(tokens [batch, max_new_tokens], num_generated [batch], caches, decode steps run).

  A `while_loop` on device. Row r is first fed `feed_tokens[r, :feed_lengths[r]]` (appended
  through the caches, nothing emitted), then generates; rows fed fewer tokens start generating
  sooner, in the same steps. The loop ends when every row has `max_new_tokens` tokens or has
  emitted a stop token.
  """
  # Static, so checked at trace time too (decode.lower skips decode's checks): with no token to
  # emit, no row would ever be done and the loop would not end.
  check_count("max_new_tokens", max_new_tokens, 1)
  stop_ids = jnp.asarray(stop_token_ids or (-1,), jnp.int32)
  batch = logits.shape[0]
  if feed_tokens is None:
    feed_tokens = jnp.zeros((batch, 0), jnp.int32)
    feed_lengths = jnp.zeros((batch,), jnp.int32)
  feed_width = feed_tokens.shape[1]
  # One key per loop step (the first max_new_tokens are generate's keys when nothing is fed).
  keys = jax.random.split(key, feed_width + max_new_tokens)
  slots = jnp.arange(max_new_tokens)

  def choose(step, logits, done, tokens, count):
    token = sample_next_token(logits, keys[step], sampling)
    if feed_width:
      feeding = step < feed_lengths
      fed = jax.lax.dynamic_index_in_dim(
        feed_tokens, jnp.minimum(step, feed_width - 1), axis=1, keepdims=False
      )
    else:
      feeding = jnp.zeros((batch,), bool)
      fed = token
    emitting = ~feeding & ~done
    token = jnp.where(feeding, fed, jnp.where(done, pad_token_id, token))
    slot = step - feed_lengths
    tokens = jnp.where(emitting[:, None] & (slots == slot[:, None]), token[:, None], tokens)
    count = count + emitting.astype(jnp.int32)
    done = done | (emitting & (jnp.isin(token, stop_ids) | (count == max_new_tokens)))
    return token, done, tokens, count

  def more(state):
    return ~jnp.all(state[3])

  def step(state):
    # The token is chosen before the loop tests for the end, so no pass runs for a token no row
    # will use (the one after every row stopped).
    step, token, caches, done, tokens, count = state
    logits, caches = decoder.decode_step(params, token, lengths + step, caches)
    token, done, tokens, count = choose(step + 1, logits, done, tokens, count)
    return step + 1, token, caches, done, tokens, count

  token, done, tokens, count = choose(
    0,
    logits,
    jnp.zeros((batch,), bool),
    jnp.full((batch, max_new_tokens), pad_token_id, jnp.int32),
    jnp.zeros((batch,), jnp.int32),
  )
  state = (jnp.int32(0), token, caches, done, tokens, count)
  steps, _, caches, done, tokens, count = jax.lax.while_loop(more, step, state)
  return tokens, count, caches, steps


_DECODE_STATIC = ("decoder", "max_new_tokens", "sampling", "stop_token_ids", "pad_token_id")
_decode_in_jit = jax.jit(_decode_loop, static_argnames=_DECODE_STATIC)
# generate owns the caches its prefill made: the loop updates them in place instead of holding
# a second copy (peak memory one cache, not two). `decode` and `continue_context` do not
# donate: their callers may still use the caches they pass (a reused context).
_decode_in_jit_donating_caches = jax.jit(
  _decode_loop, static_argnames=_DECODE_STATIC, donate_argnames=("caches",)
)


def decode(
  decoder: CachedDecoder,
  params: Any,
  logits: jax.Array,
  caches: tuple,
  lengths: jax.Array,
  key: jax.Array,
  *,
  max_new_tokens: int,
  sampling: SamplingConfig,
  stop_token_ids: tuple[int, ...],
  pad_token_id: int,
  feed_tokens: jax.Array | np.ndarray | None = None,
  feed_lengths: jax.Array | np.ndarray | None = None,
) -> tuple[jax.Array, jax.Array, tuple, jax.Array]:
  """The jitted decode loop (`_decode_in_jit`, same arguments and results), after checking on
  the host `logits` (float [batch, vocab], as wide as the decoder's `vocab_size` where it has
  one: `check_next_token_logits`), the fed tokens (`feed_tokens` int32 [batch, width] with
  `feed_lengths` int32 [batch], both or neither) and that the caches have room for what the
  loop appends: the longest row's fed tokens plus the `max_new_tokens - 1` tokens fed back
  (concrete caches only: inside a caller's jit they cannot be read, so call `kvjax.check_room`
  before it).
  `decode.lower` lowers the loop ahead of time, without the checks.

  The caches returned hold what each step appended: every row's fed and emitted tokens except
  those chosen at the loop's last step (the last token of a row that ran to the end); a row
  that stopped sooner also holds its stop token and a pad token for each step the others went
  on. Chain further decoding from a row's own count, not from the caches' lengths."""
  check_decoder(decoder)
  check_decoder_params(decoder, params)
  batch, vocab_size = check_next_token_logits(logits, decoder, name="logits")
  key = check_decode_arguments(max_new_tokens, sampling, key)
  check_positions(lengths, batch=batch, name="lengths")
  lengths = as_array(lengths, name="lengths")
  feed_tokens = as_array(feed_tokens, name="feed_tokens")
  feed_lengths = as_array(feed_lengths, name="feed_lengths")
  stop_token_ids = check_emitted_token_ids(stop_token_ids, pad_token_id, vocab_size=vocab_size)
  longest_feed = check_feed(feed_tokens, feed_lengths, batch=batch, vocab_size=vocab_size)
  check_room(caches, longest_feed + max_new_tokens - 1, caller="decode")
  return _decode_in_jit(
    decoder,
    params,
    logits,
    caches,
    lengths,
    key,
    feed_tokens,
    feed_lengths,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    stop_token_ids=stop_token_ids,
    pad_token_id=pad_token_id,
  )


decode.lower = _decode_in_jit.lower
prefill.lower = _prefill_in_jit.lower


def check_feed(feed_tokens, feed_lengths, *, batch: int, vocab_size: int) -> int:
  """Checks fed tokens against the batch and the vocabulary; returns the most tokens fed to
  one row."""
  if feed_tokens is None and feed_lengths is None:
    return 0
  if feed_tokens is None or feed_lengths is None:
    raise ValueError("feed_tokens and feed_lengths go together: give both or neither")
  shape = np.shape(feed_tokens)
  if len(shape) != 2 or shape[0] != batch:
    raise ValueError(f"feed_tokens must be [batch={batch}, width]; got {shape}")
  check_positions(feed_lengths, batch=batch, name="feed_lengths")
  if not jnp.issubdtype(jnp.result_type(feed_tokens), jnp.integer):
    raise ValueError(f"feed_tokens must hold integer token ids, got {jnp.result_type(feed_tokens)}")
  if isinstance(feed_lengths, jax.core.Tracer):
    return shape[1]  # checked no further inside a trace; the width bounds every row
  fed = np.asarray(feed_lengths)
  if fed.min(initial=0) < 0 or fed.max(initial=0) > shape[1]:
    raise ValueError(
      f"feed_lengths={fed.tolist()} must lie in [0, {shape[1]}] (feed_tokens' width)"
    )
  if not isinstance(feed_tokens, jax.core.Tracer):
    ids = np.asarray(feed_tokens)
    check_token_ids(
      ids[np.arange(shape[1])[None, :] < fed[:, None]], vocab_size=vocab_size, name="feed_tokens"
    )
  return int(fed.max(initial=0))


def check_emitted_token_ids(
  stop_token_ids, pad_token_id, *, vocab_size: int | None
) -> tuple[int, ...]:
  """Stop ids and the pad id are token ids of the vocabulary: a stop id outside it would never
  stop a row, and a pad id outside it would be fed back to the embedding. Returns the stop ids
  as a tuple of ints (a list, a tuple, an integer array or a single id)."""
  try:
    ids = np.asarray(stop_token_ids)
  except ValueError:  # ragged nesting, which numpy cannot make an array of
    ids = np.asarray([], object)
  if ids.ndim > 1 or ids.dtype == object or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
    raise ValueError(
      f"stop_token_ids={stop_token_ids!r} must be int token ids (one id, or a flat list of ids)"
    )
  ids = ids.reshape(-1).astype(np.int64)
  check_token_ids(ids, vocab_size=vocab_size, name="stop_token_ids")
  check_pad_token_id(pad_token_id)
  check_token_ids(np.array([pad_token_id]), vocab_size=vocab_size, name="pad_token_id")
  return tuple(int(i) for i in ids)


def check_decode_arguments(
  max_new_tokens: int, sampling: SamplingConfig, key: jax.Array | None
) -> jax.Array:
  """Refuses a decode that would emit nothing or sample without a key; returns the PRNG key to
  use (a fixed one when decoding greedily, where it is never drawn from)."""
  check_count("max_new_tokens", max_new_tokens, 1)
  if not isinstance(sampling, SamplingConfig):
    raise ValueError(f"sampling must be a kvjax.SamplingConfig, got {type(sampling).__name__}")
  if not sampling.greedy and key is None:
    raise ValueError("key is required when sampling (temperature > 0)")
  if key is None:
    return jax.random.key(0)
  check_prng_key(key)
  return key


def check_prng_key(key) -> None:
  """One PRNG key: a typed key array of shape () (`jax.random.key`) or a legacy uint32[2] one
  (`jax.random.PRNGKey`; uint32[4] under the rbg implementations). An int seed or a batch of
  keys would fail inside the traced loop, with a message naming neither `generate` nor `key`."""
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if np.shape(key) == ():
      return
  elif dtype == np.uint32:
    legacy = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    if np.shape(key) == legacy.shape:
      return
  raise ValueError(
    "key must be one PRNG key: jax.random.key(seed) (shape ()) or jax.random.PRNGKey(seed); "
    f"got {type(key).__name__} of dtype {dtype} and shape {np.shape(key)}"
  )


def _as_compact_batch(prompts, attention_mask, pad_token_id):
  if attention_mask is not None:
    try:
      padded = np.asarray(prompts)
    except ValueError:  # lists of different lengths
      padded = None
    if padded is None or padded.ndim != 2:
      raise ValueError(
        "attention_mask goes with padded prompts: a [batch, tokens] array or lists of one "
        "length; token lists of different lengths need none (each list is one row's tokens)"
      )
    return compact_padded_batch(padded, attention_mask, pad_token_id=pad_token_id)
  if isinstance(prompts, (np.ndarray, jax.Array)):
    if not np.issubdtype(prompts.dtype, np.integer):  # int32 would truncate 1.5 to 1
      raise ValueError(f"prompts array must hold integer token ids; got dtype {prompts.dtype}")
    check_ids_fit_int32(np.asarray(prompts), name="prompts")
    tokens = np.asarray(prompts, np.int32)
    if tokens.ndim != 2:
      raise ValueError(f"prompts array must be [batch, tokens]; got shape {tokens.shape}")
    if 0 in tokens.shape:
      raise ValueError(
        f"prompts array must hold at least one prompt of at least one token; got shape "
        f"{tokens.shape}"
      )
    return tokens, np.full((tokens.shape[0],), tokens.shape[1], np.int32)
  return pack_prompts(prompts, pad_token_id=pad_token_id)


# Threads (a server's request handlers) may call generate at once.
_COMPILED = LruTable(max_entries=16)


def _placements(tree) -> tuple:
  """Where each array leaf lives (None for host arrays): compiled programs take their
  arguments where they were compiled for."""
  return tuple(getattr(leaf, "sharding", None) for leaf in jax.tree_util.tree_leaves(tree))


def _prefill_output_shardings(decoder, params, tokens, prefill_static, row_sharding):
  """Each prefill output split by rows at its batch axis (`kvjax.row_sharding`). Left to XLA,
  arrays the prompts never reach (a KIVI segment before its first flush) could come out
  replicated on every device, or split otherwise than the decode was compiled for."""
  batch, width = tokens.shape

  def shapes(rows):
    return jax.eval_shape(
      lambda tokens, lengths: _prefill_in_jit(decoder, params, tokens, lengths, **prefill_static),
      jax.ShapeDtypeStruct((rows, width), jnp.int32),
      jax.ShapeDtypeStruct((rows,), jnp.int32),
    )

  return row_shardings(shapes(batch), shapes(batch + 1), row_sharding)


def _compiled_executables(
  decoder, params, tokens, lengths, key, prefill_static, decode_static, row_sharding=None
):
  """Ahead-of-time compiled prefill and decode (which takes over the prefill's caches),
  memoised on everything that shapes them, placements included. With `row_sharding` the
  prefill leaves every output split by rows."""
  signature = (
    decoder,
    pytree_signature(params),
    _placements(params),
    tokens.shape,
    _placements((tokens, lengths, key)),
    pytree_signature(key),
    tuple(sorted((k, v) for k, v in prefill_static.items() if k != "cache_dtype")),
    jnp.dtype(prefill_static["cache_dtype"]).name,
    tuple(sorted(decode_static.items())),
  )

  def compile_both():
    prefill_jit = _prefill_in_jit
    if row_sharding is not None:
      prefill_jit = jax.jit(
        _prefill_work,
        static_argnames=_PREFILL_STATIC,
        out_shardings=_prefill_output_shardings(
          decoder, params, tokens, prefill_static, row_sharding
        ),
      )
    prefill_compiled = prefill_jit.lower(
      decoder, params, tokens, lengths, **prefill_static
    ).compile()
    # The decode program takes the prefill's outputs where the prefill leaves them (its
    # out_info carries their shardings): otherwise it would be compiled for whatever XLA infers.
    logits_shape, caches_shape = prefill_compiled.out_info
    decode_compiled = _decode_in_jit_donating_caches.lower(
      decoder, params, logits_shape, caches_shape, lengths, key, **decode_static
    ).compile()
    return prefill_compiled, decode_compiled

  return _COMPILED.get_or_compute(signature, compile_both)


def _timed(fn, *args, **kwargs):
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args, **kwargs))
  return out, time.perf_counter() - start


def generate(
  decoder: CachedDecoder,
  params: Any,
  prompts: Sequence[Sequence[int]] | np.ndarray,
  *,
  max_new_tokens: int,
  attention_mask: np.ndarray | None = None,
  cache_method: CacheMethod = FullCache(),
  cache_dtype=jnp.bfloat16,
  sampling: SamplingConfig = SamplingConfig(),
  stop_token_ids: Sequence[int] = (),
  pad_token_id: int = 0,
  key: jax.Array | None = None,
  max_cache_tokens: int | None = None,
  row_sharding: NamedSharding | None = None,
  prefill_chunk: int | None = None,
) -> GenerateResult:
  """Generates up to `max_new_tokens` tokens for each prompt.

  `prompts`: token lists of any lengths, or a `[batch, tokens]` array (with a Hugging Face
  style `attention_mask` when it is left- or right-padded). `key` is required when sampling.
  `max_cache_tokens` (e.g. the model's context length) bounds prompt + new tokens.
  `row_sharding` (e.g. `NamedSharding(mesh, PartitionSpec("data"))`) spreads the rows over
  devices: the prompts are placed that way and the caches follow (`kvjax.row_sharding`).
  `prefill_chunk` feeds the prompts that many tokens at a time, compressing as they arrive
  (`kvjax.chunked_prefill`: peak prefill memory follows the chunk, not the prompt).
  Compilation happens ahead of time, so `compile_s` and the run times are measured apart.
  """
  key = check_decode_arguments(max_new_tokens, sampling, key)
  stop_token_ids = check_emitted_token_ids(
    stop_token_ids, pad_token_id, vocab_size=decoder_vocab_size(decoder)
  )
  tokens, lengths = _as_compact_batch(prompts, attention_mask, pad_token_id)
  warn_if_ragged_budgets(cache_method, lengths, caller="generate")
  check_padded_token_ids(
    tokens, pad_token_id=pad_token_id, vocab_size=decoder_vocab_size(decoder), name="prompts"
  )
  if max_cache_tokens is not None:
    check_count("max_cache_tokens", max_cache_tokens, 1)
  if max_cache_tokens is not None and tokens.shape[1] + max_new_tokens > max_cache_tokens:
    raise ValueError(
      f"prompt ({tokens.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
      f"max_cache_tokens={max_cache_tokens}"
    )
  if row_sharding is not None:
    check_row_sharding(row_sharding, tokens.shape[0])
    tokens, lengths = jax.device_put((tokens, lengths), row_sharding)
  prefill_static = dict(
    cache_method=cache_method,
    max_new_tokens=max_new_tokens,
    cache_dtype=cache_dtype,
    prefill_chunk=prefill_chunk,
  )
  check_decoder_params(decoder, params)
  check_prefill_arguments(
    decoder, batch=tokens.shape[0], prompt_len=tokens.shape[1], **prefill_static
  )
  decode_static = dict(
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    stop_token_ids=stop_token_ids,
    pad_token_id=pad_token_id,
  )
  compile_start = time.perf_counter()
  prefill_compiled, decode_compiled = _compiled_executables(
    decoder, params, tokens, lengths, key, prefill_static, decode_static, row_sharding
  )
  compile_s = time.perf_counter() - compile_start

  (logits, caches), prefill_s = _timed(prefill_compiled, params, tokens, lengths)
  (out_tokens, count, caches, steps), decode_s = _timed(
    decode_compiled, params, logits, caches, lengths, key
  )
  return GenerateResult(
    tokens=np.asarray(out_tokens),
    num_generated=np.asarray(count),
    prompt_lengths=np.asarray(lengths),
    cache_bytes=model_cache_nbytes(caches),
    compile_s=compile_s,
    prefill_s=prefill_s,
    decode_s=decode_s,
    decode_steps=int(steps),
  )
