"""Group-wise asymmetric min/max quantization of K/V, with codes bit-packed into uint32 words.

KIVI's layout (DESIGN.md "Quantized storage"):
  keys   [..., T, D]: per channel, over groups of `group_size` consecutive tokens
                      -> scale, minimum [..., T/group_size, D];
  values [..., T, D]: per token, over groups of `group_size` consecutive channels
                      -> scale, minimum [..., T, D/group_size].
Codes `q = clamp(round((x - min) / scale), 0, 2^bits - 1)`, `x_hat = q * scale + min`, packed
along head_dim with `pallas_kernels.bit_packing` (planar layout): [..., T, D * bits / 32] uint32.

Scales and minimums are stored in the cache dtype at their true granularity. They are rounded
*outward* to that dtype (minimum down, scale up) before the codes are computed against the
stored values, so every element still lies in [min, min + (2^bits - 1) * scale] and the
dequantization error stays within half a step of the stored scale even for bfloat16 stats.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.bit_packing import check_bits, pack_codes, packed_width, unpack_codes


class GroupQuantized(NamedTuple):
  codes: jax.Array  # uint32 [..., T, D * bits / 32], planar-packed along head_dim
  scale: jax.Array  # keys [..., T/G, D]; values [..., T, D/G]  (storage dtype)
  minimum: jax.Array  # same shape and dtype as scale


def check_quantization_config(*, bits: int, group_size: int, head_dim: int | None = None) -> None:
  """ValueError naming the parameter when bits/group_size cannot quantize head_dim-wide rows."""
  check_bits(bits)
  if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size={group_size!r} must be a positive int")
  if head_dim is None:
    return
  if head_dim % group_size:
    raise ValueError(
      f"group_size={group_size} must divide head_dim={head_dim} (values are quantized per "
      "token over groups of group_size channels)"
    )
  packed_width(head_dim, bits)  # raises when head_dim is not a multiple of 32 // bits


def round_to_dtype(x: jax.Array, dtype) -> jax.Array:
  """float32 `x` rounded to the nearest value of `dtype`, still as float32.

  `lax.reduce_precision` rather than a cast pair: XLA on GPU may drop an f32 -> bf16 -> f32
  round trip inside a fusion (excess precision), and the codes must be computed against the
  values that are actually stored.
  """
  info = jnp.finfo(dtype)
  x = x.astype(jnp.float32)
  rounded = jax.lax.reduce_precision(x, int(info.nexp), int(info.nmant))
  unit = _subnormal_unit(dtype)
  if unit is None:
    return rounded
  # reduce_precision flushes the dtype's subnormals to 0 (float16 below 6.1e-5); float32 holds
  # that grid exactly, so round them onto it instead.
  return jnp.where(jnp.abs(x) < float(info.smallest_normal), jnp.round(x / unit) * unit, rounded)


def _subnormal_unit(dtype) -> float | None:
  """The spacing of `dtype`'s subnormals where float32 holds them as normal numbers (float16),
  else None (bfloat16's subnormals are float32's own)."""
  info = jnp.finfo(dtype)
  if float(info.smallest_normal) <= float(jnp.finfo(jnp.float32).smallest_normal):
    return None
  return float(info.smallest_subnormal)


def _exact_float32(x: jax.Array) -> jax.Array:
  """`x` as float32 holding exactly its own dtype's values (see `round_to_dtype`)."""
  if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits >= 32:
    return x.astype(jnp.float32)
  return round_to_dtype(x, x.dtype)


def _round_toward(x: jax.Array, dtype, direction: float) -> jax.Array:
  """float32 `x` rounded to a `dtype` value toward `direction` (-1: down, +1: up), as float32."""
  nearest = round_to_dtype(x, dtype)
  overshoot = nearest < x if direction > 0 else nearest > x
  # Stepping by at least one unit in the last place of `dtype` and rounding to nearest lands on
  # a `dtype` value strictly beyond `nearest` (rounding is monotonic), hence on x's other side.
  info = jnp.finfo(dtype)
  smallest_step = _subnormal_unit(dtype) or float(info.smallest_normal)
  unit = jnp.maximum(jnp.abs(nearest) * float(info.eps), smallest_step)
  return jnp.where(overshoot, round_to_dtype(nearest + direction * unit, dtype), nearest)


