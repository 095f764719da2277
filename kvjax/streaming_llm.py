"""StreamingLLM: attention sinks + a window of the most recent tokens, evicting while decoding.

The cache holds `budget` slots per KV head, or fewer if the whole prompt plus the new tokens
fit; such a smaller cache reports its `room` and refuses more tokens than it was allocated for
rather than evict down to less than the budget. Slots [0, sinks) hold the first `sinks` tokens
for ever, slots [sinks, budget) are a ring buffer where token p >= sinks lives in slot sinks +
(p - sinks) % window, window = budget - sinks. Ingest keeps the sinks and the last `window`
prompt tokens; every append overwrites the oldest non-sink token once the ring is full. Memory
is `budget` tokens whatever the length.

Positions (`positions=`):
  - "original" (default): keys keep the RoPE rotation of their original position, as the model
    computed them; the query is at its original position too.
  - "in_cache": the authors' scheme, where attention sees cached tokens at their in-cache
    positions 0..n-1 and the query at n-1. Recent tokens and the query all shift by the same
    amount (the number of evicted tokens), which leaves their relative distances unchanged, so
    only the sinks move: at attend time the sink keys are rotated forward by the number of
    evicted tokens. This needs the model's RoPE frequencies, so `rope_theta` must be given
    (Hugging Face "rotate half" layout). A decoder whose `cache_shape` gives its RoPE has
    `rope_theta` checked against it and its Llama-3 frequency scaling applied; one that does
    not is rotated with plain RoPE at `rope_theta`.
Prefill attention is the model's own (full causal attention at original positions) either way.
"""

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import attention_dispatch
from kvjax.cache_protocol import KeyValueArrays, ModelCacheShape, check_prompt_width
from kvjax.chunk_attention import attend_chunk_over_slots
from kvjax.compact_rows import write_token_at_lengths
from kvjax.dense_cache import FullCache
from kvjax.kernel_settings import DEFAULT_KERNEL_SETTINGS, KernelSettings
from kvjax.method_registry import register_method
from kvjax.rope import RopeScaling, rope_inverse_frequencies, rotate_by_positions
from kvjax.selection.budgets import (
  budget_while_decoding,
  check_budget_or_ratio,
  check_full_attention_model,
  check_method_int,
)
from kvjax.sliding_window_cache import ring_source_positions

POSITION_MODES = ("original", "in_cache")


def check_rope_matches_model(rope_theta: float, shape: ModelCacheShape) -> None:
  """Sinks re-rotated with another base than the model's would sit at wrong positions."""
  if shape.rope_theta is not None and not math.isclose(rope_theta, shape.rope_theta, rel_tol=1e-6):
    raise ValueError(
      f"streaming: rope_theta={rope_theta} differs from the model's RoPE base "
      f"{shape.rope_theta}; positions=in_cache must rotate keys as the model does"
    )


