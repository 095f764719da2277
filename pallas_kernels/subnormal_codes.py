"""2- and 4-bit codes as bf16 tensor-core operands with one AND per pair: small bf16 bit patterns.

A bf16 bit pattern m < 0x100 (exponent field 0 or 1) is the number m * 2^-133 exactly: patterns
below 0x80 are the subnormals m * 2^-133, and 0x80..0xFF, the first normal binade, are
(1 + (m - 128) / 128) * 2^-126 = m * 2^-133, so the map stays linear across the boundary. A code
c masked in place at bit q (q + bits <= 8) of each 16-bit half of a word is therefore the bf16
number c * 2^(q - 133): `word & (mask << q) * 0x00010001` makes a pair of operands in one
instruction, where the "offset" encoding (`folded_scales_kernel_triton`) needs a shift, an
AND-OR with the bits of 128.0 and a packed subtraction of 128. Fields above bit 7 of a half come
from `word >> 8` (one shift per word, shared by all its upper fields).

The powers of two go to the other operand and back out of the f32 results, all exact:
  keys:   the queries are pre-scaled by 2^(QUERY_EXPONENT - q) per channel position, so each
          product is code * q * k_scale * 2^(QUERY_EXPONENT - 133); the scores are multiplied by
          SCORE_SCALE = 2^(133 - QUERY_EXPONENT).
  values: the stacked probabilities are scaled by 2^PROBS_EXPONENT, so output position c
          accumulates 2^(PROBS_EXPONENT + q_c - 133) times its value; `output_position_scale`
          undoes that once, after the last block.
The exponents keep every operand inside bf16's range (|q * k_scale| < 2^59, v_scale < 2^64) and
the products far above f32's subnormals.

This relies on the tensor cores taking subnormal bf16 inputs exactly, which NVIDIA's do (checked
on an H100 by the native tests). XLA on CPU flushes subnormals to zero, so in interpret mode
`dot_with_code_operand` computes the same dot from the bit patterns read as integers.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.float_unpacking import bf16_halves

CODE_OPERANDS = ("subnormal", "offset")
QUERY_EXPONENT = 69
PROBS_EXPONENT = 64
SCORE_SCALE = 2.0 ** (133 - QUERY_EXPONENT)
PROBS_SCALE = 2.0**PROBS_EXPONENT
_LOW_BYTE = 8  # bits of a half that stay in the first two binades


def code_exponent(channels, head_dim: int, bits: int):
  """Bit q at which the code of each channel sits in its half-word operand (so its operand is
  code * 2^(q - 133)); `channels` int, jnp or numpy. Field k of a planar word holds channels
  [k * W, (k + 1) * W) and sits at bit bits * k, i.e. bit (bits * k) % 16 of its half, and the
  upper byte of a half is shifted down by 8."""
  width = head_dim * bits // 32
  return (bits * (channels // width)) % _LOW_BYTE


def masked_code_pairs(words: jax.Array, bits: int) -> list:
  """uint32 [rows, W] planar words -> one uint32 [rows, W] per pair of fields (j, j + n/2): field
  j's code masked in place in the low half, field j + n/2's in the high half, each at bit
  `code_exponent` of its half (fields above bit 7 of a half taken from `word >> 8`)."""
  fields = 32 // bits
  field_mask = (1 << bits) - 1
  upper_bytes = jnp.right_shift(words, jnp.uint32(_LOW_BYTE))
  pairs = []
  for j in range(fields // 2):
    position = bits * j
    source = words if position + bits <= _LOW_BYTE else upper_bytes
    bit = position % _LOW_BYTE
    pairs.append(source & jnp.uint32((field_mask << bit) * 0x00010001))
  return pairs


def subnormal_code_pairs(words: jax.Array, bits: int) -> list:
  """uint32 [rows, W] planar words -> [(low, high)] bf16 [rows, W] per pair of fields (j,
  j + n/2), the same pairs as the offset encoding; element value code * 2^(q - 133)."""
  return [bf16_halves(masked) for masked in masked_code_pairs(words, bits)]


def power_of_two(exponents: jax.Array) -> jax.Array:
  """float32 2^e for int32 exponents in the normal range, exactly (built from the bits)."""
  biased = (exponents.astype(jnp.int32) + 127).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(jnp.left_shift(biased, jnp.uint32(23)), jnp.float32)


def query_position_scale(order, head_dim: int, bits: int):
  """float32 [D] 2^(QUERY_EXPONENT - q) per position of `order` (channel at each position)."""
  return power_of_two(QUERY_EXPONENT - code_exponent(order, head_dim, bits))


def output_position_scale(order, head_dim: int, bits: int):
  """float32 [D] 2^(133 - PROBS_EXPONENT - q) per position: undoes the value operands' scale."""
  return power_of_two(133 - PROBS_EXPONENT - code_exponent(order, head_dim, bits))


def dot_with_code_operand(dot, lhs, rhs, *, codes_are_lhs: bool, emulate: bool):
  """`dot(lhs, rhs)` where one side holds subnormal-pattern codes. `emulate` (interpret mode,
  where XLA flushes subnormals): the patterns read as integers m, the other side scaled by
  2^-64 and the result by 2^-69, which is the same dot (m * 2^-133 per code) within f32
  rounding and without a subnormal anywhere."""
  if not emulate:
    return dot(lhs, rhs)
  codes, other = (lhs, rhs) if codes_are_lhs else (rhs, lhs)
  integers = jax.lax.bitcast_convert_type(codes, jnp.uint16).astype(jnp.float32)
  other = other.astype(jnp.float32) * 2.0**-64
  result = dot(integers, other) if codes_are_lhs else dot(other, integers)
  return result * 2.0**-69
