"""GEAR's sparse outlier terms inside the TPU decode kernel: one-hot products per GEAR block.

A GEAR block j of `gear_block` tokens stores s outliers as flat indices t_local * D + c and
values, [J, s] per KV head, row-major (`OUTLIER_LAYOUT`). Over one kernel block of J_blk GEAR
blocks (their [J_blk, s] rows, the outliers on lanes, as stored), with q the scaled queries
[rows, D] and p the unnormalised probabilities [rows, block], a `span` of tokens at a time (whole
lane tiles holding whole GEAR blocks: 128 tokens, two GEAR blocks of 64, whose outliers are
taken side by side, [1, 2 s]):

  keys    scores[:, t] += sum_{k: token k = t} q[:, c_k] v_k
          = q[:, c] . T^T: q gathered at the outliers' channels (a lane gather, exact), times
          T [span, n] the token one-hot holding the values;
  values  out += sum_k p[:, t_k] v_k e_{c_k}
          = p[:, t] . C^T: p gathered at the outliers' tokens, times C [D, n] the channel
          one-hot holding the values.

The one-hot holds the values as stored and has one nonzero term per outlier: with bfloat16
values the float32 queries and probabilities gathered are taken as two bfloat16 halves in one
MXU pass (`bfloat16_halves`, exact to 2^-16), and only the float32 sums round, as in the
reference. Float32 values take HIGHEST precision.

Outliers whose token is at or past the row's length are zeroed first: storage past a length may
hold anything (NaN values, indices anywhere), and a NaN in a one-hot operand would reach every
output of its product (0 x NaN). Indices are clipped into their block, so that a garbage one
cannot name a token of the other GEAR block of a span.

Before v56 these terms were XLA's around the kernel (a dense [B, H, R, T] score bias in, the
scores out, the value terms scattered after the merge): XLA's own cost model put those ops at
15 M (head_dim 64) to 31 M (128) cycles a decode step at 32k, against the kernel's 3.5 M
(compiled for a TPU v5e without one: KERNEL_NOTES v55), and their scatter crashed v6e's
SparseCore compiler at 32k.
"""

import math

import jax
import jax.numpy as jnp

from pallas_kernels.bfloat16_halves import product_by_halves
from pallas_kernels.decode_attention_tpu import LANES

# The layout the outlier arrays are read in: row-major, [B, H, J, s] as stored (a cache that
# writes them inside a TPU decode loop pins it: `kivi_cache._write_blocks`).
OUTLIER_LAYOUT = (0, 1, 2, 3)


