"""Generation: one jitted prefill, then decoding in a `lax.while_loop` inside jit.

No Python loop per token and no host round-trip while decoding: stop tokens are handled on
device (finished rows emit `pad_token_id` and stop changing; the loop ends when all rows
have stopped).
"""

import collections
import dataclasses
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache_protocol import CacheMethod, allocate_model_cache, model_cache_nbytes
from kvjax.cache_room import check_room
from kvjax.decoder_protocol import CachedDecoder
from kvjax.dense_cache import FullCache
from kvjax.layer_runs import pytree_signature
from kvjax.prompt_batch import compact_padded_batch, pack_prompts
from kvjax.sampling import SamplingConfig, sample_next_token


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


@partial(jax.jit, static_argnames=("decoder", "cache_method", "max_new_tokens", "cache_dtype"))
def prefill(
  decoder: CachedDecoder,
  params: Any,
  tokens: jax.Array,  # int32 [batch, prompt], right-padded
  lengths: jax.Array,  # int32 [batch]
  *,
  cache_method: CacheMethod,
  max_new_tokens: int,
  cache_dtype,
) -> tuple[jax.Array, tuple]:
  """Allocates the caches and ingests the prompts: (last-token logits [batch, vocab], caches)."""
  caches = allocate_model_cache(
    cache_method,
    decoder.cache_shape,
    batch=tokens.shape[0],
    prompt_len=tokens.shape[1],
    max_new_tokens=max_new_tokens,
    dtype=cache_dtype,
  )
  return decoder.prefill(params, tokens, lengths, caches)


@partial(
  jax.jit,
  static_argnames=("decoder", "max_new_tokens", "sampling", "stop_token_ids", "pad_token_id"),
)
def _decode_in_jit(
  decoder: CachedDecoder,
  params: Any,
  logits: jax.Array,  # [batch, vocab]: logits of the first new token
  caches: tuple,
  lengths: jax.Array,  # int32 [batch]: prompt lengths (position of the first new token)
  key: jax.Array,
  *,
  max_new_tokens: int,
  sampling: SamplingConfig,
  stop_token_ids: tuple[int, ...],
  pad_token_id: int,
) -> tuple[jax.Array, jax.Array, tuple, jax.Array]:
  """(tokens [batch, max_new_tokens], num_generated [batch], caches, decode steps run).

  A `while_loop` on device: it ends after `max_new_tokens` tokens or as soon as every row
  has emitted a stop token, whichever comes first.
  """
  stop_ids = jnp.asarray(stop_token_ids or (-1,), jnp.int32)
  batch = logits.shape[0]
  keys = jax.random.split(key, max_new_tokens)

  def choose(index, logits, finished, tokens, count):
    token = sample_next_token(logits, keys[index], sampling)
    token = jnp.where(finished, pad_token_id, token)
    tokens = jax.lax.dynamic_update_index_in_dim(tokens, token, index, axis=1)
    count = count + (~finished).astype(jnp.int32)
    return token, finished | jnp.isin(token, stop_ids), tokens, count

  def more(state):
    index, _, _, finished, _, _ = state
    return (index < max_new_tokens - 1) & ~jnp.all(finished)

  def step(state):
    index, logits, caches, finished, tokens, count = state
    token, finished, tokens, count = choose(index, logits, finished, tokens, count)
    logits, caches = decoder.decode_step(params, token, lengths + index, caches)
    return index + 1, logits, caches, finished, tokens, count

  state = (
    jnp.int32(0),
    logits,
    caches,
    jnp.zeros((batch,), bool),
    jnp.full((batch, max_new_tokens), pad_token_id, jnp.int32),
    jnp.zeros((batch,), jnp.int32),
  )
  steps, logits, caches, finished, tokens, count = jax.lax.while_loop(more, step, state)
  _, _, tokens, count = choose(steps, logits, finished, tokens, count)
  return tokens, count, caches, steps


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
) -> tuple[jax.Array, jax.Array, tuple, jax.Array]:
  """The jitted decode loop (`_decode_in_jit`, same arguments and results), after checking on
  the host that the caches have room for the `max_new_tokens - 1` tokens it feeds back
  (kvjax.cache_room). `decode.lower` lowers the loop ahead of time, without the check."""
  check_room(caches, max_new_tokens - 1, caller="decode")
  return _decode_in_jit(
    decoder,
    params,
    logits,
    caches,
    lengths,
    key,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    stop_token_ids=stop_token_ids,
    pad_token_id=pad_token_id,
  )


