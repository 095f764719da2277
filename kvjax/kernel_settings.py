"""Kernel settings a cache carries into the attention dispatch: the `kernel_config` of its
full-precision segments and of its quantized segments, and which kernel family runs them
(see `attention_dispatch`).

Frozen and hashable, so caches hold them as static pytree metadata and a jitted generate loop
compiles once per setting. Checked when built: unknown keys or values raise ValueError naming
them, before anything is traced (numbers against `pallas_kernels.launch_settings`). Which
keys a kernel takes depends on the backend the cache runs on; a key the chosen kernel does not
take raises when the cache first attends, unless `kernel_backend` names the family, in which
case its keys are checked here.
"""

import dataclasses
import numbers
from typing import Any

from kvjax.attention_dispatch import KERNEL_BACKENDS, TPU_CONFIG_KEYS, check_kernel_config
from pallas_kernels import decode_attention_gpu, quantized_decode_attention_gpu
from pallas_kernels.launch_settings import check_launch_settings
from pallas_kernels.quantized_decode_attention_triton import (
  DEFAULT_VARIANT,
  check_variant_settings,
)

FULL_KEYS = tuple(
  dict.fromkeys(
    ("lowering",) + sum(decode_attention_gpu.CONFIG_KEYS.values(), ()) + TPU_CONFIG_KEYS
  )
)
QUANTIZED_KEYS = tuple(
  dict.fromkeys(
    ("lowering",) + sum(quantized_decode_attention_gpu.CONFIG_KEYS.values(), ()) + TPU_CONFIG_KEYS
  )
)
Setting = tuple[tuple[str, Any], ...]
# Switches; every other setting is a number, a name or None.
BOOLEAN_KEYS = ("prefetch", "stack_copies", "approx_math")
# Keys a quantized setting without a lowering (or with "triton") may hold: the Triton kernel's
# and the TPU kernel's. The Mosaic GPU kernels' own keys need "lowering": "mosaic_gpu".
TRITON_OR_TPU_QUANTIZED_KEYS = (
  "lowering",
  *quantized_decode_attention_gpu.CONFIG_KEYS["triton"],
  *TPU_CONFIG_KEYS,
)


def _frozen(name: str, config, allowed: tuple[str, ...]) -> Setting:
  if config is None:
    return ()
  if isinstance(config, tuple):
    if not all(isinstance(pair, tuple) and len(pair) == 2 for pair in config):
      raise ValueError(
        f"kernel settings {name} must be a dict or a tuple of (key, value) pairs, got {config!r}"
      )
    config = dict(config)
  if not isinstance(config, dict):
    raise ValueError(f"kernel settings {name} must be a dict, got {type(config).__name__}")
  unknown = sorted(set(config) - set(allowed))
  if unknown:
    raise ValueError(
      f"kernel settings {name}: unknown keys {unknown}; allowed: {', '.join(allowed)}"
    )
  config = dict(config)
  for key, value in config.items():
    if key in BOOLEAN_KEYS:
      if not isinstance(value, bool):
        raise ValueError(f"kernel settings {name}: {key}={value!r} must be True or False")
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
      config[key] = int(value)  # a numpy int too, held as the int it equals (hashable, same key)
    elif not (value is None or isinstance(value, str)):
      raise ValueError(f"kernel settings {name}: {key}={value!r} must be an int, a string or None")
  try:
    check_launch_settings(config)
  except ValueError as e:
    raise ValueError(f"kernel settings {name}: {e}") from None
  return tuple(sorted(config.items()))


@dataclasses.dataclass(frozen=True)
class KernelSettings:
  """`full`: kernel_config of full-precision segments (e.g. {"lowering": "mosaic_gpu"});
  `quantized`: of quantized segments (e.g. {"variant": "folded"}). Dicts or item tuples.
  `kernel_backend`: None (the current backend's kernels), "gpu" or "tpu": the kernel family
  `implementation="interpret"` runs (the GPU kernels when None), so the TPU kernels can run
  through generate on a CPU; with "auto" or "pallas" it must match the backend (ValueError
  before tracing otherwise; "auto" on a CPU runs the jnp reference)."""

  full: Setting = ()
  quantized: Setting = ()
  kernel_backend: str | None = None

  def __post_init__(self):
    if self.kernel_backend is not None and self.kernel_backend not in KERNEL_BACKENDS:
      raise ValueError(
        f"kernel settings kernel_backend={self.kernel_backend!r} is not supported; allowed: "
        f"None, {', '.join(KERNEL_BACKENDS)}"
      )
    object.__setattr__(self, "full", _frozen("full", self.full, FULL_KEYS))
    object.__setattr__(self, "quantized", _frozen("quantized", self.quantized, QUANTIZED_KEYS))
    if self.kernel_backend == "tpu":  # the TPU kernels' keys, as the dispatch checks them
      for name, quantized in (("full", False), ("quantized", True)):
        try:
          check_kernel_config(dict(getattr(self, name)), quantized=quantized, family="tpu")
        except ValueError as e:
          raise ValueError(f"kernel settings {name} (kernel_backend='tpu'): {e}") from None
      return
    full, quantized = dict(self.full), dict(self.quantized)
    whole = self.kernel_backend == "gpu"  # only the GPU kernels read them: each checked whole
    try:
      if whole or full.get("lowering") == "mosaic_gpu":
        # A GPU-only lowering: its keys are checked whole, as that kernel takes them (without a
        # lowering the keys may be meant for the Triton or the TPU kernel, checked when called).
        decode_attention_gpu.check_config(full)
      elif "lowering" in full:
        decode_attention_gpu.check_config({"lowering": full["lowering"]})
    except ValueError as e:
      raise ValueError(f"kernel settings full: {e}") from None
    try:
      mosaic_only = sorted(set(quantized) - set(TRITON_OR_TPU_QUANTIZED_KEYS))
      if quantized.get("lowering", "triton") == "triton" and mosaic_only:
        raise ValueError(
          f"keys {mosaic_only} are taken by the Mosaic GPU kernels only; add "
          '"lowering": "mosaic_gpu" (and their "variant") or remove them'
        )
      if whole or quantized.get("lowering", "triton") != "triton":
        # Another lowering's keys: checked whole, as that kernel takes them.
        quantized_decode_attention_gpu.check_config(quantized)
      if quantized.get("lowering", "triton") == "triton":
        check_variant_settings(
          quantized.get("variant", DEFAULT_VARIANT),
          quantized.get("prefetch"),
          quantized.get("code_operand"),
          quantized.get("channel_parts"),
          quantized.get("gear_terms"),
          quantized.get("stack_copies"),
        )
    except ValueError as e:
      raise ValueError(f"kernel settings quantized: {e}") from None

  def full_config(self) -> dict | None:
    return dict(self.full) or None

  def quantized_config(self) -> dict | None:
    return dict(self.quantized) or None


DEFAULT_KERNEL_SETTINGS = KernelSettings()


def check_kernel_settings(kernel_settings) -> None:
  """ValueError unless `kernel_settings` is a KernelSettings (a dict would reach the caches'
  static metadata unchecked and unhashable)."""
  if not isinstance(kernel_settings, KernelSettings):
    raise ValueError(
      f"kernel_settings must be a kvjax.kernel_settings.KernelSettings, got "
      f"{type(kernel_settings).__name__}"
    )