def stored_outlier_slots(count: int) -> int:
  """Entries a GEAR block's outlier arrays are best stored with for this kernel: `count` rounded
  up to whole 128-lane tiles, the rest zeros (index 0, value 0: a term of nothing in every
  reader). A TPU's row-major layout pads a [B, H, J, s] array to whole lane tiles anyway; with s
  not a multiple of 128 its default layout for the shape is not row-major (s = 164, GEAR's 2% at
  head_dim 128, was laid out (0, 3, 1, 2)), and a decode step jitted alone took the outliers in
  that layout and copied all four into the kernel's at every call (67 MB at 32k tokens, batch 8,
  8 KV heads: KERNEL_NOTES v64)."""
  return -(-count // LANES) * LANES


def outlier_slots_read(count: int, slots: int, gear_block: int) -> int:
  """Slots of each GEAR block's [slots] outlier rows the kernel reads for its `count` outliers:
  whole lane tiles where the stored slots hold them and that puts no more lane tiles in a span's
  row (`GearOutlierBlock._span_rows`: the span's GEAR blocks side by side), else `count`. Rows of
  whole tiles join without lane shifts. Static bundles of an 8192-token step at 32k tokens, v5e
  (v65): GEAR-2 at head_dim 64 (82 outliers) 7940 reading 128 slots unmasked (7955 with the
  mask past the count), 8347 reading 82; at 128 (164) 11192 reading 164, 12799 reading 256
  (2 x 164 fill 3 tiles, 2 x 256 fill 4)."""
  per_span = outlier_span(gear_block) // gear_block
  whole = stored_outlier_slots(count)
  if whole <= slots and -(-per_span * count // LANES) == per_span * whole // LANES:
    return whole
  return count


def outlier_span(gear_block: int) -> int:
  """Tokens whose scores one GEAR block's products cover: whole lane tiles holding whole GEAR
  blocks (128 at GEAR blocks of 16 to 128 dividing it, the GEAR block at multiples of 128)."""
  return math.lcm(gear_block, LANES)


class GearOutlierBlock:
  """GEAR's outlier terms over one kernel block: `first` its first token, `length` the row's
  length, the four outlier arrays [J_blk, s] (indices of any integer dtype, values in the
  cache's dtype) of its J_blk GEAR blocks, of which the first `count` slots hold outliers (None:
  all; the values of the others are taken as zeros). `operand_dtype` is what the products take (the
  kernel's compute dtype: bfloat16, or float32 at HIGHEST precision); values not exact in it
  (float32 ones with bfloat16 queries) make it float32."""

  def __init__(
    self,
    k_index: jax.Array,
    k_value: jax.Array,
    v_index: jax.Array,
    v_value: jax.Array,
    *,
    first,
    length,
    gear_block: int,
    head_dim: int,
    operand_dtype,
    count: int | None = None,
  ):
    self.gear_blocks, self.count = k_index.shape
    self.outliers = self.count if count is None else count
    self.gear_block = gear_block
    self.head_dim = head_dim
    self.span = outlier_span(gear_block)
    exact = all(value.dtype == operand_dtype for value in (k_value, v_value))
    self.dtype = operand_dtype if exact else jnp.float32
    self.keys = self._positions(k_index, k_value, first, length)
    self.values = self._positions(v_index, v_value, first, length)

  def _positions(self, index, value, first, length):
    """(token within its span, channel, value zeroed at or past the length), each [J_blk, s]."""
    index = jnp.clip(index.astype(jnp.int32), 0, self.gear_block * self.head_dim - 1)
    token_in_block, channel = index // self.head_dim, index % self.head_dim
    block = jax.lax.broadcasted_iota(jnp.int32, index.shape, 0)
    live = first + block * self.gear_block + token_in_block < length
    if self.outliers < self.count:  # slots past the outliers (`outlier_slots_read`)
      live = live & (jax.lax.broadcasted_iota(jnp.int32, index.shape, 1) < self.outliers)
    value = jnp.where(live, value.astype(jnp.float32), 0.0)
    blocks_per_span = self.span // self.gear_block
    return token_in_block + (block % blocks_per_span) * self.gear_block, channel, value

  @staticmethod
  def _span_rows(positions, blocks: range):
    """(token, channel, value) rows [1, n s] of the span's n GEAR blocks side by side: one
    gather and one product for the span instead of one per GEAR block, on fewer padded lanes
    (2 x 164 outliers fill 3 lane tiles, not 4)."""
    rows = tuple(tuple(x[j : j + 1] for j in blocks) for x in positions)
    return tuple(row[0] if len(row) == 1 else jnp.concatenate(row, axis=1) for row in rows)

  def _one_hot(self, index: jax.Array, value: jax.Array, size: int) -> jax.Array:
    """[size, n]: row i holding the values whose index (a row [1, n]) is i."""
    hit = jax.lax.broadcasted_iota(jnp.int32, (size, index.shape[1]), 0) == index
    return jnp.where(hit, value, 0.0).astype(self.dtype)

  @staticmethod
  def _gather_lanes(operand: jax.Array, index: jax.Array) -> jax.Array:
    """float32 [rows, s]: operand[:, index] for an index row [1, s] into operand [rows, width],
    one 128-lane tile at a time (a TPU gathers lanes within one vector register: Mosaic
    refuses "multiple source vregs along gather dimension"), in float32 (it refuses 16-bit
    sources with 32-bit indices)."""
    rows, width = operand.shape
    operand = operand.astype(jnp.float32)
    index = jnp.broadcast_to(index, (rows, index.shape[1]))
    gathered = None
    for start in range(0, width, LANES):
      tile = operand[:, start : start + LANES]
      local = jnp.clip(index - start, 0, tile.shape[1] - 1)
      part = jnp.take_along_axis(tile, local, axis=1)
      gathered = part if gathered is None else jnp.where(index >= start, part, gathered)
    return gathered

  def _product(self, a, b, *, a_exact: bool):
    """a [rows, s] . b [n, s]^T -> float32 [rows, n]. `a_exact`: a is exact in the operand
    dtype; else (gathered float32 queries or probabilities) it is taken as two bfloat16
    halves (`bfloat16_halves`)."""
    if self.dtype == jnp.bfloat16 and not a_exact:
      return product_by_halves(a, b, (1,))
    precision = jax.lax.Precision.HIGHEST if self.dtype == jnp.float32 else None
    return jax.lax.dot_general(
      a.astype(self.dtype),
      b,
      (((1,), (1,)), ((), ())),
      preferred_element_type=jnp.float32,
      precision=precision,
    )

  def _spans(self):
    """(first token, width, GEAR blocks) of each span of the kernel block; the last one is
    narrower where the block (a whole segment shorter than a kernel block) ends inside it."""
    per_span = self.span // self.gear_block
    for first_block in range(0, self.gear_blocks, per_span):
      blocks = range(first_block, min(first_block + per_span, self.gear_blocks))
      yield first_block * self.gear_block, len(blocks) * self.gear_block, blocks

  def score_term(self, queries: jax.Array) -> jax.Array:
    """float32 [rows, block]: the key outliers' scores for queries [rows, D] (scaled as the
    kernel's scores are; float32, or exact in the operand dtype)."""
    parts = []
    for _, width, blocks in self._spans():
      token, channel, value = self._span_rows(self.keys, blocks)
      at_channels = self._gather_lanes(queries, channel)  # [rows, n s]
      tokens = self._one_hot(token, value, width)
      parts.append(self._product(at_channels, tokens, a_exact=queries.dtype == self.dtype))
    return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

  def value_term(self, probs: jax.Array) -> jax.Array:
    """float32 [rows, D]: sum_t p[:, t] times token t's value outliers, for the block's float32
    probabilities [rows, block] (unnormalised: the online softmax rescales it with the rest)."""
    term = None
    for start, width, blocks in self._spans():
      token, channel, value = self._span_rows(self.values, blocks)
      at_tokens = self._gather_lanes(probs[:, start : start + width], token)  # [rows, n s]
      channels = self._one_hot(channel, value, self.head_dim)
      part = self._product(at_tokens, channels, a_exact=False)
      term = part if term is None else part + term
    return term
