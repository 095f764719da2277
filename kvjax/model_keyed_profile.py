"""A per-model JSON file of per-head results (RazorAttention's head profile, DuoAttention's gates):
the model shape it was made for, its format and version, and reading and writing it."""

import dataclasses
import json
import numbers
import os
import shutil
import uuid
from typing import ClassVar

import numpy as np

from kvjax.cache_protocol import ModelCacheShape

MODEL_COUNTS = ("num_layers", "num_kv_heads", "num_query_heads", "head_dim")


def stored_model_count(model: dict, name: str) -> int:
  """A model count as the file stores it: an int, taken as is. int() would truncate a float
  (head_dim 8.9 read as 8) or read a string, and check_matches would then pass a file made for
  another model."""
  value = model[name]
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"model {name}={value!r} must be an int")
  return value


def _json_scalar(value):
  """numpy scalars (a count given as np.int64) as the Python values JSON holds."""
  if isinstance(value, np.generic):
    return value.item()
  raise TypeError(f"{value!r} ({type(value).__name__}) cannot be written to JSON")


@dataclasses.dataclass(frozen=True)
class ModelKeyedProfile:
  """Base of a frozen profile dataclass: the model counts, and what its file says of itself. A
  subclass defines `to_json_dict()` (starting from `file_header`) and
  `from_json_dict(data, *, source)` (starting from `read_header`)."""

  num_layers: int
  num_kv_heads: int
  num_query_heads: int
  head_dim: int

  WHAT: ClassVar[str]  # "head profile"
  FORMAT: ClassVar[str]
  VERSION: ClassVar[int]
  MAKE: ClassVar[str]  # "compute", "train"
  MADE: ClassVar[str]  # "computed", "trained"
  COMMAND: ClassVar[str]  # the kvjax command that makes one
  MAKER: ClassVar[str]  # the Python function that makes one

  @staticmethod
  def counts_of(shape: ModelCacheShape) -> dict:
    return {name: getattr(shape, name) for name in MODEL_COUNTS}

  def check_matches(self, shape: ModelCacheShape, *, source: str | None = None) -> None:
    """Raises when the file was made for a model of another shape."""
    source = self.WHAT if source is None else source
    mine = tuple(getattr(self, name) for name in MODEL_COUNTS)
    theirs = tuple(getattr(shape, name) for name in MODEL_COUNTS)
    if mine != theirs:
      describe = ", ".join(f"{name}={{}}" for name in MODEL_COUNTS).format
      raise ValueError(
        f"{source} was {self.MADE} for another model ({describe(*mine)}); this model has "
        f"{describe(*theirs)}. Make one for this model (kvjax {self.COMMAND})."
      )

  def file_header(self, model_name: str) -> dict:
    """The fields every such file starts with."""
    model = dict(name=model_name, **{name: getattr(self, name) for name in MODEL_COUNTS})
    return dict(format=self.FORMAT, version=self.VERSION, model=model)

  @classmethod
  def read_header(cls, data, *, source: str) -> dict:
    """The model counts of a file's parsed JSON, after its format and version are checked
    (a KeyError or ValueError for a malformed model entry is the caller's to word)."""
    if not isinstance(data, dict) or data.get("format") != cls.FORMAT:
      raise ValueError(f"{source}: not a kvjax {cls.WHAT} (expected format={cls.FORMAT!r})")
    if data.get("version") != cls.VERSION:
      raise ValueError(
        f"{source}: {cls.WHAT} version {data.get('version')!r}; this kvjax reads version "
        f"{cls.VERSION}"
      )
    return {name: stored_model_count(data["model"], name) for name in MODEL_COUNTS}

  def save(self, path: str | os.PathLike) -> None:
    """Writes the file whole or not at all: the JSON is made before the file is touched (a
    value JSON cannot hold fails there), then written beside it and renamed over it, so an
    error never leaves a good profile truncated."""
    text = json.dumps(self.to_json_dict(), indent=1, default=_json_scalar) + "\n"
    # Through a link to the file it names (a shared profile), keeping that file's permissions.
    path = os.path.realpath(os.fspath(path))
    directory, name = os.path.split(path)
    temporary = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.partial")
    try:
      with open(temporary, "x") as f:  # the mode open() gives a new file, as before
        f.write(text)
      if os.path.exists(path):
        shutil.copymode(path, temporary)
      os.replace(temporary, path)
    finally:
      if os.path.exists(temporary):
        os.remove(temporary)

  @classmethod
  def from_method_argument(cls, method: str, profile):
    """What a cache method's `profile=` gives: such a profile, or the path of its file."""
    if isinstance(profile, cls):
      return profile
    if profile is None:
      raise ValueError(
        f"{method}: profile=<{cls.WHAT} JSON> is required; {cls.MAKE} it once per model with "
        f"`kvjax {cls.COMMAND}` ({cls.MAKER})"
      )
    if not isinstance(profile, (str, os.PathLike)):
      raise ValueError(f"{method}: profile={profile!r} must be a file path or a {cls.__name__}")
    return cls.load(profile)

  @classmethod
  def load(cls, path: str | os.PathLike):
    source = f"{cls.WHAT} {os.fspath(path)!r}"
    try:
      with open(path) as f:
        data = json.load(f)
    except FileNotFoundError as error:
      raise ValueError(
        f"{source} does not exist; {cls.MAKE} it once per model with `kvjax {cls.COMMAND}`"
      ) from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
      raise ValueError(f"{source} is not valid JSON ({error})") from error
    except OSError as error:  # a directory, no permission, ...
      raise ValueError(f"{source} cannot be read ({error.strerror or error})") from error
    return cls.from_json_dict(data, source=source)
