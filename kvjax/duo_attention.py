"""DuoAttention: full heads keep every token; streaming heads keep sinks + recent tokens.

Per layer, the KV heads are split by trained gates (`kvjax.duo_gate_profile.DuoGateProfile`,
trained once per model by `kvjax duo-train` and loaded from `profile=PATH`): the heads of the
largest gates, `full_fraction` of all KV heads (default: the authors' 50% for grouped-query
models, 25% for multi-head ones), keep a storage cache of `prompt + max_new_tokens` tokens
(full precision, or `+kivi`/`+gear`); the others are streaming heads holding the first `sinks`
tokens and the last `recent` in a StreamingLLM sink + ring buffer (`kvjax.streaming_llm`), also
while decoding, so their memory stays at `sinks + recent` tokens however long the generation.
The two groups live in separate caches with their own static head counts: `nbytes` is the sum.

As the authors deploy it, and as the gates were trained, a streaming head attends to its sinks
and recent tokens in the prompt too (`prompt_attention`, used by a one-piece prefill); keys keep
the rotation of their original positions. In a chunked prefill, a streaming head's chunk attends
over the sinks and window it holds and the chunk itself.
"""

import dataclasses
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from kvjax import attention_dispatch
from kvjax.cache_protocol import ModelCacheShape, check_prompt_width
from kvjax.dense_cache import FullCache
from kvjax.duo_gate_profile import DuoGateProfile, check_full_fraction, default_full_fraction
from kvjax.head_split import join_head_partials, join_heads, split_heads
from kvjax.kernel_settings import DEFAULT_KERNEL_SETTINGS, KernelSettings
from kvjax.method_registry import register_method
from kvjax.prefill_attention import causal_prompt_attention
from kvjax.selection.budgets import (
  check_full_attention_model,
  check_method_int,
  check_storage_method,
)
from kvjax.streaming_llm import StreamingLayerCache, StreamingLLM


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DuoLayerCache:
  full: Any  # storage cache of the full heads [batch, f, prompt + new], or None
  streaming: StreamingLayerCache | None  # the other heads [batch, s, sinks + recent], or None
  full_heads: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  streaming_heads: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  # The streaming heads' span in the prompt (sinks, recent): the buffer may be smaller when the
  # prompt and the new tokens fit in less.
  sinks: int = dataclasses.field(metadata=dict(static=True))
  recent: int = dataclasses.field(metadata=dict(static=True))
  # The prompt_len it was allocated for where that sized the streaming heads' slots (fewer
  # than sinks + recent): a wider prompt is refused (`check_prompt_width`). None elsewhere.
  allocated_prompt_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  @property
  def _parts(self):
    return [part for part in (self.full, self.streaming) if part is not None]

  @property
  def room(self) -> jax.Array | None:  # int32 [batch]: tokens every head's cache can take
    rooms = [part.room for part in self._parts if part.room is not None]
    if not rooms:
      return None
    return jnp.minimum(*rooms) if len(rooms) == 2 else rooms[0]

  def _split(self, x):  # heads on axis 1 -> (full part, streaming part)
    return split_heads(x, self.full_heads, self.streaming_heads)

  def _join(self, full_part, streaming_part):
    return join_heads(full_part, streaming_part, self.full_heads, self.streaming_heads)

  def prompt_attention(self, queries, keys, values, lengths, *, sm_scale, sliding_window):
    """Full heads attend causally, streaming heads over the first `sinks` and last `recent`."""
    del lengths, sliding_window  # causal; allocate refused sliding-window models
    return causal_prompt_attention(
      queries,
      keys,
      values,
      sm_scale=sm_scale,
      streaming_heads=tuple(h in self.streaming_heads for h in range(keys.shape[1])),
      sinks=self.sinks,
      recent=self.recent,
    )

  def _each(self, method: str, keys, values, *args):
    (full_keys, streaming_keys), (full_values, streaming_values) = (
      self._split(keys),
      self._split(values),
    )
    updates = {}
    if self.full is not None:
      updates["full"] = getattr(self.full, method)(full_keys, full_values, *args)
    if self.streaming is not None:
      updates["streaming"] = getattr(self.streaming, method)(
        streaming_keys, streaming_values, *args
      )
    return dataclasses.replace(self, **updates)

  def ingest(self, keys, values, queries, lengths):
    del queries  # the split is fixed by the gates
    check_prompt_width("duo", keys.shape[2], self.allocated_prompt_len)
    return self._each("ingest", keys, values, None, lengths.astype(jnp.int32))

  @property
  def chunked_prefill_refusal(self) -> str | None:
    for part in self._parts:
      refusal = getattr(part, "chunked_prefill_refusal", None)
      if refusal is None and not hasattr(part, "ingest_chunk"):
        refusal = f"duo's storage {type(part).__name__} cannot take a prompt in chunks"
      if refusal:
        return refusal
    return None

  def ingest_chunk(self, keys, values, queries, counts):
    del queries
    return self._each("ingest_chunk", keys, values, None, counts)

  def attend_chunk(self, queries, *, sm_scale):
    """(out, lse) of a chunk's queries over what each head holds."""
    full_queries, streaming_queries = self._split(queries)
    return join_head_partials(
      None if self.full is None else self.full.attend_chunk(full_queries, sm_scale=sm_scale),
      None
      if self.streaming is None
      else self.streaming.attend_chunk(streaming_queries, sm_scale=sm_scale),
      self.full_heads,
      self.streaming_heads,
    )

  def append(self, keys, values):
    return self._each("append", keys, values)

  def attend(self, queries, *, sm_scale):
    full_queries, streaming_queries = self._split(queries)
    return self._join(
      None if self.full is None else self.full.attend(full_queries, sm_scale=sm_scale),
      None
      if self.streaming is None
      else self.streaming.attend(streaming_queries, sm_scale=sm_scale),
    )

  def attend_with_lse(self, queries, *, sm_scale):
    """(out, lse) of one query position per row, each head over what it holds."""
    full_queries, streaming_queries = self._split(queries)
    return join_head_partials(
      None if self.full is None else self.full.attend_with_lse(full_queries, sm_scale=sm_scale),
      None
      if self.streaming is None
      else self.streaming.attend_with_lse(streaming_queries, sm_scale=sm_scale),
      self.full_heads,
      self.streaming_heads,
    )

  @property
  def nbytes(self) -> int:
    return sum(part.nbytes for part in self._parts)

  @property
  def stored_elements(self) -> int:
    return sum(part.stored_elements for part in self._parts)


