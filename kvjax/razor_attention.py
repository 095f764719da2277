"""RazorAttention: retrieval heads keep every token; the other heads keep sinks + a local window +
one compensation token.

Per layer, the KV heads are split by a head profile (`kvjax.retrieval_heads.HeadProfile`,
computed once per model and loaded from `profile=PATH`):
  - retrieval heads: a storage cache of `prompt + max_new_tokens` tokens (nothing dropped);
  - the other ("local") heads: a storage cache of `budget + max_new_tokens` tokens, holding per
    row the first `sinks` tokens, one compensation token (key = mean of the dropped keys,
    value = mean of the dropped values), and the last `window = budget - sinks - 1` prompt
    tokens; decode tokens are appended after them.
The two groups live in separate caches with their own static head counts, so a local head
really holds only its window: `nbytes` is the sum of the parts.

Compensation (`compensation=`):
  - "mean" (default; Huawei's deployed code): the compensation token is an ordinary token of
    the local storage, so any storage (full, kivi, gear) composes.
  - "weighted" (the paper): the compensation token counts as the n tokens it replaces — its
    attention logit gets + log(n). It is kept beside the storage in the cache dtype with n per
    row, and merged with the storage's attention by log-sum-exp, which needs a storage that
    reports its log-sum-exp (`full`, or any layer cache with `attend_with_lse`).
A row is compressed when it has tokens to drop (length > sinks + window); shorter rows keep
every token. `budget` (tokens a local head keeps, sinks and compensation token included) or
`ratio` is a Python int at allocate time, from the padded (static) prompt length.
"""

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import attention_dispatch
from kvjax.cache_protocol import ModelCacheShape, tree_nbytes
from kvjax.dense_cache import DenseLayerCache, FullCache
from kvjax.method_registry import register_method
from kvjax.retrieval_heads import HeadProfile
from kvjax.selection.budgets import (
  check_budget_or_ratio,
  check_full_attention_model,
  check_storage_method,
  prompt_budget,
)
from pallas_kernels.decode_attention_reference import merge_attention_partials

COMPENSATIONS = ("mean", "weighted")
# Huawei's deployed default: 4 sinks + a local capacity of 256 including the compensation token.
RAZOR_DEFAULT_BUDGET = 260


def compress_local_heads(
  keys: jax.Array,  # [batch, heads, prompt, head_dim]
  values: jax.Array,  # [batch, heads, prompt, head_dim]
  lengths: jax.Array,  # int32 [batch]
  *,
  sinks: int,
  window: int,
  compensation_in_storage: bool,
) -> dict[str, jax.Array]:
  """Sinks + (compensation token) + window of each row, and the compensation token itself.

  Returns `kept_keys/kept_values [batch, heads, sinks + c + window, head_dim]` (c = 1 when the
  compensation token is stored among them, at slot `sinks`), `kept_lengths [batch]`,
  `compensation_keys/compensation_values float32 [batch, heads, head_dim]` (means of the dropped
  tokens, positions [sinks, length - window)) and `dropped_counts int32 [batch]`. A row with
  nothing to drop keeps its tokens in order and has dropped_counts 0.
  """
  prompt_len = keys.shape[2]
  dropped_counts = jnp.maximum(lengths - sinks - window, 0).astype(jnp.int32)
  compressed = dropped_counts > 0
  compensation_slots = 1 if compensation_in_storage else 0
  slots = jnp.arange(sinks + compensation_slots + window)[None, :]
  window_start = (lengths - window)[:, None]
  source = jnp.where(slots < sinks, slots, window_start + slots - sinks - compensation_slots)
  source = jnp.clip(jnp.where(compressed[:, None], source, slots), 0, prompt_len - 1)
  kept_keys = jnp.take_along_axis(keys, source[:, None, :, None], axis=2)
  kept_values = jnp.take_along_axis(values, source[:, None, :, None], axis=2)

  positions = jnp.arange(prompt_len)[None, :]
  dropped = ((positions >= sinks) & (positions < window_start)).astype(jnp.float32)  # [b, t]
  denominator = jnp.maximum(dropped_counts, 1).astype(jnp.float32)[:, None, None]
  compensation_keys = jnp.einsum("bhtd,bt->bhd", keys.astype(jnp.float32), dropped) / denominator
  compensation_values = (
    jnp.einsum("bhtd,bt->bhd", values.astype(jnp.float32), dropped) / denominator
  )
  if compensation_in_storage:
    put = lambda kept, token: kept.at[:, :, sinks].set(
      jnp.where(compressed[:, None, None], token.astype(kept.dtype), kept[:, :, sinks])
    )
    kept_keys = put(kept_keys, compensation_keys)
    kept_values = put(kept_values, compensation_values)
  kept_lengths = jnp.where(compressed, slots.shape[1], jnp.minimum(lengths, slots.shape[1]))
  return dict(
    kept_keys=kept_keys,
    kept_values=kept_values,
    kept_lengths=kept_lengths.astype(jnp.int32),
    compensation_keys=compensation_keys,
    compensation_values=compensation_values,
    dropped_counts=dropped_counts,
  )


