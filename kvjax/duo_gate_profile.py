"""DuoAttention's trained gates of one model, and the heads they keep in full.

A gate alpha in [0, 1] per (layer, KV head) is trained once per model
(`kvjax.duo_gate_training`, `kvjax duo-train`) and saved as JSON. Deployment keeps the full
cache for the heads of the largest gates, a fraction of all KV heads (the authors' 25% for
multi-head models, 50% for grouped-query ones: `default_full_fraction`); the others become
streaming heads.
"""

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from kvjax.cache_protocol import ModelCacheShape
from kvjax.model_keyed_profile import ModelKeyedProfile

GATES_FORMAT = "kvjax-duo-gates"
GATES_VERSION = 1


def default_full_fraction(shape: ModelCacheShape) -> float:
  """The authors' deployment: 25% of heads full for MHA, 50% for GQA."""
  return 0.5 if shape.num_query_heads > shape.num_kv_heads else 0.25


def check_full_fraction(full_fraction) -> None:
  if (
    isinstance(full_fraction, bool)
    or not isinstance(full_fraction, numbers.Real)
    or not 0.0 <= full_fraction <= 1.0
  ):
    raise ValueError(
      f"duo: full_fraction={full_fraction!r} must be a number in [0, 1] (the fraction of all "
      "KV heads that keep the full cache)"
    )


def _stored_gate(value) -> float:
  """A gate as the file stores it: a number (float() would also read a string)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"gate {value!r} must be a number")
  return float(value)


@dataclasses.dataclass(frozen=True)
class DuoGateProfile(ModelKeyedProfile):
  """Gates per (layer, KV head) of one model. Hashable (tuples only): a cache method holding it
  is a static argument of `jit`."""

  WHAT = "duo gate file"
  FORMAT = GATES_FORMAT
  VERSION = GATES_VERSION
  MAKE, MADE, COMMAND = "train", "trained", "duo-train"
  MAKER = "kvjax.duo_gate_training.train_duo_gates"

  gates: tuple[tuple[float, ...], ...]  # [layer][kv_head], each in [0, 1]
  # How the gates were trained (for the record): steps, context length, sinks, recent, ...
  training: tuple[tuple[str, Any], ...] = ()
  model_name: str = ""

  def __post_init__(self):
    expected = (self.num_layers, self.num_kv_heads)
    if len(self.gates) != self.num_layers or any(
      len(row) != self.num_kv_heads for row in self.gates
    ):
      raise ValueError(f"duo gate profile: gates must be [num_layers, num_kv_heads] = {expected}")
    values = np.asarray(self.gates, np.float64)
    if not (np.isfinite(values).all() and (values >= 0).all() and (values <= 1).all()):
      raise ValueError("duo gate profile: every gate must be a finite number in [0, 1]")
    for key, value in self.training:
      # Scalars (or None) only: the profile is part of a jit static argument, so it must hash,
      # and its file must read back (which takes scalars only).
      if not isinstance(value, (str, int, float, bool, type(None))):
        raise ValueError(
          f"training setting {key!r}={value!r} must be a scalar (str, int, float, bool or None)"
        )

  @classmethod
  def from_gates(
    cls,
    shape: ModelCacheShape,
    gates: np.ndarray,  # [layers, kv_heads]
    *,
    training: dict | None = None,
    model_name: str = "",
  ) -> "DuoGateProfile":
    gates = np.asarray(gates, np.float64)
    return cls(
      **cls.counts_of(shape),
      gates=tuple(tuple(float(g) for g in row) for row in gates),
      training=tuple(
        sorted(
          (str(key), value.item() if isinstance(value, np.generic) else value)
          for key, value in (training or {}).items()
        )
      ),
      model_name=model_name,
    )

  def __repr__(self) -> str:  # the gates are long; describe_method prints this
    name = f"{self.model_name}: " if self.model_name else ""
    return f"DuoGateProfile({name}{self.num_layers} layers x {self.num_kv_heads} KV heads)"

  def full_heads(self, full_fraction: float) -> tuple[tuple[int, int], ...]:
    """Sorted (layer, kv_head) of the ceil(full_fraction x heads) largest gates (ties: the
    earlier head)."""
    check_full_fraction(full_fraction)
    flat = np.asarray(self.gates, np.float64).reshape(-1)
    count = min(flat.size, math.ceil(full_fraction * flat.size - 1e-9))
    order = np.argsort(-flat, kind="stable")[:count]
    return tuple(sorted(divmod(int(i), self.num_kv_heads) for i in order))

  def to_json_dict(self) -> dict:
    return dict(
      **self.file_header(self.model_name),
      training=dict(self.training),
      gates=[list(row) for row in self.gates],
    )

  @classmethod
  def from_json_dict(cls, data: dict, *, source: str) -> "DuoGateProfile":
    try:
      header = cls.read_header(data, source=source)
      training = data.get("training", {})
      profile = cls(
        **header,
        gates=tuple(tuple(_stored_gate(g) for g in row) for row in data["gates"]),
        training=tuple(sorted((str(k), v) for k, v in training.items())),
        model_name=str(data["model"].get("name", "")),
      )
    except (KeyError, TypeError, AttributeError) as error:
      raise ValueError(f"{source}: malformed gate file ({error})") from error
    except ValueError as error:
      if str(error).startswith(source):
        raise
      raise ValueError(f"{source}: malformed gate file ({error})") from error
    return profile
