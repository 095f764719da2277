"""The layer cache of a prefill-time token selection: chosen tokens only, in an inner storage cache.

At `ingest` a *selector* (static configuration: SnapKV's observation window, H2O's accumulated
attention) picks `budget` tokens per KV head; their K/V are gathered (in original order) and
handed to the inner storage cache, which was allocated with room for exactly
`budget + max_new_tokens` tokens. Decoding appends and attends through the inner cache, so a
codec storage (`kivi`, `gear`) composes unchanged and the bytes are those of the kept tokens.
"""

import dataclasses
from typing import Any, Protocol

import jax

from kvjax.cache_protocol import ModelCacheShape
from kvjax.selection.budgets import check_full_attention_model
from kvjax.selection.token_choice import gather_tokens


class TokenSelector(Protocol):
  """Hashable static configuration that picks each KV head's kept prompt tokens."""

  budget: int  # prompt tokens kept per KV head (static)

  def kept_indices(
    self,
    keys: jax.Array,  # [batch, kv_heads, prompt, head_dim]
    queries: jax.Array,  # [batch, kv_heads, group, prompt, head_dim]
    lengths: jax.Array,  # int32 [batch]
  ) -> tuple[jax.Array, jax.Array]:  # (int32 [batch, kv_heads, budget] ascending, int32 [batch])
    ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SelectedLayerCache:
  storage: Any  # inner layer cache with capacity budget + max_new_tokens
  selector: Any = dataclasses.field(metadata=dict(static=True))  # a TokenSelector

  @property
  def lengths(self) -> jax.Array:  # int32 [batch]: tokens held per row
    return self.storage.lengths

  @property
  def room(self) -> jax.Array | None:  # int32 [batch], or None when the storage evicts
    return getattr(self.storage, "room", None)

  def ingest(self, keys, values, queries, lengths):
    if self.selector.budget >= keys.shape[2]:
      # The budget covers the whole prompt: nothing to score, keep every token.
      return dataclasses.replace(self, storage=self.storage.ingest(keys, values, None, lengths))
    indices, kept_lengths = self.selector.kept_indices(keys, queries, lengths)
    storage = self.storage.ingest(
      gather_tokens(keys, indices), gather_tokens(values, indices), None, kept_lengths
    )
    return dataclasses.replace(self, storage=storage)

  def append(self, keys, values):
    return dataclasses.replace(self, storage=self.storage.append(keys, values))

  def attend(self, queries, *, sm_scale):
    return self.storage.attend(queries, sm_scale=sm_scale)

  @property
  def nbytes(self) -> int:
    return self.storage.nbytes

  @property
  def stored_elements(self) -> int:
    return self.storage.stored_elements


def allocate_selected_cache(
  method: str,
  storage_method,
  shape: ModelCacheShape,
  selector,
  *,
  batch: int,
  prompt_len: int,
  max_new_tokens: int,
  dtype,
) -> SelectedLayerCache:
  """A selection cache whose storage holds exactly `selector.budget + max_new_tokens` tokens."""
  check_full_attention_model(shape, method, prompt_len + max_new_tokens)
  storage = storage_method.allocate_storage(
    batch=batch,
    kv_heads=shape.num_kv_heads,
    capacity=selector.budget + max_new_tokens,
    head_dim=shape.head_dim,
    dtype=dtype,
  )
  return SelectedLayerCache(storage=storage, selector=selector)
