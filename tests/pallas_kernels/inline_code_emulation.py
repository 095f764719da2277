"""Runs a kernel's inline Mosaic GPU code (`plgpu.inline_mgpu` bodies) on numpy arrays: each MLIR
op it emits is replaced by the same operation on arrays of the warpgroup's 128 threads, so a
test can read the registers it assembles and compare them with a numpy model. What only a GPU
checks is that the ops are these ops."""

import numpy as np

_LOW_32 = np.uint64(0xFFFFFFFF)


def as_uint(value):
  return np.asarray(value, np.uint64)


class CapturedArray:
  """Stands in for FragmentedArray: keeps the registers the inline code assembles."""

  last = None

  def __init__(self, *, _registers, _layout, _is_signed):
    del _layout, _is_signed
    self.registers = _registers
    CapturedArray.last = self


def emulate_inline_code(monkeypatch, *, first_thread: int, load) -> None:
  """Patches the ops the kernels' inline code uses: integer arithmetic, comparisons and selects
  on uint arrays (wrapping at 32 bits), butterfly shuffles within a warp, constants and the
  thread index as arrays over 128 threads (`first_thread` on),
  `memref.load(ref, indices)` as `load(indices)`, vectors and bitcasts as the values themselves,
  FragmentedArray as `CapturedArray`, and `inline_mgpu` as a plain call of its body."""
  from jax.experimental.mosaic.gpu import fragmented_array
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jaxlib.mlir.dialects import arith, memref, vector

  for name, op in {
    "remui": lambda a, b: as_uint(a) % as_uint(b),
    "divui": lambda a, b: as_uint(a) // as_uint(b),
    "muli": lambda a, b: (as_uint(a) * as_uint(b)) & _LOW_32,
    "addi": lambda a, b: (as_uint(a) + as_uint(b)) & _LOW_32,
    "subi": lambda a, b: (as_uint(a) - as_uint(b)) & _LOW_32,
    "andi": lambda a, b: as_uint(a) & as_uint(b),
    "xori": lambda a, b: as_uint(a) ^ as_uint(b),
    "shli": lambda a, b: (as_uint(a) << as_uint(b)) & _LOW_32,
    "minui": lambda a, b: np.minimum(as_uint(a), as_uint(b)),
    "index_cast": lambda _, value: value,
  }.items():
    monkeypatch.setattr(arith, name, op)
  monkeypatch.setattr(
    arith,
    "cmpi",
    lambda predicate, a, b: {
      arith.CmpIPredicate.ne: np.not_equal,
      arith.CmpIPredicate.eq: np.equal,
    }[predicate](as_uint(a), as_uint(b)),
  )
  monkeypatch.setattr(arith, "select", lambda condition, a, b: np.where(condition, a, b))
  monkeypatch.setattr(
    memref, "load", lambda _, index: load([np.asarray(i).astype(np.int64) for i in index])
  )
  # a butterfly shuffle within each warp: thread t takes thread t ^ distance's value
  monkeypatch.setattr(
    mgpu_utils, "shfl_bfly", lambda value, distance: np.asarray(value)[np.arange(128) ^ distance]
  )
  monkeypatch.setattr(vector, "broadcast", lambda _, value: value)
  monkeypatch.setattr(mgpu_utils, "c", lambda value, _: as_uint(np.full(128, value)))
  monkeypatch.setattr(mgpu_utils, "thread_idx", lambda: as_uint(np.arange(128) + first_thread))
  monkeypatch.setattr(mgpu_utils, "bitcast", lambda value, _: value)
  monkeypatch.setattr(fragmented_array, "FragmentedArray", CapturedArray)
  monkeypatch.setattr(plgpu, "inline_mgpu", lambda **_: lambda body: lambda ref: body(None, ref))


def captured_wgmma_operand(rows: int, columns: int) -> np.ndarray:
  """uint16 [rows, columns]: the 32-bit registers the last inline code assembled
  (`CapturedArray.last`, one array over 128 threads each), placed where the wgmma layout puts
  them: row 64 tile + 16 warp + 8 half + lane / 4, columns 8 group + 2 (lane % 4) + (0, 1), the
  first in the low half."""
  operand = np.zeros((rows, columns), np.uint16)
  thread = np.arange(128)
  warp, lane = thread // 32, thread % 32
  for index, register in np.ndenumerate(CapturedArray.last.registers):
    row_tile, column_group, half = index[0], index[1], index[4]
    row = 64 * row_tile + 16 * warp + 8 * half + lane // 4
    column = 8 * column_group + 2 * (lane % 4)
    register = np.broadcast_to(register, (128,)).astype(np.uint32)
    operand[row, column] = register & 0xFFFF
    operand[row, column + 1] = register >> 16
  return operand


def register_placements(layout, shape) -> dict:
  """{register index: [(thread, position in the register, element)]} of a [shape] array in a
  Mosaic GPU TiledLayout, by the layout's own tiling (a replicated warp dimension: every warp)."""
  tiled_shape = layout.tiling.tile_shape(shape)
  warp_dims = [d for d in layout.warp_dims if isinstance(d, int)]
  lane_dims = [d for d in layout.lane_dims if isinstance(d, int)]

  def number(tiled, dims):
    return sum(
      tiled[d] * int(np.prod([tiled_shape[e] for e in dims[i + 1 :]])) for i, d in enumerate(dims)
    )

  placements = {}
  for element in np.ndindex(*shape):
    tiled = list(layout.tiling.tile_indices(element))
    lane, position = number(tiled, lane_dims), tiled[layout.vector_dim]
    warps = [number(tiled, warp_dims)] if warp_dims else range(4)
    register = list(tiled)
    for d in (*warp_dims, *lane_dims, layout.vector_dim):
      register[d] = 0
    for warp in warps:
      placements.setdefault(tuple(register), []).append((32 * warp + lane, position, element))
  return placements


def transposed_matrix_loads(shared_bytes: np.ndarray, address) -> list:
  """`ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16` over 128 threads' byte addresses into
  `shared_bytes` (lanes 8 m .. 8 m + 7 of each warp address the rows of matrix m, each 16 bytes
  on a 16-byte boundary) -> its four registers, uint arrays over the threads."""
  from pallas_kernels.value_operand_matrix_loads import transposed_matrix_registers

  address = np.asarray(address, np.int64)
  registers = np.zeros((128, 4), np.uint32)
  for warp in range(4):
    lanes = address[32 * warp : 32 * warp + 32]
    assert np.all(lanes % 16 == 0), "a matrix row must start on 16 bytes"
    rows = np.stack([shared_bytes[a : a + 16].view(np.uint16) for a in lanes])  # [32, 8]
    registers[32 * warp : 32 * warp + 32] = transposed_matrix_registers(rows, 0)
  return [as_uint(registers[:, m]) for m in range(4)]
