"""Each lane loads only its own value slot's statistics: `value_stat_loads="own_slot"` of the
folded Mosaic GPU kernel (KERNEL_NOTES v36).

The value product's stacked operand P' [block, tiles * rows] holds, in column j of tile t,
p[token, j % real_rows] * v_scale[token, group t * slots + j // real_rows]: `value_slots` value
groups share one tile of `rows` columns. In the wgmma layout a thread holds the columns
8 i + 2 (lane % 4) + (0, 1) of its tokens (rows 16 warp + 8 half + lane / 4 of each 64-token
tile). With "all_groups" (v32 on) every thread loads each token's scale and minimum of every
value group (16 16-bit loads per thread and 64-token block at the shapes of record: 4 groups, 2
tokens, 2 statistics), converts them all, and picks its columns' group with a select per slot.
But where all of a thread's columns lie in one slot (`own_slot_unsupported_reason`), each tile
needs one group per token from it: the group of lane % 4's columns. Here each thread loads just
those (8 loads), as a row vector per tile whose four lanes of a quad hold their own slot's
values, so that broadcasting it over the tile's columns (a copy of registers, no lane exchange)
gives every column its own group's statistic with no select.

Native only (`plgpu.inline_mgpu`): interpret mode keeps the selects. `lane_groups` is the same
assignment in numpy, for tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.warpgroup_thread import thread_coordinates

VALUE_STAT_LOADS = ("all_groups", "own_slot")
DEFAULT_VALUE_STAT_LOADS = "all_groups"
WARPGROUP_THREADS = 128
_ROW_TILE = 64  # tokens of one wgmma row tile
_COLUMN_GROUP = 8  # columns a quad of lanes covers once, two per lane


def check_value_stat_loads(value_stat_loads) -> None:
  """ValueError naming `value_stat_loads` and its allowed values."""
  if value_stat_loads not in VALUE_STAT_LOADS:
    raise ValueError(
      f"value_stat_loads={value_stat_loads!r} is not supported; allowed: {VALUE_STAT_LOADS}"
    )


def thread_columns(rows: int) -> np.ndarray:
  """int [4, rows / 4]: the tile columns each lane % 4 holds in the wgmma layout."""
  quad = np.arange(4)[:, None]
  column_group = np.arange(rows // _COLUMN_GROUP)[None, :]
  first = _COLUMN_GROUP * column_group + 2 * quad
  return np.stack([first, first + 1], axis=-1).reshape(4, -1)


def own_slot_unsupported_reason(rows: int, real_rows: int, value_stats: str) -> str | None:
  """Why the lanes cannot load only their own slot's statistics (None if they can)."""
  if value_stats != "separate":
    return (
      f"value_stat_loads='own_slot' with value_stats={value_stats!r}: it loads the two bf16 "
      f"arrays (value_stats='separate')"
    )
  slots_of_lane = thread_columns(rows) // real_rows
  if np.any(slots_of_lane != slots_of_lane[:, :1]):
    return (
      f"value_stat_loads='own_slot' with {real_rows} query rows per value slot of a "
      f"{rows}-column tile: a lane's columns lie in more than one slot"
    )
  return None


def lane_groups(tile: int, rows: int, real_rows: int, value_groups: int) -> np.ndarray:
  """int [128]: the value group each thread of the warpgroup loads for `tile` (clamped to the
  last group where the tile's slot has none: those columns belong to no channel)."""
  slots = rows // real_rows
  quad = np.arange(WARPGROUP_THREADS) % 4
  return np.minimum(tile * slots + 2 * quad // real_rows, value_groups - 1)


def own_slot_statistics(
  statistics_ref,
  *,
  tiles: int,
  rows: int,
  real_rows: int,
  first_token: int = 0,
  tokens: int | None = None,
) -> list[jax.Array]:
  """Tokens [first_token, first_token + tokens) (default: all) of a [value groups, slot tokens]
  bf16 ref in shared memory (one ring slot of group-major scales or minimums) -> per value tile
  a bf16 [tokens] row vector in the wgmma row layout whose lanes hold the statistic of their own
  columns' group (`lane_groups`) for each of their tokens."""
  value_groups, slot_tokens = statistics_ref.shape
  block = slot_tokens - first_token if tokens is None else tokens
  slots = rows // real_rows
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(),),
    return_type=[plgpu.ShapeDtypeStruct((block,), jnp.bfloat16, layout=row_layout)] * tiles,
  )
  def load(_, ref):
    # Imported here: the CUDA-only lowering modules stay out of CPU runs.
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref, vector

    index_type = ir.IndexType.get()
    element_type = ir.VectorType.get((1,), ir.BF16Type.get())
    const, lane, warp, quad = thread_coordinates()
    slot = arith.divui(arith.muli(quad, const(2)), const(real_rows))
    token_in_tile = arith.addi(arith.muli(warp, const(16)), arith.divui(lane, const(4)))
    tokens = {}
    for row_tile in range(block // _ROW_TILE):
      for half in range(2):
        token = arith.addi(token_in_tile, const(first_token + _ROW_TILE * row_tile + 8 * half))
        tokens[(row_tile, half)] = arith.index_cast(index_type, token)
    outputs = []
    for tile in range(tiles):
      group = arith.minui(arith.addi(slot, const(tile * slots)), const(value_groups - 1))
      group_index = arith.index_cast(index_type, group)
      registers = np.empty(fa.WGMMA_ROW_LAYOUT.registers_shape((block,)), dtype=object)
      for (row_tile, half), token_index in tokens.items():
        value = memref.load(ref, [group_index, token_index])
        registers[row_tile, 0, half, 0, 0] = vector.broadcast(element_type, value)
      outputs.append(
        fa.FragmentedArray(_registers=registers, _layout=fa.WGMMA_ROW_LAYOUT, _is_signed=None)
      )
    return outputs

  return load(statistics_ref)
