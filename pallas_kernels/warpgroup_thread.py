"""A warpgroup thread's coordinates inside inline Mosaic GPU code (`plgpu.inline_mgpu` bodies):
what the kernels' register-level code (`value_operand_registers`, `value_stats_own_slot`,
`word_operand_order.load_channels_in_word_order`) derives its rows, columns and addresses from,
by the wgmma layout (row 16 warp + lane / 4 of a 64-row tile, columns 2 (lane % 4) and
2 (lane % 4) + 1 of each 8)."""


def thread_coordinates():
  """(an i32 constant maker, lane, warp within the warpgroup, lane % 4) of this thread, MLIR i32
  values. Imports the CUDA-only lowering modules when called, so CPU runs never load them."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith

  i32 = ir.IntegerType.get_signless(32)

  def const(value):
    return mgpu_utils.c(value, i32)

  thread = mgpu_utils.thread_idx()
  lane = arith.remui(thread, const(32))
  warp = arith.remui(arith.divui(thread, const(32)), const(4))
  return const, lane, warp, arith.remui(lane, const(4))