def supports_lse(storage_cache) -> bool:
  return isinstance(storage_cache, DenseLayerCache) or callable(
    getattr(storage_cache, "attend_with_lse", None)
  )


def attend_with_lse(storage_cache, queries, *, sm_scale):
  """(out, lse [batch, heads, group]) of a storage cache, for merging with another segment."""
  if isinstance(storage_cache, DenseLayerCache):
    return attention_dispatch.decode_attention(
      queries,
      storage_cache.keys,
      storage_cache.values,
      storage_cache.lengths,
      sm_scale=sm_scale,
      implementation=storage_cache.implementation,
      kernel_config=storage_cache.kernel_settings.full_config(),
    )
  return storage_cache.attend_with_lse(queries, sm_scale=sm_scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RazorLayerCache:
  retrieval: Any  # storage cache of the retrieval heads [batch, r, prompt + new], or None
  local: Any  # storage cache of the other heads [batch, n, budget + new], or None
  compensation_keys: jax.Array | None  # [batch, n, head_dim] ("weighted" only)
  compensation_values: jax.Array | None  # [batch, n, head_dim] ("weighted" only)
  dropped_counts: jax.Array | None  # int32 [batch]: tokens the compensation token stands for
  retrieval_heads: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  local_heads: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  sinks: int = dataclasses.field(metadata=dict(static=True))
  window: int | None = dataclasses.field(metadata=dict(static=True))  # None: no compression
  compensation: str = dataclasses.field(default="mean", metadata=dict(static=True))

  @property
  def room(self) -> jax.Array | None:  # int32 [batch]: tokens every head's storage can take
    rooms = [part.room for part in (self.retrieval, self.local) if part is not None]
    return jnp.minimum(*rooms) if len(rooms) == 2 else rooms[0]

  def _split(self, x):  # heads on axis 1 -> (retrieval part, local part)
    take = lambda heads: x[:, np.asarray(heads)] if heads else None
    return take(self.retrieval_heads), take(self.local_heads)

  def ingest(self, keys, values, queries, lengths):
    del queries  # the split is fixed by the head profile
    lengths = lengths.astype(jnp.int32)
    (retrieval_keys, local_keys), (retrieval_values, local_values) = (
      self._split(keys),
      self._split(values),
    )
    updates = {}
    if self.retrieval is not None:
      updates["retrieval"] = self.retrieval.ingest(retrieval_keys, retrieval_values, None, lengths)
    if self.local is not None:
      if self.window is None:
        updates["local"] = self.local.ingest(local_keys, local_values, None, lengths)
      else:
        part = compress_local_heads(
          local_keys,
          local_values,
          lengths,
          sinks=self.sinks,
          window=self.window,
          compensation_in_storage=self.compensation == "mean",
        )
        updates["local"] = self.local.ingest(
          part["kept_keys"], part["kept_values"], None, part["kept_lengths"]
        )
        if self.compensation == "weighted":
          updates.update(
            compensation_keys=part["compensation_keys"].astype(self.compensation_keys.dtype),
            compensation_values=part["compensation_values"].astype(self.compensation_values.dtype),
            dropped_counts=part["dropped_counts"],
          )
    return dataclasses.replace(self, **updates)

  def append(self, keys, values):
    (retrieval_keys, local_keys), (retrieval_values, local_values) = (
      self._split(keys),
      self._split(values),
    )
    updates = {}
    if self.retrieval is not None:
      updates["retrieval"] = self.retrieval.append(retrieval_keys, retrieval_values)
    if self.local is not None:
      updates["local"] = self.local.append(local_keys, local_values)
    return dataclasses.replace(self, **updates)

  def _attend_local(self, queries, sm_scale):
    if self.compensation_keys is None:
      return self.local.attend(queries, sm_scale=sm_scale)
    out, lse = attend_with_lse(self.local, queries, sm_scale=sm_scale)
    # The compensation token as one segment whose logit counts its n tokens: s + log n.
    logits = (
      jnp.einsum(
        "bhgd,bhd->bhg", queries.astype(jnp.float32), self.compensation_keys.astype(jnp.float32)
      )
      * sm_scale
    )
    counts = self.dropped_counts[:, None, None]
    compensation_lse = jnp.where(
      counts > 0, logits + jnp.log(jnp.maximum(counts, 1).astype(jnp.float32)), -jnp.inf
    )
    compensation_out = jnp.broadcast_to(
      self.compensation_values.astype(jnp.float32)[:, :, None, :], out.shape
    )
    merged, _ = merge_attention_partials([(out, lse), (compensation_out, compensation_lse)])
    return merged

  def attend(self, queries, *, sm_scale):
    retrieval_queries, local_queries = self._split(queries)
    outs = []
    if self.retrieval is not None:
      outs.append(self.retrieval.attend(retrieval_queries, sm_scale=sm_scale))
    if self.local is not None:
      outs.append(self._attend_local(local_queries, sm_scale))
    if not (self.retrieval_heads and self.local_heads):
      return outs[0]
    restore = np.argsort(np.asarray(self.retrieval_heads + self.local_heads))
    return jnp.concatenate(outs, axis=1)[:, restore]

  @property
  def compensation_nbytes(self) -> int:
    return tree_nbytes((self.compensation_keys, self.compensation_values, self.dropped_counts))

  @property
  def nbytes(self) -> int:
    parts = [p.nbytes for p in (self.retrieval, self.local) if p is not None]
    return sum(parts) + self.compensation_nbytes

  @property
  def stored_elements(self) -> int:
    parts = [p.stored_elements for p in (self.retrieval, self.local) if p is not None]
    extra = sum(x.size for x in (self.compensation_keys, self.compensation_values) if x is not None)
    return sum(parts) + extra


def _load_profile(profile) -> HeadProfile:
  if isinstance(profile, HeadProfile):
    return profile
  if profile is None:
    raise ValueError(
      "razor: profile=<head profile JSON> is required; compute it once per model with "
      "`kvjax razor-profile` (kvjax.retrieval_heads.compute_head_profile)"
    )
  if not isinstance(profile, (str, os.PathLike)):
    raise ValueError(f"razor: profile={profile!r} must be a file path or a HeadProfile")
  return HeadProfile.load(profile)


@register_method("razor", kind="selection")
@dataclasses.dataclass(frozen=True)
class RazorAttention:
  """Cache method `razor` (module docstring).

  `profile`: path of the model's head profile JSON (or a `HeadProfile`); `budget`: prompt
  tokens a non-retrieval head keeps, sinks and compensation token included (default 260 when
  neither `budget` nor `ratio` is given); `ratio`: that budget as a fraction of the padded
  prompt; `sinks` (default 4); `compensation`: "mean" | "weighted".
  """

  profile: str | HeadProfile | None = None
  budget: int | None = None
  ratio: float | None = None
  sinks: int = 4
  compensation: str = "mean"
  storage: Any = FullCache()
  head_profile: HeadProfile = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    if self.sinks < 0:
      raise ValueError(f"razor: sinks={self.sinks} must be >= 0")
    check_budget_or_ratio(
      "razor",
      self.budget,
      self.ratio,
      minimum=self.sinks + 2,
      minimum_what="sinks + a window of 1 + the compensation token",
    )
    if self.compensation not in COMPENSATIONS:
      raise ValueError(
        f"razor: compensation={self.compensation!r}; allowed: {', '.join(COMPENSATIONS)}"
      )
    check_storage_method("razor", self.storage)
    object.__setattr__(self, "head_profile", _load_profile(self.profile))

  def prompt_budget(self, prompt_len: int) -> int:
    budget = self.budget
    if budget is None and self.ratio is None:
      budget = RAZOR_DEFAULT_BUDGET
    return prompt_budget(
      "razor",
      budget,
      self.ratio,
      prompt_len,
      minimum=self.sinks + 2,
      minimum_what="sinks + a window of 1 + the compensation token",
    )

  def allocate(self, shape: ModelCacheShape, layer, *, batch, prompt_len, max_new_tokens, dtype):
    named = f" {self.profile!r}" if isinstance(self.profile, str) else ""
    self.head_profile.check_matches(shape, source=f"razor: head profile{named}")
    check_full_attention_model(shape, "razor", prompt_len + max_new_tokens)
    retrieval_heads = self.head_profile.retrieval_heads_of_layer(layer)
    local_heads = tuple(h for h in range(shape.num_kv_heads) if h not in retrieval_heads)
    kept = self.prompt_budget(prompt_len)
    compress = kept < prompt_len
    weighted = compress and self.compensation == "weighted"
    # "weighted" keeps the compensation token beside the storage, so the storage holds one less.
    local_prompt_slots = (kept - 1 if weighted else kept) if compress else prompt_len

    def storage(heads, capacity):
      if not heads:
        return None
      return self.storage.allocate_storage(
        batch=batch,
        kv_heads=len(heads),
        capacity=capacity,
        head_dim=shape.head_dim,
        dtype=dtype,
      )

    local = storage(local_heads, local_prompt_slots + max_new_tokens)
    if weighted and local is not None and not supports_lse(local):
      raise ValueError(
        f"razor: compensation=weighted needs a storage that reports its log-sum-exp (full, "
        f"or a cache with attend_with_lse); {type(local).__name__} does not: use "
        "compensation=mean with this storage"
      )
    compensation_shape = (batch, len(local_heads), shape.head_dim)
    with_compensation = weighted and local is not None
    return RazorLayerCache(
      retrieval=storage(retrieval_heads, prompt_len + max_new_tokens),
      local=local,
      compensation_keys=jnp.zeros(compensation_shape, dtype) if with_compensation else None,
      compensation_values=jnp.zeros(compensation_shape, dtype) if with_compensation else None,
      dropped_counts=jnp.zeros((batch,), jnp.int32) if with_compensation else None,
      retrieval_heads=retrieval_heads,
      local_heads=local_heads,
      sinks=self.sinks,
      window=kept - self.sinks - 1 if compress else None,
      compensation=self.compensation,
    )
