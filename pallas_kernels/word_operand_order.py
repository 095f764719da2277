"""Code words staged as wgmma operands one masked word per register: the "word" operand order.

A wgmma operand in registers (and the tile `stmatrix` stores from them) holds, per thread and
per 8-column group G, one 32-bit register with columns (8G + 2q, 8G + 2q + 1), q = lane % 4.
A masked planar code word (`subnormal_codes.masked_code_pairs`) is such a register, but its two
halves are channels c and c + D/2, not c and c + 1: staged in channel order, every register is
assembled from the halves of two words, one byte permute (PRMT) per register, 128 per warp and
128-token block in the folded Mosaic GPU kernel (KERNEL_NOTES v30's profile). Taken in the order
the words give instead, each masked word is a register as it is, and only the small operands
(queries, key scales, the output) follow the permutation.

With the words of a [64, W] chunk in the wgmma layout, a thread holds words 8j + 2q and
8j + 2q + 1 (t = 0, 1) of its two rows. Pair p of word 8j + 2q + t (fields p and p + P, P = 16 /
bits, in the low and high halves) becomes register G = 2P j + 2p + t, so operand column
L = 8G + 2q + h holds field p + hP of word 8j + 2q + t, which is channel

    C(L) = (p + h P) W + 8j + 2q + t          (planar packing: field k of word w is kW + w).

With 4 words a token (head_dim 64 at 2 bits) a quad's lanes take one word each (the per-warp
products' "one word per lane" order, `warp_key_product`): lane q holds word q, its pair p is
register G = p, and C(L) = (p + h P) W + q. Both are T words a lane per group of 4 T words
(T = 2, or 1 at W = 4): G = T P j + T p + t, C(L) = (p + h P) W + 4 T j + T q + t.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.warpgroup_thread import thread_coordinates

OPERAND_ORDERS = ("channel", "word")
# The register layouts `stage_words_in_word_order` can give the operand in: wgmma's, or the A
# operand of the warp-level `plgpu.mma` (mma.sync) with four warps along M, which holds the same
# elements in each thread (KERNEL_NOTES v44), its registers indexed by 16-column tiles.
OPERAND_LAYOUTS = ("wgmma", "mma_lhs")


def words_per_lane(head_dim: int, bits: int) -> int:
  """T: the words of a token each lane of a quad takes per group of 4 T words: 2 (whole 8-word
  groups, W % 8 == 0), or 1 at W = 4 (one word per lane). ValueError for other widths."""
  words = head_dim * bits // 32
  if words % 8 == 0:
    return 2
  if words == 4:
    return 1
  raise ValueError(
    f"head_dim={head_dim} with bits={bits}: {words} code words a token; the word order takes 4 or "
    f"a multiple of 8"
  )


def _split_position(position, head_dim: int, bits: int):
  """Operand position L -> (j, p, t, q, h): works on Python ints, numpy and jnp integers."""
  pairs = 16 // bits  # P: pairs per word
  lane_words = words_per_lane(head_dim, bits)  # T
  group = position // 8
  return (
    group // (lane_words * pairs),
    (group % (lane_words * pairs)) // lane_words,
    group % lane_words,
    (position % 8) // 2,
    position % 2,
  )


def channel_at_position(position, head_dim: int, bits: int):
  """C(L): the channel that operand position L holds in the "word" order (ints or arrays)."""
  words = head_dim * bits // 32
  lane_words = words_per_lane(head_dim, bits)
  j, p, t, q, h = _split_position(position, head_dim, bits)
  return (p + h * (16 // bits)) * words + 4 * lane_words * j + lane_words * q + t


def position_of_channel(channel, head_dim: int, bits: int):
  """L(C): the operand position holding `channel` in the "word" order, the inverse of
  `channel_at_position` (ints or arrays, so that a kernel can compute it on an iota)."""
  words = head_dim * bits // 32
  pairs = 16 // bits
  lane_words = words_per_lane(head_dim, bits)
  field, within = channel // words, channel % words
  h, p = field // pairs, field % pairs
  span = 4 * lane_words  # words of a group j
  j, q, t = within // span, (within % span) // lane_words, within % lane_words
  return ((j * lane_words * pairs + lane_words * p + t) * 8) + 2 * q + h


def word_order_channels(head_dim: int, bits: int) -> np.ndarray:
  """int32 [D]: channel at each operand position (a permutation of the channels)."""
  return np.asarray(channel_at_position(np.arange(head_dim), head_dim, bits), np.int32)


def channels_in_word_order(values: jax.Array, axis: int, bits: int) -> jax.Array:
  """`values` with its channel axis put in the word order: a reshape and a transpose, the same
  permutation as indexing with `word_order_channels` (no gather). C(L)'s terms are a mixed-radix
  number in (h, p, j, q, t), most significant first, and L's in (j, p, t, q, h)."""
  axis = axis % values.ndim
  head_dim = values.shape[axis]
  words = head_dim * bits // 32
  lane_words = words_per_lane(head_dim, bits)
  digits = (2, 16 // bits, words // (4 * lane_words), 4, lane_words)  # h, p, j, q, t
  split = values.reshape(*values.shape[:axis], *digits, *values.shape[axis + 1 :])
  order = [axis + i for i in (2, 1, 4, 3, 0)]  # j, p, t, q, h
  moved = list(range(axis)) + order + list(range(axis + 5, split.ndim))
  return jnp.transpose(split, moved).reshape(values.shape)


def word_order_unsupported_reason(head_dim: int, bits: int) -> str | None:
  """Why the word order cannot stage rows of this width (None if it can): it needs whole 8-word
  groups per row (W % 8 == 0), the wgmma layout's columns."""
  words = head_dim * bits // 32
  if words % 8:
    return (
      f"the word operand order at head_dim={head_dim} with bits={bits}: {words} code words per "
      f"token, not a multiple of 8"
    )
  return None


def check_operand_layout(operand_layout) -> None:
  """ValueError unless `operand_layout` is one of OPERAND_LAYOUTS."""
  if operand_layout not in OPERAND_LAYOUTS:
    raise ValueError(
      f"operand_layout={operand_layout!r} is not supported; allowed: {', '.join(OPERAND_LAYOUTS)}"
    )


def operand_register_layout(operand_layout: str):
  """(the Pallas layout, a function from a wgmma register index (row tile, 8-column group,
  ..., row half, ...) to that layout's index of the same register)."""
  if operand_layout == "wgmma":
    return plgpu.Layout.WGMMA, lambda row_tile, group, rest: (row_tile, group, *rest)
  # MMA_LHS tiles columns by 16: group G is half G % 2 of tile G // 2; rest[2] the row half
  return plgpu.Layout.MMA_LHS(jnp.bfloat16), lambda row_tile, group, rest: (
    row_tile,
    group // 2,
    0,
    group % 2,
    rest[2],
    0,
    0,
    0,
    0,
  )


def stage_words_in_word_order(
  words: jax.Array, bits: int, operand_layout: str = "wgmma"
) -> jax.Array:
  """uint32 [64, W] planar words (wgmma layout) -> bf16 [64, D] operands in the word order, each
  masked word one operand register (`inline_mgpu`), in `operand_layout` (OPERAND_LAYOUTS).
  Native only: in interpret mode, where subnormals flush, the caller stages in channel order and
  gathers `word_order_channels`."""
  check_operand_layout(operand_layout)
  rows, width = words.shape
  head_dim = width * 32 // bits
  layout, register_index = operand_register_layout(operand_layout)

  @plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA,),
    return_type=plgpu.ShapeDtypeStruct((rows, head_dim), jnp.bfloat16, layout=layout),
  )
  def unpack(_, words_array):
    # Imported here: the CUDA-only lowering modules stay out of CPU runs.
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import vector

    pairs = 16 // bits
    mosaic_layout = layout.to_mgpu() if operand_layout != "wgmma" else fa.WGMMA_LAYOUT
    registers = np.empty(mosaic_layout.registers_shape((rows, head_dim)), dtype=object)
    for index, register in np.ndenumerate(words_array.registers):
      # index: (row tile, word group j, ..., row half, ...) of the [rows, W] wgmma layout
      for t in range(2):
        word = vector.extract(
          register, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([t])
        )
        for p, masked in enumerate(masked_pair_registers(word, bits)):
          column_group = 2 * pairs * index[1] + 2 * p + t
          registers[register_index(index[0], column_group, index[2:])] = masked
    return fa.FragmentedArray(_registers=registers, _layout=mosaic_layout, _is_signed=None)

  return unpack(words)