def streaming_source_positions(
  lengths: jax.Array,  # int32 [batch]: tokens seen
  *,
  sinks: int,
  window: int,
) -> tuple[jax.Array, jax.Array]:
  """For each slot, the token position it holds: `(positions [batch, sinks + window], valid)`."""
  sink_positions = jnp.broadcast_to(jnp.arange(sinks), (lengths.shape[0], sinks))
  sink_valid = sink_positions < lengths[:, None]
  if window == 0:
    return sink_positions, sink_valid
  ring_positions, ring_valid = ring_source_positions(jnp.maximum(lengths - sinks, 0), window)
  return (
    jnp.concatenate([sink_positions, ring_positions + sinks], axis=1),
    jnp.concatenate([sink_valid, ring_valid], axis=1),
  )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamingLayerCache(KeyValueArrays):
  keys: jax.Array  # [batch, kv_heads, sinks + window, head_dim]
  values: jax.Array  # [batch, kv_heads, sinks + window, head_dim]
  lengths: jax.Array  # int32 [batch]: tokens seen so far (may exceed the slots)
  sinks: int = dataclasses.field(metadata=dict(static=True))
  rope_theta: float | None = dataclasses.field(default=None, metadata=dict(static=True))
  rope_scaling: RopeScaling | None = dataclasses.field(default=None, metadata=dict(static=True))
  implementation: str = dataclasses.field(default="auto", metadata=dict(static=True))
  kernel_settings: KernelSettings = dataclasses.field(
    default=DEFAULT_KERNEL_SETTINGS, metadata=dict(static=True)
  )
  # False when the slots are fewer than the method's budget (the prompt and the new tokens fit
  # in less): evicting there would keep fewer tokens than the budget, so the cache is bounded.
  evicts_when_full: bool = dataclasses.field(default=True, metadata=dict(static=True))
  # The prompt_len it was allocated for where that sized its slots (fewer than the budget, or
  # a budget that is a ratio of it): a wider prompt is refused (`check_prompt_width`). None
  # where they do not depend on it.
  allocated_prompt_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  @classmethod
  def zeros(
    cls,
    *,
    batch,
    kv_heads,
    sinks,
    window,
    head_dim,
    dtype,
    rope_theta=None,
    rope_scaling=None,
    implementation="auto",
    kernel_settings=DEFAULT_KERNEL_SETTINGS,
    evicts_when_full=True,
    allocated_prompt_len=None,
  ):
    shape = (batch, kv_heads, sinks + window, head_dim)
    return cls(
      keys=jnp.zeros(shape, dtype),
      values=jnp.zeros(shape, dtype),
      lengths=jnp.zeros((batch,), jnp.int32),
      sinks=sinks,
      rope_theta=rope_theta,
      rope_scaling=rope_scaling,
      implementation=implementation,
      kernel_settings=kernel_settings,
      evicts_when_full=evicts_when_full,
      allocated_prompt_len=allocated_prompt_len,
    )

  @property
  def slots(self) -> int:
    return self.keys.shape[2]

  @property
  def window(self) -> int:
    return self.slots - self.sinks

  @property
  def room(self) -> jax.Array | None:  # int32 [batch], or None once the cache holds its budget
    return None if self.evicts_when_full else self.slots - self.lengths

  @property
  def tokens_seen(self) -> jax.Array:  # int32 [batch]: the position of each row's next token
    return self.lengths

  def ingest(self, keys, values, queries, lengths):
    del queries  # the choice depends on positions only
    check_prompt_width("streaming", keys.shape[2], self.allocated_prompt_len)
    lengths = lengths.astype(jnp.int32)
    positions, valid = streaming_source_positions(lengths, sinks=self.sinks, window=self.window)
    gather_at = jnp.clip(positions, 0, keys.shape[2] - 1)[:, None, :, None]

    def gather(x):
      taken = jnp.take_along_axis(x, gather_at, axis=2)
      return jnp.where(valid[:, None, :, None], taken, 0).astype(self.keys.dtype)

    return dataclasses.replace(self, keys=gather(keys), values=gather(values), lengths=lengths)

  def _slot_of(self, positions: jax.Array) -> jax.Array:
    """The slot a token at `positions` is written to. Sinks fill first; after them the ring
    overwrites its oldest token. When the slots can hold every token ever seen (window may
    then be 0) this is a plain append."""
    ring_slot = self.sinks + jnp.mod(positions - self.sinks, max(self.window, 1))
    return jnp.where(positions < self.sinks, positions, ring_slot)

  def append(self, keys, values):
    slot = self._slot_of(self.lengths)
    return dataclasses.replace(
      self,
      keys=write_token_at_lengths(self.keys, keys, slot),
      values=write_token_at_lengths(self.values, values, slot),
      lengths=self.lengths + 1,
    )

  @property
  def chunked_prefill_refusal(self) -> str | None:
    if self.rope_theta is not None:
      return (
        "streaming with positions=in_cache re-rotates its sinks at every step; chunked "
        "prefill supports positions=original"
      )
    return None

  def ingest_chunk(self, keys, values, queries, counts):
    """Stores the first `counts[b]` tokens of a prompt chunk where `append` would have left
    them: sinks first, then the ring; only the tokens still held afterwards are written."""
    del queries
    positions = self.lengths[:, None] + jnp.arange(keys.shape[2])[None, :]  # [batch, chunk]
    seen = (self.lengths + counts)[:, None]
    kept = (positions < seen) & ((positions < self.sinks) | (positions >= seen - self.window))
    slot = jnp.where(kept, self._slot_of(positions), self.slots)
    return self.with_chunk_written(keys, values, slot, counts)

  def attend_chunk(self, queries, *, sm_scale):
    """(out, lse) of a prompt chunk's queries over the sinks and the window held."""
    return attend_chunk_over_slots(
      queries, self.keys, self.values, jnp.minimum(self.lengths, self.slots), sm_scale=sm_scale
    )

  def attend(self, queries, *, sm_scale):
    return self.attend_with_lse(queries, sm_scale=sm_scale)[0]

  def attend_with_lse(self, queries, *, sm_scale):
    """(out, lse) of one query position per row over the sinks and the window."""
    keys = self.keys
    if self.rope_theta is not None and self.sinks > 0:
      # In-cache positions: only the sinks move, forward by the number of evicted tokens.
      evicted = jnp.maximum(self.lengths - self.slots, 0)
      inv_freq = rope_inverse_frequencies(keys.shape[-1], self.rope_theta, self.rope_scaling)
      moved_sinks = rotate_by_positions(keys[:, :, : self.sinks], evicted, inv_freq)
      # A concatenation, not `keys.at[:, :, :sinks].set(...)`: XLA's CPU compiler (jax
      # 0.12.0.1) miscompiled that update followed by the attention's product at batch 1
      # (scores off by up to 2.8 against the same function run eagerly).
      keys = jnp.concatenate([moved_sinks.astype(keys.dtype), keys[:, :, self.sinks :]], axis=2)
    return attention_dispatch.decode_attention(
      queries,
      keys,
      self.values,
      jnp.minimum(self.lengths, self.slots),
      sm_scale=sm_scale,
      implementation=self.implementation,
      kernel_config=self.kernel_settings.full_config(),
      kernel_backend=self.kernel_settings.kernel_backend,
    )