decode.lower = _decode_in_jit.lower


def check_decode_arguments(
  max_new_tokens: int, sampling: SamplingConfig, key: jax.Array | None
) -> jax.Array:
  """Refuses a decode that would emit nothing or sample without a key; returns the PRNG key to
  use (a fixed one when decoding greedily, where it is never drawn from)."""
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
  if not sampling.greedy and key is None:
    raise ValueError("key is required when sampling (temperature > 0)")
  return jax.random.key(0) if key is None else key


def _as_compact_batch(prompts, attention_mask, pad_token_id):
  if attention_mask is not None:
    return compact_padded_batch(np.asarray(prompts), attention_mask, pad_token_id=pad_token_id)
  if isinstance(prompts, (np.ndarray, jax.Array)):
    tokens = np.asarray(prompts, np.int32)
    if tokens.ndim != 2:
      raise ValueError(f"prompts array must be [batch, tokens]; got shape {tokens.shape}")
    return tokens, np.full((tokens.shape[0],), tokens.shape[1], np.int32)
  return pack_prompts(prompts, pad_token_id=pad_token_id)


_COMPILED: collections.OrderedDict = collections.OrderedDict()
_MAX_COMPILED = 16


def _compiled_executables(decoder, params, tokens, lengths, key, prefill_static, decode_static):
  """Ahead-of-time compiled prefill and decode, memoised on everything that shapes them."""
  signature = (
    decoder,
    pytree_signature(params),
    tokens.shape,
    pytree_signature(key),
    tuple(sorted((k, v) for k, v in prefill_static.items() if k != "cache_dtype")),
    jnp.dtype(prefill_static["cache_dtype"]).name,
    tuple(sorted(decode_static.items())),
  )
  if signature not in _COMPILED:
    prefill_compiled = prefill.lower(decoder, params, tokens, lengths, **prefill_static).compile()
    logits_shape, caches_shape = jax.eval_shape(
      lambda: prefill(decoder, params, tokens, lengths, **prefill_static)
    )
    decode_compiled = decode.lower(
      decoder, params, logits_shape, caches_shape, lengths, key, **decode_static
    ).compile()
    _COMPILED[signature] = (prefill_compiled, decode_compiled)
    if len(_COMPILED) > _MAX_COMPILED:
      _COMPILED.popitem(last=False)
  _COMPILED.move_to_end(signature)
  return _COMPILED[signature]


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
) -> GenerateResult:
  """Generates up to `max_new_tokens` tokens for each prompt.

  `prompts`: token lists of any lengths, or a `[batch, tokens]` array (with a Hugging Face
  style `attention_mask` when it is left- or right-padded). `key` is required when sampling.
  `max_cache_tokens` (e.g. the model's context length) bounds prompt + new tokens.
  Compilation happens ahead of time, so `compile_s` and the run times are measured apart.
  """
  key = check_decode_arguments(max_new_tokens, sampling, key)
  tokens, lengths = _as_compact_batch(prompts, attention_mask, pad_token_id)
  if max_cache_tokens is not None and tokens.shape[1] + max_new_tokens > max_cache_tokens:
    raise ValueError(
      f"prompt ({tokens.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
      f"max_cache_tokens={max_cache_tokens}"
    )
  prefill_static = dict(
    cache_method=cache_method, max_new_tokens=max_new_tokens, cache_dtype=cache_dtype
  )
  decode_static = dict(
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    stop_token_ids=tuple(int(t) for t in stop_token_ids),
    pad_token_id=pad_token_id,
  )
  compile_start = time.perf_counter()
  prefill_compiled, decode_compiled = _compiled_executables(
    decoder, params, tokens, lengths, key, prefill_static, decode_static
  )
  compile_s = time.perf_counter() - compile_start

  (logits, caches), prefill_s = _timed(prefill_compiled, params, tokens, lengths)
  (out_tokens, count, caches, steps), decode_s = _timed(
    decode_compiled, params, logits, caches, lengths, key
  )
  return GenerateResult(
    tokens=np.asarray(out_tokens),
    num_generated=np.asarray(count),
    prompt_lengths=lengths,
    cache_bytes=model_cache_nbytes(caches),
    compile_s=compile_s,
    prefill_s=prefill_s,
    decode_s=decode_s,
    decode_steps=int(steps),
  )
