"""The value product's tokens in the "spread" order: `token_order="spread"` of the folded Mosaic
GPU kernel (KERNEL_NOTES v37).

With the value codes as wgmma's register operand (`value_operand_registers`), lane (r, q) of a
warp loads, for operand column k = 8 G + 2 q + t, one 32-bit word of token k's row in the ring
slot. The four lanes of a row r load tokens 2 q + t: rows 0, 2, 4, 6 (or 1, 3, 5, 7) of each 8,
32 bytes per row at head_dim 128 and 2 bits, so rows 4 apart (128 bytes) sit on the same banks
and every such load takes two wavefronts instead of one (`benchmarks/shared_bank_conflicts.py`;
no TMA swizzle helps: each XORs address bit 7 into bit 4, which the word index already spans).

The value product sums over its K side, so any order of the tokens there gives the same product
as long as both operands use it. In the spread order column k of each 8 holds token
`spread_token(k)` = k ^ ((k >> 2) & 1): the upper two pairs of each 8 swap their tokens, so the
four rows one load touches are 0, 2, 5, 7 (or 1, 3, 4, 6), one per bank group, and the loads take
one wavefront each. The other operand, P' [block, tiles * rows], is computed in the ring's order
(token = row) and its rows are put in the same order before it is stored: row k takes row
spread_token(k), which for rows 4-7 of each 8 is the row the lane four up or down holds in the
same register (`spread_rows`: a butterfly shuffle and a select per register, natively).
Everything else (scores, masks, statistics, the per-token sums) stays in the ring's order.

`spread_rows` is inline Mosaic GPU code (native only); `spread_rows_emulated` is the same
permutation as a gather, which interpret mode takes (and which the native path cannot: Mosaic GPU
has no gather on register arrays).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.warpgroup_thread import thread_coordinates

TOKEN_ORDERS = ("natural", "spread")
DEFAULT_TOKEN_ORDER = "natural"
_LANE_ROW_BIT = 16  # lane bit that is bit 2 of the row within 8 (row = lane / 4)
_PAIR_LANES = 4  # lanes between rows r and r ^ 1 of the wgmma layout


def check_token_order(token_order) -> None:
  """ValueError naming `token_order` and its allowed values."""
  if token_order not in TOKEN_ORDERS:
    raise ValueError(f"token_order={token_order!r} is not supported; allowed: {TOKEN_ORDERS}")


def token_order_unsupported_reason(token_order: str, value_operand: str) -> str | None:
  """Why the kernel cannot take the value product's tokens in `token_order` (None if it can)."""
  if token_order == "spread" and value_operand != "registers":
    return (
      f"token_order='spread' with value_operand={value_operand!r}: it orders the register value "
      f"operand's loads (value_operand='registers')"
    )
  return None


def spread_token(column):
  """The ring token operand column (or P' row) `column` holds in the spread order: an
  involution within each aligned 8 (numpy or jnp integers)."""
  return column ^ ((column >> 2) & 1)


def token_of_column(column, token_order: str):
  """The ring token an operand column holds in `token_order`."""
  check_token_order(token_order)
  return column if token_order == "natural" else spread_token(column)


def spread_rows_emulated(array: jax.Array) -> jax.Array:
  """[tokens, n] -> rows in the spread order (row k takes row spread_token(k)), as a gather:
  interpret mode's path. The order is built in the kernel: a Pallas kernel cannot close over
  an array constant."""
  return jnp.take(array, spread_token(lax.iota(jnp.int32, array.shape[0])), axis=0)


def spread_rows(array: jax.Array) -> jax.Array:
  """A [tokens, n] 32-bit-register wgmma-layout array (bf16 pairs or f32) -> the same with its
  rows in the spread order (`inline_mgpu`, native only): rows 4-7 of each 8 take the register
  the lane four away holds (`shfl.bfly` by 4 lanes), rows 0-3 keep their own."""

  @plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA,),
    return_type=plgpu.ShapeDtypeStruct(array.shape, array.dtype, layout=plgpu.Layout.WGMMA),
  )
  def shuffle(_, fragments):
    # Imported here: the CUDA-only lowering modules stay out of CPU runs.
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir.dialects import arith

    const, lane, _, _ = thread_coordinates()
    upper = arith.cmpi(
      arith.CmpIPredicate.ne, arith.andi(lane, const(_LANE_ROW_BIT)), const(0)
    )  # rows 4-7 of each 8
    registers = np.empty(fragments.registers.shape, dtype=object)
    for index, register in np.ndenumerate(fragments.registers):
      partner = mgpu_utils.shfl_bfly(register, _PAIR_LANES)
      registers[index] = arith.select(upper, partner, register)
    return fa.FragmentedArray(
      _registers=registers, _layout=fa.WGMMA_LAYOUT, _is_signed=fragments.is_signed
    )

  return shuffle(array)
