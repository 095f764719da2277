"""Packed 2- and 4-bit codes as bfloat16 matrix operands by bit operations alone (TPU).

A 32-bit word holds two bfloat16 numbers. Masking a word so that each 16-bit half keeps one
code field inside its 7 mantissa bits, and OR-ing in the exponent of 1.0 (0x3F80 in each half),
leaves two bfloat16 numbers 1 + code * 2^(p - 7), p the field's lowest bit within its half:
two codes made MXU operands by one AND and one OR (and a shift shared by the fields that need
it), where unpacking each code to float32 (shift, mask, convert), scaling it and packing the
float32 results into bfloat16 took several operations per code. On a TPU v5e, which has no
bfloat16 vector unit, that unpacking was most of the quantized kernel's vector work (KERNEL_NOTES
v57). `pltpu.bitcast` reads the masked [W, n] words as [2 W, n] bfloat16, row 2 w the low half
of word w and row 2 w + 1 its high half.

Each 16-bit half of a word holds 16 / bits fields, field j at bit bits * j of the low half and
its partner j + 16 / bits at the same bit of the high half: a "chain" j takes both. With the
planar packing (`bit_packing`: field f of word w is channel f W + w) chain j, word w, half h is
operand row

  row = j * 2 W + 2 w + h,   channel = (j + h * 16 / bits) * W + w,   code = (x - 1) * 2^(7 - p_j).

The factor 2^(7 - p_j) (a power of two: exact) and the constant 1 go to the other operand and
to the result: a kernel scales the other operand's entries by the factor, in `pair_matrix`'s
row order, and subtracts the product of that operand with ones (every row's sum). The codes
never carry NaN: any stored bits give a finite number in [1, 2).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

PAIR_BITS = (2, 4)  # 8-bit fields do not fit in bfloat16's 7 mantissa bits
MANTISSA_BITS = 7
_ONE_PAIR = 0x3F803F80  # bfloat16 1.0 in both halves


@dataclasses.dataclass(frozen=True)
class PairChain:
  shift: int  # the word's right shift before the mask
  position: int  # the field's lowest bit in its half after the shift: its mantissa bit


def pair_chains(bits: int) -> tuple[PairChain, ...]:
  """The chains of one word, in row order: as many fields per shift as fit in the mantissa."""
  if bits not in PAIR_BITS:
    raise ValueError(f"bits={bits!r} has no bfloat16 code pairs; allowed: {PAIR_BITS}")
  chains, shift = [], 0
  for field in range(16 // bits):
    if bits * field - shift + bits > MANTISSA_BITS:
      shift = bits * field
    chains.append(PairChain(shift, bits * field - shift))
  return tuple(chains)


def code_pairs(words: jax.Array, bits: int) -> jax.Array:
  """uint32 [W, n] packed words -> bfloat16 [D, n] operand rows (module docstring's order),
  row value 1 + code * 2^(p - 7)."""
  moved, rows = {}, []
  for chain in pair_chains(bits):
    if chain.shift not in moved:
      moved[chain.shift] = words >> jnp.uint32(chain.shift) if chain.shift else words
    field_mask = (2**bits - 1) << chain.position
    masked = moved[chain.shift] & jnp.uint32(field_mask | field_mask << 16)
    rows.append(pltpu.bitcast(masked | jnp.uint32(_ONE_PAIR), jnp.bfloat16))
  return jnp.concatenate(rows, axis=0)


def pair_rows(head_dim: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
  """(channel int32 [D], factor float32 [D]) of each operand row: the row's value less 1, times
  its factor, is the channel's code."""
  words = head_dim * bits // 32
  chains = pair_chains(bits)
  channel = np.zeros(head_dim, np.int32)
  factor = np.zeros(head_dim, np.float32)
  for j, chain in enumerate(chains):
    for w in range(words):
      for h in range(2):
        row = j * 2 * words + 2 * w + h
        channel[row] = (j + h * len(chains)) * words + w
        factor[row] = 2.0 ** (MANTISSA_BITS - chain.position)
  return channel, factor


def pair_matrix(head_dim: int, bits: int) -> np.ndarray:
  """float32 [D, D]: entry (row, channel) the row's factor where the row holds the channel, 0
  elsewhere (exact in bfloat16). `x @ pair_matrix.T` puts channel-ordered x into row order,
  scaled by the factors; `y @ pair_matrix` the other way."""
  channel, factor = pair_rows(head_dim, bits)
  matrix = np.zeros((head_dim, head_dim), np.float32)
  matrix[np.arange(head_dim), channel] = factor
  return matrix


def decoded_pairs(pairs: jax.Array, head_dim: int, bits: int) -> jax.Array:
  """float32 [D, n] codes in channel order from `code_pairs`' rows (a reference for tests)."""
  channel, factor = pair_rows(head_dim, bits)
  codes = (pairs.astype(jnp.float32) - 1.0) * jnp.asarray(factor)[:, None]
  return jnp.zeros_like(codes).at[jnp.asarray(channel)].set(codes)
