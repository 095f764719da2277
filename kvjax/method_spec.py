"""Cache method specs users can type: `full`, `kivi:bits=2,residual=128`, `snapkv:budget=256`,
and compositions `pyramidkv:budget=256+kivi:bits=4` (a selection policy decides which tokens
survive, a storage codec how they are stored). The CLI and the Python API share this parser.
"""

import dataclasses
import types
import typing

from kvjax import methods as _register_all_methods  # noqa: F401  (fills the registry)
from kvjax.attention_dispatch import check_implementation
from kvjax.kernel_settings import DEFAULT_KERNEL_SETTINGS, KernelSettings, check_kernel_settings
from kvjax.method_registry import METHODS

# Method fields a spec's `key=value` items never set: the composed storage, and how the method
# runs (given by parse_method_spec's caller). `describe_method` leaves them out too.
RUNTIME_FIELDS = ("storage", "implementation", "kernel_settings")


def _coerce(method: str, name: str, raw: str, annotation):
  options = (
    typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
  )
  if raw.lower() == "none" and type(None) in options:
    return None
  for option in options:
    if option is bool:
      if raw.lower() in ("true", "1", "yes"):
        return True
      if raw.lower() in ("false", "0", "no"):
        return False
    elif option in (int, float, str):
      try:
        return option(raw)
      except ValueError:
        pass
  allowed = " or ".join(getattr(o, "__name__", str(o)) for o in options)
  raise ValueError(f"{method}: parameter {name}={raw!r} must be {allowed}")


def _parse_one(part: str):
  name, _, arg_text = part.strip().partition(":")
  name = name.strip().lower()
  if name not in METHODS:
    raise ValueError(f"unknown cache method {name!r}; available: {', '.join(sorted(METHODS))}")
  cls = METHODS[name]
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls) if f.init and f.name not in RUNTIME_FIELDS}
  kwargs = {}
  for item in filter(None, (s.strip() for s in arg_text.split(","))):
    key, eq, raw = item.partition("=")
    key = key.strip().lower().replace("-", "_")  # as case-blind as the method's name
    if not eq or key not in fields:
      raise ValueError(
        f"{name}: unknown parameter {item!r}; allowed: "
        + ("(none)" if not fields else "")
        + ", ".join(f"{f}=<{getattr(hints[f], '__name__', hints[f])}>" for f in sorted(fields))
      )
    if key in kwargs:
      raise ValueError(f"{name}: parameter {key} is given twice ({arg_text.strip()!r})")
    kwargs[key] = _coerce(name, key, raw.strip(), hints[key])
  return cls, kwargs


def parse_method_spec(
  spec: str,
  *,
  implementation: str = "auto",
  kernel_settings: KernelSettings = DEFAULT_KERNEL_SETTINGS,
):
  """A cache method object from a spec string (see module docstring). `implementation` and
  `kernel_settings` (which Pallas kernel settings its caches pass to the attention dispatch)
  go to every part of a composition that attends."""
  check_implementation(implementation)
  check_kernel_settings(kernel_settings)
  if not isinstance(spec, str):
    raise ValueError(
      f"spec={spec!r} must be a string such as 'kivi:bits=4' or 'snapkv:budget=256+kivi'"
    )
  if not spec or not spec.strip():
    raise ValueError(f"empty cache method spec; available: {', '.join(sorted(METHODS))}")
  parsed = [_parse_one(part) for part in spec.split("+")]
  storages = [p for p in parsed if p[0].method_kind == "storage"]
  selections = [p for p in parsed if p[0].method_kind == "selection"]
  if len(storages) > 1 or len(selections) > 1:
    raise ValueError(
      f"{spec!r}: compose at most one selection method and one storage method with '+' "
      "(e.g. pyramidkv:budget=256+kivi:bits=4)"
    )

  def build(cls, kwargs, **extra):
    names = {f.name for f in dataclasses.fields(cls)}
    if "implementation" in names:
      extra["implementation"] = implementation
    if "kernel_settings" in names:
      extra["kernel_settings"] = kernel_settings
    try:
      return cls(**kwargs, **extra)
    except ValueError as e:  # a value the method refuses: say which method of the spec it was
      if str(e).startswith(f"{cls.method_name}:"):
        raise
      raise ValueError(f"{cls.method_name}: {e}") from None

  storage = build(*storages[0]) if storages else None
  if not selections:
    return storage
  selection_cls, selection_kwargs = selections[0]
  if storage is None and "storage" in {f.name for f in dataclasses.fields(selection_cls)}:
    storage = build(METHODS["full"], {})  # carries the implementation and kernel settings
  return build(selection_cls, selection_kwargs, **({"storage": storage} if storage else {}))


def describe_method(method) -> str:
  """The spec string of a method object (round-trips through `parse_method_spec`, except for a
  razor profile given as a `HeadProfile` object, not a path: that part is its repr)."""
  if not dataclasses.is_dataclass(method) or isinstance(method, type):
    raise ValueError(
      f"method must be a cache method object (as parse_method_spec returns), got "
      f"{type(method).__qualname__}"
    )
  parts = []
  storage = getattr(method, "storage", None)
  for m in (method, storage) if storage is not None else (method,):
    params = [
      f"{f.name}={getattr(m, f.name)}"
      for f in dataclasses.fields(m)
      if f.init and f.name not in RUNTIME_FIELDS and getattr(m, f.name) != f.default
    ]
    parts.append(m.method_name + (":" + ",".join(params) if params else ""))
  if storage is not None and storage.method_name == "full":
    parts = parts[:1]
  return "+".join(parts)
