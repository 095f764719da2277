"""The numeric kernel_config settings the kernels share, and the values each one allows.

Checked where a config is built or dispatched, so that a bad value is named before anything is
traced (a negative block would otherwise surface as a shape error deep inside pallas_call, and
a split count of 0 would be planned as 1). A kernel may allow fewer values still (the Mosaic GPU
kernels take block_tokens 64 or 128; the Triton quantized kernel takes whole key groups per
block, while the TPU one rounds a block up to them): those checks stay with the kernel.
"""

import numbers
from typing import Any

MIN_BLOCK_TOKENS = 16  # the smallest K or N side of a tensor-core dot; a multiple of TPU sublanes
# The largest value of a count: index arithmetic on it stays in int32 (2**31 tokens a block
# overflowed a kernel's index maps with an OverflowError deep inside the trace).
MAX_SETTING = 2**20
NUM_WARPS = (1, 2, 4, 8, 16)
# setting -> what it must be (None always means the kernel's default)
ALLOWED = {
  "block_tokens": f"a power of two in [{MIN_BLOCK_TOKENS}, 2**20]",
  "num_splits": "an int in [1, 2**20]",
  "num_warps": f"one of {NUM_WARPS}",
  "num_stages": "an int in [1, 2**20]",
  "unroll": "an int in [1, 2**20]",
}


def is_power_of_two(n: int) -> bool:
  return n >= 1 and (n & (n - 1)) == 0


def _is_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _allowed(key: str, value: Any) -> bool:
  if not _is_int(value):
    return False
  if key == "num_warps":
    return value in NUM_WARPS
  if value > MAX_SETTING:
    return False
  if key == "block_tokens":
    return value >= MIN_BLOCK_TOKENS and is_power_of_two(value)
  return value >= 1


def check_launch_settings(config: dict | None) -> None:
  """ValueError naming the first numeric setting of `config` outside its allowed values; keys
  that are not numeric settings are left to their kernel's own checks."""
  for key, value in (config or {}).items():
    if key in ALLOWED and value is not None and not _allowed(key, value):
      raise ValueError(f"{key}={value!r} is not supported; allowed: None or {ALLOWED[key]}")
