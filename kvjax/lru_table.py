"""A bounded table of computed values that threads share, least recently used dropped first
(generate's compiled programs, the cache shapes of a method and model)."""

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any


class LruTable:
  """At most `max_entries` values by key; reads and writes hold a lock, computing does not."""

  def __init__(self, max_entries: int):
    if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 0:
      raise ValueError(f"max_entries={max_entries!r} must be an int >= 0 (0 keeps nothing)")
    self.max_entries = max_entries
    self._entries: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()

  def get_or_compute(self, key: Hashable, compute: Callable[[], Any]) -> Any:
    """The value stored for `key`, else `compute()`'s, stored and returned. Computing happens
    outside the lock, so the other keys' values stay available meanwhile (two threads asking
    for one new key both compute it; the later store replaces the earlier). A call returns the
    value it computed even when another thread's store has already evicted it."""
    with self._lock:
      if key in self._entries:
        self._entries.move_to_end(key)
        return self._entries[key]
    value = compute()
    with self._lock:
      self._entries[key] = value
      self._entries.move_to_end(key)
      while len(self._entries) > self.max_entries:
        self._entries.popitem(last=False)
    return value

  def most_recent(self) -> Any:
    """The value last stored or read; LookupError when nothing is stored."""
    with self._lock:
      if not self._entries:
        raise LookupError("the table is empty: nothing was stored yet")
      return next(reversed(self._entries.values()))
