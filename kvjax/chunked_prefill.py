"""Chunked prefill: a prompt fed `chunk` tokens at a time, compressed as it arrives.

A one-piece prefill holds every prompt token's activations at once (the MLP's alone are
[batch, prompt, intermediate]), and a selection method sees the full-precision K/V of a whole
layer before choosing. Fed in chunks, each chunk's queries attend over what the cache holds
(`attend_chunk`) and causally over the chunk itself, then the cache absorbs the chunk
(`ingest_chunk`), compressing it as it would any new tokens. Peak activation memory follows the
chunk, not the prompt; the chunks run in one `lax.scan` inside jit (one compiled chunk step).

What each method does with a chunk (the semantics differ from a one-piece prefill, and the
quality difference is measured, README "Long prompts: chunked prefill"):
  - full: the chunk is stored; attention is exact, as in one piece. A sliding-window model's
    ring buffer keeps the last `window` tokens and each query sees only its window.
  - kivi, gear: whole blocks of `residual`/`block` tokens are quantized as they fill (the codes
    a one-piece ingest makes); later chunks attend over the quantized earlier ones.
  - streaming: sinks + the most recent `window` tokens; a chunk's queries see the held ones and
    the chunk's own earlier tokens.
  - snapkv, pyramidkv: after each chunk the held tokens and the chunk compete for the budget:
    attention of the chunk's last `window` queries (pooled along held-then-chunk order) picks
    the top tokens, and the last `window` tokens are kept. A prompt in one chunk is a plain
    SnapKV prefill. With a codec storage (`snapkv+kivi`) the candidates wait in a
    full-precision scratch of `budget` tokens and are encoded once, after the last chunk.
  - h2o_decode: every chunk query's attention is added to the scores of the tokens it sees
    (H2O's accumulation), then the lowest-scoring tokens outside the recent window go.
  - razor: retrieval heads store every chunk; the other heads keep sinks + the last `window`
    tokens in a full-precision buffer and add each token leaving the window to float32 sums,
    so the compensation token (the mean of every dropped token) is exact whatever the chunks.
    A chunk's queries on those heads see sinks, window and the compensation token so far;
    after the last chunk the storage receives what a one-piece ingest would give it.
  - duo: full heads store every chunk; streaming heads keep sinks + the last `recent` tokens,
    and a chunk's queries on them see those and the chunk's own earlier tokens.
h2o's one-shot scores over the whole prompt, and streaming with positions=in_cache (it
re-rotates its sinks at every step), refuse before anything is traced. A layer cache
may have `begin_chunks()` and `end_chunks()`, called before the first chunk and after the last.
"""

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache_protocol import check_count, check_prompt_width
from kvjax.cache_room import rows_room
from kvjax.decoder_protocol import decoder_vocab_size
from kvjax.layer_runs import (
  StackedLayerCaches,
  arrange_like,
  flatten_layer_caches,
  layer_cache_kinds,
)
from kvjax.prompt_batch import check_positions, check_token_array

# Cache methods whose layer caches take a prompt in chunks.
CHUNKED_PREFILL_METHODS = (
  "full",
  "kivi",
  "gear",
  "streaming",
  "snapkv",
  "pyramidkv",
  "h2o_decode",
  "razor",
  "duo",
)


def check_prefill_chunk(prefill_chunk) -> None:
  if prefill_chunk is None:
    return
  if not isinstance(prefill_chunk, (int, np.integer)) or isinstance(prefill_chunk, bool):
    raise ValueError(
      f"prefill_chunk={prefill_chunk!r} must be None (the prompt in one piece) or an int >= 1 "
      "(prompt tokens fed per chunk)"
    )
  if prefill_chunk < 1:
    raise ValueError(
      f"prefill_chunk={prefill_chunk} must be None (the prompt in one piece) or an int >= 1"
    )


def chunked_prefill_refusal(decoder, caches) -> str | None:
  """Why `decoder` with these layer caches (arrays or shape structs) cannot prefill in chunks,
  or None."""
  if not callable(getattr(decoder, "prefill_chunk", None)):
    return (
      f"the decoder {type(decoder).__qualname__} has no prefill_chunk(params, tokens, start, "
      "lengths, caches) (kvjax.decoder_protocol)"
    )
  for index, cache in layer_cache_kinds(caches):
    refusal = getattr(cache, "chunked_prefill_refusal", None)
    if refusal is None and not hasattr(cache, "ingest_chunk"):
      refusal = f"its {type(cache).__qualname__} cannot take a prompt in chunks"
    if refusal:
      return f"layer {index}: {refusal}"
  return None