def masked_pair_registers(word, bits: int) -> list:
  """One planar code word (an MLIR i32 value, inside `inline_mgpu` code) -> its P = 16 / bits
  operand registers (bf16 pairs): pair p holds fields p and p + P masked in place in the low and
  high halves (`subnormal_codes`), fields past a half's low byte taken from `word >> 8`."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith

  i32 = ir.IntegerType.get_signless(32)
  pair_type = ir.VectorType.get((2,), ir.BF16Type.get())
  field_mask = (1 << bits) - 1
  upper = arith.shrui(word, mgpu_utils.c(8, i32))
  registers = []
  for p in range(16 // bits):
    position = bits * p
    source = word if position + bits <= 8 else upper
    mask = (field_mask << (position % 8)) * 0x00010001
    registers.append(mgpu_utils.bitcast(arith.andi(source, mgpu_utils.c(mask, i32)), pair_type))
  return registers


def load_channels_in_word_order(vector_ref, head_dim: int, bits: int, emulate: bool) -> jax.Array:
  """A [D] per-channel vector in shared memory -> [D] in the word order, in the layout of a
  [D, n] wgmma array's per-row values (`plgpu.Layout.WGMMA.reduce(1)`): each thread loads the
  channels of its own rows, as many 16-bit loads as a channel-order read takes."""
  if emulate:
    # built in the kernel: a Pallas kernel cannot close over an array constant
    order = channel_at_position(jax.lax.iota(jnp.int32, head_dim), head_dim, bits)
    return plgpu.layout_cast(jnp.take(vector_ref[...], order), plgpu.Layout.WGMMA.reduce(1))

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(),),
    return_type=plgpu.ShapeDtypeStruct(
      (head_dim,), vector_ref.dtype, layout=plgpu.Layout.WGMMA.reduce(1)
    ),
  )
  def load(_, ref):
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref, vector

    i32 = ir.IntegerType.get_signless(32)
    index_type = ir.IndexType.get()
    layout = fa.WGMMA_LAYOUT.reduce((1,))
    element_type = ir.MemRefType(ref.type).element_type
    const, lane, warp, _ = thread_coordinates()
    first_row = arith.addi(arith.muli(warp, const(16)), arith.divui(lane, const(4)))
    registers = np.empty(layout.registers_shape((head_dim,)), dtype=object)
    for index in np.ndindex(registers.shape):
      # index: (row tile m, ..., row half, ...): row 64 m + 16 warp + 8 half + lane / 4
      row = arith.addi(first_row, const(64 * index[0] + 8 * index[2]))
      channel = channel_at_position(MlirInt(row, i32), head_dim, bits).value
      value = memref.load(ref, [arith.index_cast(index_type, channel)])
      registers[index] = vector.broadcast(ir.VectorType.get((1,), element_type), value)
    return fa.FragmentedArray(_registers=registers, _layout=layout, _is_signed=None)

  return load(vector_ref)


class MlirInt:
  """An MLIR i32 value with the integer operators `channel_at_position` uses (the divisors and
  multipliers are powers of two or small constants), so one formula serves numpy and the kernel."""

  def __init__(self, value, type_):
    self.value, self.type = value, type_

  def _binary(self, other, op):
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    other = other.value if isinstance(other, MlirInt) else mgpu_utils.c(other, self.type)
    return MlirInt(op(self.value, other), self.type)

  def __floordiv__(self, other):
    from jaxlib.mlir.dialects import arith

    return self._binary(other, arith.divui)

  def __mod__(self, other):
    from jaxlib.mlir.dialects import arith

    return self._binary(other, arith.remui)

  def __mul__(self, other):
    from jaxlib.mlir.dialects import arith

    return self._binary(other, arith.muli)

  __rmul__ = __mul__

  def __add__(self, other):
    from jaxlib.mlir.dialects import arith

    return self._binary(other, arith.addi)

  __radd__ = __add__