@register_method("duo", kind="selection")
@dataclasses.dataclass(frozen=True)
class DuoAttention:
  """Cache method `duo` (module docstring).

  `profile`: path of the model's gate file (or a `DuoGateProfile`); `full_fraction`: the
  fraction of all KV heads that keep the full cache (default None: 0.5 for grouped-query
  models, 0.25 for multi-head ones); `sinks` (default 64) and `recent` (default 256): what a
  streaming head keeps. `storage` stores the full heads (`duo:...+kivi:bits=2`).
  """

  # Where the gates came from: two paths to equal gates are one method (`gate_profile`).
  profile: str | DuoGateProfile | None = dataclasses.field(default=None, compare=False)
  full_fraction: float | None = None
  sinks: int = 64
  recent: int = 256
  implementation: str = "auto"
  kernel_settings: KernelSettings = DEFAULT_KERNEL_SETTINGS
  storage: Any = FullCache()
  # Compared and hashed with the rest: the method is a static argument of jit, and a gate file
  # rewritten under the same path must not reuse the programs compiled for the old heads.
  gate_profile: DuoGateProfile = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    check_method_int("duo", "sinks", self.sinks, 0)
    check_method_int("duo", "recent", self.recent, 1)
    if self.full_fraction is not None:
      check_full_fraction(self.full_fraction)
    attention_dispatch.check_implementation(self.implementation)
    check_storage_method("duo", self.storage)
    object.__setattr__(
      self, "gate_profile", DuoGateProfile.from_method_argument("duo", self.profile)
    )
    self._warn_of_another_span_than_trained()

  def _warn_of_another_span_than_trained(self) -> None:
    """Gates rank heads by how well sinks + recent of the trained sizes stand in for them;
    deployed with other sizes they may rank them wrongly. Allowed (an experiment may want it),
    not silent."""
    trained = dict(self.gate_profile.training)
    differing = [
      f"{name}={getattr(self, name)} (trained with {trained[name]})"
      for name in ("sinks", "recent")
      if name in trained and trained[name] != getattr(self, name)
    ]
    if differing:
      warnings.warn(
        f"duo: {', '.join(differing)}: the gates were trained for streaming heads of other "
        "sizes; give the trained sizes to deploy them as trained",
        # Point at the caller: past kvjax's frames and dataclasses' generated __init__ (file
        # "<string>"; CPython 3.12's prefix test leaves out a filename's last character, so the
        # prefix is "<string").
        skip_file_prefixes=(os.path.dirname(__file__) + os.sep, "<string"),
      )

  @property
  def profile_path(self) -> str | None:
    """The file the gates were read from (None for a `DuoGateProfile` given directly)."""
    return os.fspath(self.profile) if isinstance(self.profile, (str, os.PathLike)) else None

  def full_heads_of_layer(self, shape: ModelCacheShape, layer: int) -> tuple[int, ...]:
    fraction = default_full_fraction(shape) if self.full_fraction is None else self.full_fraction
    return tuple(h for at, h in self.gate_profile.full_heads(fraction) if at == layer)

  def allocate(self, shape: ModelCacheShape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    named = f" {self.profile_path!r}" if self.profile_path is not None else ""
    self.gate_profile.check_matches(shape, source=f"duo: gate file{named}")
    # Streaming heads reach their sinks past any sliding window.
    check_full_attention_model(shape, "duo", prompt_len + max_new_tokens)
    full_heads = self.full_heads_of_layer(shape, layer)
    streaming_heads = tuple(h for h in range(shape.num_kv_heads) if h not in full_heads)
    full = streaming = None
    if full_heads:
      full = self.storage.allocate_storage(
        batch=batch,
        kv_heads=len(full_heads),
        capacity=prompt_len + max_new_tokens,
        head_dim=shape.head_dim,
        dtype=dtype,
      )
    if streaming_heads:
      budget = self.sinks + self.recent
      streaming_method = StreamingLLM(budget=budget, sinks=self.sinks)
      slots = streaming_method.slots(prompt_len, max_new_tokens)
      sinks = min(self.sinks, slots)
      streaming = StreamingLayerCache.zeros(
        batch=batch,
        kv_heads=len(streaming_heads),
        sinks=sinks,
        window=slots - sinks,
        head_dim=shape.head_dim,
        dtype=dtype,
        implementation=self.implementation,
        kernel_settings=self.kernel_settings,
        evicts_when_full=slots >= budget,
      )
    return DuoLayerCache(
      full=full,
      streaming=streaming,
      full_heads=full_heads,
      streaming_heads=streaming_heads,
      sinks=self.sinks,
      recent=self.recent,
      # Sized by the prompt where the streaming heads' slots are fewer than sinks + recent.
      allocated_prompt_len=prompt_len
      if streaming is not None and not streaming.evicts_when_full
      else None,
    )