def _quantize_groups(
  x: jax.Array,  # float32 [..., group_axis elements at `axis`, ...]
  exclude: jax.Array | None,  # bool, same shape as x: elements left out of the stats (code 0)
  *,
  axis: int,  # the axis that holds the elements of one group
  bits: int,
  dtype,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(codes uint8 like x, scale, minimum with `axis` reduced to 1) for groups along `axis`."""
  levels = 2**bits - 1
  if exclude is None:
    group_min = x.min(axis=axis, keepdims=True)
    group_max = x.max(axis=axis, keepdims=True)
  else:
    group_min = jnp.where(exclude, jnp.inf, x).min(axis=axis, keepdims=True)
    group_max = jnp.where(exclude, -jnp.inf, x).max(axis=axis, keepdims=True)
    # A group whose every element is excluded has no range: store min = max = 0.
    empty = jnp.isinf(group_min)
    group_min = jnp.where(empty, 0.0, group_min)
    group_max = jnp.where(empty, 0.0, group_max)
  # Outward rounding to the storage dtype: every element stays in [min, min + levels * scale].
  minimum_f32 = _round_toward(group_min, dtype, -1.0)
  # A NaN may drop out of the min/max (XLA on CPU skips it along some axes) and come back as a
  # finite value: its group dequantizes to NaN instead, as a full cache would hand it on.
  # (An excluded NaN, a GEAR outlier, is carried by its correction, not by its group.)
  counted = x if exclude is None else jnp.where(exclude, 0.0, x)
  minimum_f32 = jnp.where(jnp.isnan(counted).any(axis=axis, keepdims=True), jnp.nan, minimum_f32)
  scale_f32 = _round_toward((group_max - minimum_f32) / levels, dtype, 1.0)
  minimum, scale = minimum_f32.astype(dtype), scale_f32.astype(dtype)  # exact: already dtype values
  # A constant group has scale 0: every code is 0 and dequantizes to the minimum exactly.
  safe_scale = jnp.where(scale_f32 > 0, scale_f32, 1.0)
  codes = jnp.clip(jnp.round((x - minimum_f32) / safe_scale), 0, levels)
  codes = jnp.where(scale_f32 > 0, codes, 0.0)
  if exclude is not None:
    codes = jnp.where(exclude, 0.0, codes)
  return codes.astype(jnp.uint8), scale, minimum


def quantize_keys_per_channel(
  keys: jax.Array,  # [..., T, D]
  *,
  bits: int,
  group_size: int,
  dtype=None,  # storage dtype of scale/minimum; default keys.dtype
  exclude: jax.Array | None = None,  # bool [..., T, D]: outliers stored elsewhere
) -> GroupQuantized:
  """Per-channel quantization over groups of `group_size` tokens (T % group_size == 0).

  Elements marked in `exclude` do not widen their group's range and get code 0 (they
  dequantize to the group minimum; the caller stores their correction separately).
  """
  check_quantization_config(bits=bits, group_size=group_size)
  *lead, tokens, head_dim = keys.shape
  if tokens % group_size:
    raise ValueError(f"group_size={group_size} must divide the {tokens} tokens being quantized")
  dtype = keys.dtype if dtype is None else dtype
  grouped_shape = (*lead, tokens // group_size, group_size, head_dim)
  grouped = _exact_float32(keys).reshape(grouped_shape)
  check_exclude_mask(exclude, keys.shape)
  grouped_exclude = None if exclude is None else exclude.reshape(grouped_shape)
  codes, scale, minimum = _quantize_groups(
    grouped, grouped_exclude, axis=-2, bits=bits, dtype=dtype
  )
  return GroupQuantized(
    codes=pack_codes(codes.reshape(keys.shape), bits),
    scale=scale[..., 0, :],  # [..., T/G, D]
    minimum=minimum[..., 0, :],
  )


def check_exclude_mask(exclude, shape: tuple[int, ...]) -> None:
  """`exclude` must be None or bool of exactly `shape`: reshaped, a transposed mask of the same
  size would mark other elements."""
  if exclude is None:
    return
  if tuple(exclude.shape) != tuple(shape) or exclude.dtype != jnp.bool_:
    raise ValueError(
      f"exclude must be a bool mask of the quantized array's shape {tuple(shape)}; got "
      f"{exclude.dtype} {tuple(exclude.shape)}"
    )


def quantize_values_per_token(
  values: jax.Array,  # [..., T, D]
  *,
  bits: int,
  group_size: int,
  dtype=None,
  exclude: jax.Array | None = None,  # bool [..., T, D]
) -> GroupQuantized:
  """Per-token quantization over groups of `group_size` channels (D % group_size == 0)."""
  *lead, tokens, head_dim = values.shape
  check_quantization_config(bits=bits, group_size=group_size, head_dim=head_dim)
  dtype = values.dtype if dtype is None else dtype
  grouped_shape = (*lead, tokens, head_dim // group_size, group_size)
  grouped = _exact_float32(values).reshape(grouped_shape)
  check_exclude_mask(exclude, values.shape)
  grouped_exclude = None if exclude is None else exclude.reshape(grouped_shape)
  codes, scale, minimum = _quantize_groups(
    grouped, grouped_exclude, axis=-1, bits=bits, dtype=dtype
  )
  return GroupQuantized(
    codes=pack_codes(codes.reshape(values.shape), bits),
    scale=scale[..., 0],  # [..., T, D/G]
    minimum=minimum[..., 0],
  )


def dequantize_keys(
  codes: jax.Array,  # uint32 [..., T, D * bits / 32]
  scale: jax.Array,  # [..., T/G, D]
  minimum: jax.Array,  # [..., T/G, D]
  *,
  bits: int,
  group_size: int,
) -> jax.Array:  # float32 [..., T, D]
  """Materialised keys (codecs and tests; attention never calls this on the whole context)."""
  levels = unpack_codes(codes, bits).astype(jnp.float32)
  per_token_scale = jnp.repeat(scale.astype(jnp.float32), group_size, axis=-2)
  per_token_minimum = jnp.repeat(minimum.astype(jnp.float32), group_size, axis=-2)
  return levels * per_token_scale + per_token_minimum


def dequantize_values(
  codes: jax.Array,  # uint32 [..., T, D * bits / 32]
  scale: jax.Array,  # [..., T, D/G]
  minimum: jax.Array,  # [..., T, D/G]
  *,
  bits: int,
  group_size: int,
) -> jax.Array:  # float32 [..., T, D]
  levels = unpack_codes(codes, bits).astype(jnp.float32)
  per_channel_scale = jnp.repeat(scale.astype(jnp.float32), group_size, axis=-1)
  per_channel_minimum = jnp.repeat(minimum.astype(jnp.float32), group_size, axis=-1)
  return levels * per_channel_scale + per_channel_minimum
