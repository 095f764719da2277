"""GEAR's sparse outliers: the largest and smallest entries of a block, in fixed-count COO form.

Static shapes: every block keeps exactly `2 * count_per_side` entries (flat indices + values),
whatever its data, so the storage is a plain array and jit never sees a ragged shape. Indices are
uint16 where the rows have at most 2^16 entries (GEAR's 64 x 128 blocks: 8192), int32 beyond.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_decode_attention_reference import outlier_index_dtype


class Outliers(NamedTuple):
  indices: jax.Array  # [..., 2 * count_per_side] `outlier_index_dtype(N)`: largest, then smallest
  values: jax.Array  # [..., 2 * count_per_side], same dtype as the input
  mask: jax.Array  # bool [..., N]: True at the extracted positions


def check_outlier_fraction(outliers: float) -> None:
  number = isinstance(outliers, (int, float)) and not isinstance(outliers, bool)
  if not number or not 0.0 <= outliers < 0.5:
    raise ValueError(f"outliers={outliers!r} must be a fraction in [0, 0.5) (GEAR uses 0.02)")


def outlier_count_per_side(outliers: float, block_elements: int) -> int:
  """Entries taken from each end of a block of `block_elements`: round(outliers/2 * elements).

  Rounding is half-up, and a positive fraction always keeps at least one entry per side (a
  fraction that rounds to zero would silently turn GEAR into GEAR-L).
  """
  check_outlier_fraction(outliers)
  if outliers == 0:
    return 0
  return max(1, math.floor(outliers / 2 * block_elements + 0.5))


def _extract_one(
  x: jax.Array,  # [N]
  count_per_side: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  largest_values, largest_indices = jax.lax.top_k(x, count_per_side)
  taken = jnp.zeros(x.shape, bool).at[largest_indices].set(True)
  # The smallest are chosen among the entries not already taken, so the two sets are disjoint
  # even when ties (a constant block) would let top_k pick the same index from both ends.
  remaining = jnp.where(taken, jnp.inf, x.astype(jnp.float32))
  _, smallest_indices = jax.lax.top_k(-remaining, count_per_side)
  indices = jnp.concatenate([largest_indices, smallest_indices])
  indices = indices.astype(outlier_index_dtype(x.shape[-1]))
  taken = taken.at[smallest_indices].set(True)
  return indices, x[indices], taken


def extract_outliers(
  x: jax.Array,  # [..., N]
  count_per_side: int,
) -> Outliers:
  """The `count_per_side` largest and `count_per_side` smallest entries of each row (by value).

  Ties are broken toward the lower index. Requires 2 * count_per_side <= N.
  """
  elements = x.shape[-1]
  if count_per_side < 0 or 2 * count_per_side > elements:
    raise ValueError(
      f"count_per_side={count_per_side} must be in [0, {elements // 2}] for rows of {elements}"
    )
  if count_per_side == 0:
    return Outliers(
      indices=jnp.zeros(x.shape[:-1] + (0,), outlier_index_dtype(elements)),
      values=jnp.zeros(x.shape[:-1] + (0,), x.dtype),
      mask=jnp.zeros(x.shape, bool),
    )
  extract = jnp.vectorize(
    lambda row: _extract_one(row, count_per_side), signature="(n)->(k),(k),(n)"
  )
  return Outliers(*extract(x))


def scatter_outliers(
  indices: jax.Array,  # integer [..., s]
  values: jax.Array,  # [..., s]
  elements: int,  # N
) -> jax.Array:  # float32 [..., N]
  """The dense form of COO rows (zeros elsewhere). Entries are added: a row's indices are
  distinct but for zero-valued padding (`GearCodec.outlier_slots`), which adds nothing."""
  scatter = jnp.vectorize(
    lambda index, value: jnp.zeros((elements,), jnp.float32).at[index].add(value),
    signature="(s),(s)->(n)",
  )
  return scatter(indices, values.astype(jnp.float32))
