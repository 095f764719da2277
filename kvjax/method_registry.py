"""Name -> cache method class, filled by `@register_method` in each method's own module."""

METHODS: dict[str, type] = {}


def register_method(name: str, *, kind: str):
  """`kind`: "storage" (full, kivi, gear: how kept tokens are stored) or "selection"
  (snapkv, pyramidkv, ...: which tokens survive)."""
  if kind not in ("storage", "selection"):
    raise ValueError(f"kind={kind!r}; allowed: storage, selection")

  def register(cls):
    if name in METHODS:
      raise ValueError(f"cache method {name!r} registered twice")
    cls.method_name = name
    cls.method_kind = kind
    METHODS[name] = cls
    return cls

  return register
