"""Checking, before a loop runs, that the caches have room for the tokens it will append.

A cache with a fixed capacity (dense storage, KIVI/GEAR, a selection's survivors) reports
`room`: int32 [batch], how many more tokens each row can take. Appends past it would be lost
inside jit, where nothing can raise, so kvjax's loops (`decode`, `teacher_force`) check first,
on the host, whenever they are given concrete caches. Caches that evict by design (a sliding
window's ring buffer, StreamingLLM, h2o_decode) report no room and are never full, once they
hold their whole budget: allocated with fewer slots (the prompt and the new tokens fit in
less), they report room like the others.
"""

import jax
import numpy as np

from kvjax.cache_protocol import check_count
from kvjax.layer_runs import StackedLayerCaches


def _layer_room(cache) -> jax.Array | None:
  return getattr(cache, "room", None)


def _room_of(item, room_of):  # int32 [batch] or [layers, batch], or None
  if isinstance(item, StackedLayerCaches):
    # Every layer's room at once, over the run's layer axis: slicing each layer's arrays out
    # (flatten_layer_caches) would copy the whole run to read its lengths.
    return jax.vmap(room_of)(item.stacked)
  return room_of(item)


def rows_room(caches, room_of=_layer_room) -> np.ndarray | None:
  """Tokens each row can still take in every bounded layer cache (None: none is bounded, or
  the caches are traced values that cannot be read before the loop runs). `room_of`: a layer
  cache's room, int32 [batch] or None (its `room`; `chunked_prefill` reads the room for a
  prompt fed in chunks)."""
  rooms = []
  for item in caches:
    room = _room_of(item, room_of)
    if room is None:
      continue
    if isinstance(room, jax.core.Tracer):
      return None
    room = np.asarray(room)
    rooms.append(room.reshape(-1, room.shape[-1]))
  return np.min(np.concatenate(rooms), axis=0) if rooms else None


def check_room(caches, new_tokens: int, *, caller: str, setting: str = "max_new_tokens") -> None:
  """Raises ValueError when some row has room for fewer than `new_tokens` more tokens, naming
  the `setting` that allocated the room; `new_tokens` must be an int >= 0."""
  check_count(f"{caller}: new_tokens", new_tokens, 0)
  if not isinstance(caches, (tuple, list)):
    raise ValueError(
      f"{caller}: caches must be the model's caches (the tuple prefill returns, one item a "
      f"layer or run of layers), got {type(caches).__qualname__}"
    )
  room = rows_room(caches)
  if room is None or new_tokens <= 0 or np.all(room >= new_tokens):
    return
  row = int(np.argmin(room))
  raise ValueError(
    f"{caller}: appends {new_tokens} tokens per row, but row {row}'s caches have room for "
    f"{int(room[row])} more; allocate them with {setting} >= {new_tokens} "
    "(appends past a cache's capacity would be lost)"
  )