def check_chunked_prefill(decoder, caches, prefill_chunk, *, method_name: str = "") -> None:
  """ValueError when `prefill_chunk` is set and the decoder or a layer cache cannot take it."""
  check_prefill_chunk(prefill_chunk)
  if prefill_chunk is None:
    return
  refusal = chunked_prefill_refusal(decoder, caches)
  if refusal is None:
    return
  if not callable(getattr(decoder, "prefill_chunk", None)):
    raise ValueError(
      f"prefill_chunk={prefill_chunk}: {refusal}, so it cannot prefill in chunks; implement it "
      "or pass prefill_chunk=None"
    )
  method = f"cache method {method_name!r}" if method_name else "this cache method"
  raise ValueError(
    f"prefill_chunk={prefill_chunk}: {method} cannot prefill in chunks ({refusal}); "
    f"methods that can: {', '.join(CHUNKED_PREFILL_METHODS)}; or prefill_chunk=None"
  )


def _check_caches_have_room(caches, fed: np.ndarray) -> None:
  """Every layer cache that keeps what it is fed up to a capacity must have room for each row's
  `fed` tokens: dense, KIVI, GEAR; StreamingLLM and h2o_decode allocated with fewer slots than
  their budget (which then report `room`: evicting there would keep less than the budget); duo
  and razor's full and retrieval heads (razor's compressed local heads hold a sinks-and-window
  buffer while the chunks come: `RazorLayerCache.chunk_room`). A chunk written past a capacity
  inside the scan would be lost, or evict what the method keeps. Caches that choose among the
  tokens they are fed (SnapKV, PyramidKV: `SelectedLayerCache.chunk_room` is None), a ring
  buffer and a cache at its budget (they evict by design) report no room."""
  room = rows_room(caches, _chunk_room)
  short = [] if room is None else np.flatnonzero(room < fed)
  if len(short):
    row = int(short[0])
    raise ValueError(
      f"lengths={fed.tolist()}: row {row} feeds {int(fed[row])} tokens, but its caches have "
      f"room for {int(room[row])} more (a chunk written past a cache's capacity would be "
      "lost); allocate them with prompt_len >= the tokens fed"
    )


def _chunk_room(cache) -> jax.Array | None:
  """int32 [batch]: the prompt tokens a layer cache takes in chunks: its `chunk_room` where it
  defines one (razor, selections), else its `room`."""
  if hasattr(type(cache), "chunk_room"):
    return cache.chunk_room
  return getattr(cache, "room", None)


def _check_offsets_continue_caches(caches, offsets: np.ndarray) -> None:
  """`offsets` must be the tokens each row's caches have seen: the chunk is stored after what
  a cache holds but rotated and masked by `offsets`, so a mismatch would silently misplace it.
  Checked where the caches count them (`tokens_seen`: dense, KIVI/GEAR, ring, StreamingLLM,
  h2o_decode; a selection holds fewer than it has seen and does not count them) and are
  concrete."""
  for index, cache in layer_cache_kinds(caches):
    seen = getattr(cache, "tokens_seen", None)
    if seen is None or isinstance(seen, jax.core.Tracer):
      continue
    seen = np.asarray(seen).reshape(-1, offsets.shape[0])  # a stacked run: [layers, batch]
    mismatch = np.argwhere(seen != offsets)  # (layer in the run, row), row-major
    if len(mismatch):
      layer, row = (int(i) for i in mismatch[np.argmin(mismatch[:, 1])])
      raise ValueError(
        f"offsets={offsets.tolist()}: row {row} continues at position {int(offsets[row])}, "
        f"but layer {index + layer}'s {type(cache).__name__} has seen {int(seen[layer, row])} "
        "tokens of it; pass the tokens each row's caches hold as offsets"
      )


def check_chunked_prefill_inputs(
  decoder, tokens, lengths, caches: tuple, *, chunk: int, offsets=None
) -> None:
  """`prefill_in_chunks`' checks, for a caller that runs it inside its own jit (where the checks
  on concrete values cannot run) to make first, on the concrete arguments."""
  check_count("chunk", chunk, 1)
  tokens = jnp.asarray(tokens)
  batch, prompt_len = tokens.shape
  if prompt_len < 1:
    raise ValueError(f"tokens must hold at least one column; got shape {tokens.shape}")
  check_positions(lengths, batch=batch, name="lengths")
  if offsets is not None:
    check_positions(offsets, batch=batch, name="offsets")
    for index, cache in layer_cache_kinds(caches):
      refusal = getattr(cache, "chunked_continuation_refusal", None)
      if refusal:
        raise ValueError(f"offsets: layer {index}: {refusal}")
  else:  # fresh caches: sized for a prompt no narrower than this one (as `ingest` checks)
    for _, cache in layer_cache_kinds(caches):
      allocated = getattr(cache, "allocated_prompt_len", None)
      check_prompt_width(f"prefill_in_chunks ({type(cache).__name__})", prompt_len, allocated)
  check_token_array(tokens, vocab_size=decoder_vocab_size(decoder), name="tokens")
  if not isinstance(lengths, jax.core.Tracer):
    if np.max(lengths, initial=0) > prompt_len:
      raise ValueError(
        f"lengths={np.asarray(lengths).tolist()} must each be <= {prompt_len} (tokens' width)"
      )
    if offsets is None and np.min(lengths, initial=1) < 1:
      # Fresh caches: a row of no token has no last token to predict from (its logits were
      # zeros, from which greedy decoding picks token 0).
      raise ValueError(
        f"lengths={np.asarray(lengths).tolist()} must each be >= 1 on fresh caches (a row "
        "with no token has nothing to predict from); pass offsets to continue caches"
      )
    _check_caches_have_room(caches, np.asarray(lengths))
    if offsets is not None and not isinstance(offsets, jax.core.Tracer):
      _check_offsets_continue_caches(caches, np.asarray(offsets))


