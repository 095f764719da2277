"""GEAR's low-rank and outlier terms of one block, inside the GPU decode kernels.

A GEAR block of `block` tokens stores, besides its quantized codes, a rank-r factorisation of
the quantization residual (K ~ A_k B_k^T, per token A, per block B) and `s` sparse outliers
(flat index t_local * D + d, value). Their contributions to one block of scores and to one
block's value update are

  low rank:  scores += (q B_k[j]) A_k[t]^T ;  update += (p A_v) B_v[j]^T   (rank-r broadcasts)
  outliers:  scores += (q gathered at the outlier channels * value) scattered to the outlier
             tokens;  update += (p gathered at the outlier tokens * value) scattered to channels,

the scatters and the gather of p being dots with one-hot [s, block] / [s, D] matrices; q at
the outlier channels is a gather load from the queries' block (a one-hot [s, D] build and dot
cost ~10% more instructions per cached element, benchmarks/triton_static_cost.py --gear).
The kernels keep D in a permuted order of their own (`channels`: channel at each position,
`GearRefs.key_positions`: position of each channel); the terms come out in that order.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.decode_attention_triton import _dot_nn, _dot_nt, load_token_rows
from pallas_kernels.splits import next_power_of_two

# Outliers per one-hot dot: the [chunk, D] / [chunk, block] one-hot tiles of 64 keep registers
# and the padding of GEAR's 164 outliers per block (2%) down (192, not 256).
OUTLIER_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class GearRefs:
  """A kernel's GEAR inputs: low-rank factors (k_a, q_b, v_a, v_b) with q_b = q B_k per GEAR
  block computed outside (`gear_kernel_inputs`), and outliers (k_index,
  k_value, v_index, v_value) followed by `key_positions` (int32 [D]: the position of each
  channel in the kernel's query order), each None where the cache has none."""

  lowrank: tuple | None
  outliers: tuple | None
  key_positions: object = None

  @classmethod
  def take(cls, refs, has_lowrank: bool, has_outliers: bool) -> "GearRefs":
    """The leading GEAR refs of `refs` (the kernel's trailing inputs, in pallas_call order:
    `gear_kernel_inputs`)."""
    refs = list(refs)
    lowrank = tuple(refs[:4]) if has_lowrank else None
    refs = refs[4:] if has_lowrank else refs
    if not has_outliers:
      return cls(lowrank, None)
    return cls(lowrank, tuple(refs[:4]), refs[4])

  @property
  def present(self) -> bool:
    return self.lowrank is not None or self.outliers is not None

  @property
  def head_dim(self) -> int:
    if self.outliers is not None:
      return self.key_positions.shape[0]
    return self.lowrank[3].shape[-2]  # v_b [blocks, D, r]


def gear_score_terms(
  gear: GearRefs,
  queries_ref,
  gear_index,
  first,
  valid: jax.Array,
  token_shift=0,
) -> jax.Array:
  """float32 [rows, block]: GEAR's addition to the scores of tokens first .. first + block - 1.

  queries_ref [rows, D] (operand dtype, the kernel's channel order, pre-scaled);
  `gear_index`: the GEAR block they lie in, `token_shift`: position of `first` within it.
  """
  rows, head_dim = queries_ref.shape
  block = valid.shape[0]
  terms = jnp.zeros((rows, block), jnp.float32)
  operand_dtype = queries_ref.dtype
  if gear.lowrank is not None:
    k_a_ref, q_b_ref, _, _ = gear.lowrank
    q_b = q_b_ref[gear_index]  # [rows, r] float32
    k_a = load_token_rows(k_a_ref, first, block, valid).astype(jnp.float32)  # [block, r]
    terms = terms + jnp.sum(q_b[:, None, :] * k_a[None, :, :], axis=2)
  if gear.outliers is not None:
    k_index_ref, k_value_ref, _, _ = gear.outliers
    for chunk in _outlier_chunks(k_index_ref.shape[-1]):
      k_index = k_index_ref[gear_index, chunk]  # [chunk]
      k_value = k_value_ref[gear_index, chunk].astype(jnp.float32)
      position = gear.key_positions[jnp.bitwise_and(k_index, head_dim - 1)]
      row = jnp.arange(rows, dtype=jnp.int32)[:, None]
      q_at_outlier = queries_ref[row, position[None, :]].astype(jnp.float32)  # [rows, chunk]
      token_hot = _token_hot(k_index, head_dim, token_shift, block)  # [chunk, block]
      terms = terms + _dot_nn(
        (q_at_outlier * k_value[None, :]).astype(operand_dtype), token_hot.astype(operand_dtype)
      )
  return terms


def gear_value_terms(
  gear: GearRefs,
  probs: jax.Array,
  gear_index,
  first,
  valid: jax.Array,
  channel_sets: list,
  compute_dtype,
  token_shift=0,
) -> list:
  """[float32 [rows, C]] per entry of `channel_sets` (int32 [C] channels each: all D of them in
  the kernel's order, or one value group's, or one channel part's): GEAR's addition to the value
  update of the unnormalised probabilities `probs` float32 [rows, block] for those channels.
  p A_v and p at the outliers' tokens are computed once for all the sets."""
  rows, block = probs.shape
  head_dim = gear.head_dim
  terms = [jnp.zeros((rows, channels.shape[0]), jnp.float32) for channels in channel_sets]
  if gear.lowrank is not None:
    _, _, v_a_ref, v_b_ref = gear.lowrank
    v_a = load_token_rows(v_a_ref, first, block, valid).astype(jnp.float32)  # [block, r]
    p_a = jnp.sum(probs[:, :, None] * v_a[None, :, :], axis=1)  # [rows, r]
    for index, channels in enumerate(channel_sets):
      v_b = v_b_ref[gear_index, channels, :].astype(jnp.float32)  # [C, r]
      terms[index] = terms[index] + jnp.sum(p_a[:, None, :] * v_b[None, :, :], axis=2)
  if gear.outliers is not None:
    _, _, v_index_ref, v_value_ref = gear.outliers
    probs_c = probs.astype(compute_dtype)
    for chunk in _outlier_chunks(v_index_ref.shape[-1]):
      v_index = v_index_ref[gear_index, chunk]
      v_value = v_value_ref[gear_index, chunk].astype(jnp.float32)
      token_hot = _token_hot(v_index, head_dim, token_shift, block)  # [chunk, block]
      p_at_outlier = _dot_nt(probs_c, token_hot.astype(compute_dtype))  # [rows, chunk]
      weighted = (p_at_outlier * v_value[None, :]).astype(compute_dtype)
      outlier_channel = jnp.bitwise_and(v_index, head_dim - 1)[:, None]
      for index, channels in enumerate(channel_sets):
        channel_hot = outlier_channel == channels[None, :]  # [chunk, C]
        terms[index] = terms[index] + _dot_nn(weighted, channel_hot.astype(compute_dtype))
  return terms


def _outlier_chunks(count: int) -> list:
  """Slices of at most OUTLIER_CHUNK outliers covering `count` (see `padded_outlier_count`)."""
  chunk = min(count, OUTLIER_CHUNK)
  return [pl.ds(start, chunk) for start in range(0, count, chunk)]


def padded_outlier_count(count: int) -> int:
  """Outliers per block as the kernels take them: a power of two >= 16 up to OUTLIER_CHUNK,
  else a multiple of OUTLIER_CHUNK (Triton tensors have power-of-two sizes)."""
  if count <= OUTLIER_CHUNK:
    return max(16, next_power_of_two(count))
  return -(-count // OUTLIER_CHUNK) * OUTLIER_CHUNK


def _token_hot(index, head_dim, token_shift, block):
  """bool [s, block]: outlier i sits at token column j of this block."""
  token = jnp.right_shift(index, int(math.log2(head_dim))) - token_shift
  return token[:, None] == jnp.arange(block, dtype=jnp.int32)[None, :]


def gear_kernel_inputs(
  lowrank, outliers, scaled_queries: jax.Array, key_order: np.ndarray, sizes
) -> list:
  """The GEAR arrays in `GearRefs.take` order, padded for Triton (power-of-two rank; outlier
  count `padded_outlier_count`, the padding entries index 0 with value 0 and so add nothing),
  and the channel positions of the kernel's query order `key_order` (numpy int32 [D]).

  scaled_queries: float32 [B, H, rows, D] in natural channel order. The keys' low-rank term
  needs q B_k once per GEAR block; it is computed here, by XLA, as one einsum that reads B_k
  (which the kernel would read anyway), instead of a [rows, D, r] product and a cross-lane
  reduction over D in every step of the kernel.
  """
  inputs = []
  if lowrank is not None:
    rank = next_power_of_two(sizes.rank)
    k_a, k_b, v_a, v_b = lowrank
    q_b = jnp.einsum(
      "bhgd,bhjdr->bhjgr",
      scaled_queries,
      k_b.astype(jnp.float32),
      precision=jax.lax.Precision.HIGHEST,
    )
    inputs += [_pad_last(x, rank) for x in (k_a, q_b, v_a, v_b)]
  if outliers is not None:
    count = padded_outlier_count(sizes.outliers_per_block)
    k_index, k_value, v_index, v_value = outliers
    inputs += [
      _pad_last(k_index.astype(jnp.int32), count),
      _pad_last(k_value, count),
      _pad_last(v_index.astype(jnp.int32), count),
      _pad_last(v_value, count),
      jnp.asarray(np.argsort(key_order).astype(np.int32)),
    ]
  return inputs


def _pad_last(array: jax.Array, size: int) -> jax.Array:
  if array.shape[-1] == size:
    return array
  pad = [(0, 0)] * (array.ndim - 1) + [(0, size - array.shape[-1])]
  return jnp.pad(array, pad)