@register_method("streaming", kind="selection")
@dataclasses.dataclass(frozen=True)
class StreamingLLM:
  """Cache method `streaming`: `sinks` first tokens + the most recent tokens (module docstring).

  `budget`: tokens each KV head holds, sinks included (default 1024 when neither `budget` nor
  `ratio` is given), at prefill and during decoding alike; `ratio`: that budget as a fraction
  of the padded (static) prompt length. `positions`: "original" | "in_cache" (the latter
  needs `rope_theta`, the model's RoPE base). Stores its own sink + ring buffer: composing it
  with a codec storage is not supported.
  """

  budget: int | None = None
  ratio: float | None = None
  sinks: int = 4
  positions: str = "original"
  rope_theta: float | None = None
  implementation: str = "auto"
  kernel_settings: KernelSettings = DEFAULT_KERNEL_SETTINGS
  storage: Any = FullCache()

  def __post_init__(self):
    check_method_int("streaming", "sinks", self.sinks, 0)
    check_budget_or_ratio(
      "streaming",
      self.budget,
      self.ratio,
      minimum=self.sinks + 1,
      minimum_what="sinks + a window of 1",
    )
    if self.positions not in POSITION_MODES:
      raise ValueError(
        f"streaming: positions={self.positions!r}; allowed: {', '.join(POSITION_MODES)}"
      )
    if self.positions == "in_cache" and self.rope_theta is None:
      raise ValueError(
        "streaming: positions=in_cache re-rotates keys and needs rope_theta=<the model's RoPE "
        f"base, e.g. 10000.0> (got rope_theta={self.rope_theta})"
      )
    if self.rope_theta is not None and not (
      isinstance(self.rope_theta, numbers.Real)
      and not isinstance(self.rope_theta, bool)
      and math.isfinite(self.rope_theta)
      and self.rope_theta > 0
    ):
      # A NaN or infinite base would rotate the sinks to NaN or not at all, silently.
      raise ValueError(
        f"streaming: rope_theta={self.rope_theta!r}; it must be a finite number > 0 (the "
        "model's RoPE base, e.g. 10000.0)"
      )
    if self.positions == "original" and self.rope_theta is not None:
      raise ValueError("streaming: rope_theta is only used with positions=in_cache")
    attention_dispatch.check_implementation(self.implementation)
    if type(self.storage) is not FullCache:
      raise ValueError(
        f"streaming: storage {getattr(self.storage, 'method_name', self.storage)!r} is not "
        "supported: StreamingLLM evicts while decoding from its own sink + ring buffer, which "
        "codec storages do not implement; use streaming alone"
      )

  def budget_tokens(self, prompt_len: int) -> int:
    """Tokens each KV head holds at most (before capping at prompt + new tokens): at least the
    sinks and one recent token, even when `ratio` of a prompt no longer than the sinks is less
    (a cache of sinks only would drop every new token, unseen by its own query)."""
    tokens = budget_while_decoding(
      "streaming",
      self.budget,
      self.ratio,
      prompt_len,
      minimum=self.sinks + 1,
      minimum_what="sinks + a window of 1",
    )
    return max(tokens, self.sinks + 1)

  def slots(self, prompt_len: int, max_new_tokens: int) -> int:
    """Token slots per KV head: the budget, or fewer when prompt + new tokens fit in less."""
    return min(self.budget_tokens(prompt_len), prompt_len + max_new_tokens)

  def allocate(self, shape: ModelCacheShape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    del layer
    # Its sinks, and a chunk's queries over the held window, reach past a sliding window
    # however few slots it has: only a generation inside the window is exact.
    check_full_attention_model(shape, "streaming", prompt_len + max_new_tokens)
    in_cache = self.positions == "in_cache"
    if in_cache:
      check_rope_matches_model(self.rope_theta, shape)
    slots = self.slots(prompt_len, max_new_tokens)
    budget = self.budget_tokens(prompt_len)
    sinks = min(self.sinks, slots)
    return StreamingLayerCache.zeros(
      batch=batch,
      kv_heads=shape.num_kv_heads,
      sinks=sinks,
      window=slots - sinks,
      head_dim=shape.head_dim,
      dtype=dtype,
      rope_theta=self.rope_theta if in_cache else None,
      rope_scaling=shape.rope_scaling if in_cache else None,
      implementation=self.implementation,
      kernel_settings=self.kernel_settings,
      evicts_when_full=slots >= budget,
      allocated_prompt_len=prompt_len if self.ratio is not None or slots < budget else None,
    )