def prefill_in_chunks(
  decoder,
  params,
  tokens: jax.Array,  # int32 [batch, prompt], right-padded
  lengths: jax.Array,  # int32 [batch]
  caches: tuple,  # freshly allocated, or holding `offsets[b]` tokens of row b
  *,
  chunk: int,
  offsets: jax.Array | None = None,  # int32 [batch]: position of each row's first token
) -> tuple[jax.Array, tuple]:  # (logits at each row's last prompt token [batch, vocab], caches)
  """The prompt fed `chunk` tokens at a time (traceable; see the module docstring). With
  `offsets`, the tokens continue caches that hold that many tokens per row (a row fed no token
  gets zero logits); caches that rebuild their storage when a chunked prompt ends (razor's
  compressed local heads, a selection over a codec storage) refuse them. The caches must have
  room for the prompt (allocate them for `prompt_len=tokens.shape[1]`): a chunk written past a
  cache's capacity inside the trace would be dropped, so concrete caches are checked first
  (those that keep what they are fed up to a capacity against each row's tokens, those sized
  from the prompt against its width, and with `offsets` those that count the tokens seen
  against them); token ids outside the decoder's vocabulary are refused where concrete."""
  check_chunked_prefill_inputs(decoder, tokens, lengths, caches, chunk=chunk, offsets=offsets)
  tokens = jnp.asarray(tokens)
  prompt_len = tokens.shape[1]
  if offsets is not None:
    offsets = jnp.asarray(offsets, jnp.int32)
  chunk = min(chunk, prompt_len)
  num_chunks = -(-prompt_len // chunk)
  padded = jnp.pad(tokens, ((0, 0), (0, num_chunks * chunk - prompt_len)))
  lengths = jnp.asarray(lengths, jnp.int32)
  last_chunk = (lengths - 1) // chunk  # the chunk holding each row's last prompt token

  def run_chunk(caches, index):
    start = (index * chunk).astype(jnp.int32)
    piece = jax.lax.dynamic_slice_in_dim(padded, start, chunk, axis=1)
    if offsets is None:
      return decoder.prefill_chunk(params, piece, start, lengths, caches)
    return decoder.prefill_chunk(params, piece, offsets + start, offsets + lengths, caches)

  caches = _each_layer(caches, "begin_chunks")
  # Every chunk runs in one scan (one compiled chunk step; fresh caches are not constants
  # there, which XLA would otherwise fold through the first chunk), so the carry starts in
  # the arrangement the decoder returns (stacked runs of look-alike layers).
  logits, returned = jax.eval_shape(run_chunk, caches, jnp.int32(0))
  carry = (jnp.zeros(logits.shape, logits.dtype), arrange_like(caches, returned))

  def step(carry, index):
    logits, caches = carry
    new_logits, caches = run_chunk(caches, index)
    logits = jnp.where((last_chunk == index)[:, None], new_logits, logits)
    return (logits, caches), None

  (logits, caches), _ = jax.lax.scan(step, carry, jnp.arange(num_chunks, dtype=jnp.int32))
  return logits, _each_layer(caches, "end_chunks")


def _each_layer(caches, hook: str) -> tuple:
  """Every layer cache's `hook()` where it has one (stacked runs: layer by layer, restacked)."""
  if not any(hasattr(cache, hook) for cache in flatten_layer_caches(caches)):
    return tuple(caches)
  call = lambda cache: getattr(cache, hook)() if hasattr(cache, hook) else cache
  arranged = []
  for item in caches:
    if isinstance(item, StackedLayerCaches):  # one layer at a time: one layer's temporaries
      arranged.append(StackedLayerCaches(jax.lax.map(call, item.stacked)))
    else:
      arranged.append(call(item))
  return tuple(arranged)
