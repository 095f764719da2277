"""The value product per warp (KERNEL_NOTES v44, v45): each warp's own tokens' V^T . P'^T into
its own partial output, by `mma.sync.m16n8k16`, the per-token value statistics each lane needs,
and the four warps' partial outputs added once per split.

KIVI's values have a scale and a minimum per token and 32-channel group, so P' depends on a
channel's value group. With up to 4 query rows an 8-column B operand holds two groups: columns
4 s + j (slot s, row j); with 5 to 8 rows (`query_rows`) it holds one, every column its own row.
The value product's rows are channels in the order the codes leave the transposing matrix loads.
A half-word holds F = 16 / bits fields (8 at 2 bits, 4 at 4) and a token W = D bits / 32 words,
2 W half-words. With whole blocks of 16 half-words (W a multiple of 8: head_dim 128, and 64 at 4
bits) each block is one `ldmatrix.x4.trans` per 16 tokens, and m-tile m = F blk + p (16 rows) of
warp w's partial output is field p of half-word 16 blk + r, i.e. channel

  c(m, r) = (F (r % 2) + p) W + 8 blk + r // 2    (at D = 128, 2 bits: 64 (r % 2) + 8 p + r // 2)

At head_dim 64 with 2-bit codes a token is 8 half-words: one `ldmatrix.x2.trans` per 16 tokens,
and each loaded register serves two m-tile rows (rows 0-7 field m, rows 8-15 field m + 4, the
same bit of the other byte, so the register and its copy shifted by 8 take one mask):

  c(m, r) = (8 (r % 2) + m + 4 (r // 8)) 4 + (r % 8) // 2

(`value_row_channel`, inverted by `value_row_of_channel`). Either way a row's parity r % 2 is its
half of the channels, and its value group is (D / 64) (r % 2) + b, b = `group_in_half(m)` (at
D = 128 b = p // (F / 2); at 64 b = 0). At 4 query rows the m-tiles of pairing b take P' of that
pairing (slot s of its columns: group (D / 64) s + b), and each row reads its own slot s = r % 2
(the other slot's columns are dropped when the warps' outputs are added): two operands at D =
128, one at 64 (`value_operands`). At 8 query rows an m-tile's even and odd rows need different
P' (one per group): two MMAs an m-tile, each with the code operand of the other half's rows
zeroed (a lane's A registers are rows of one parity), into one accumulator: twice the 4-row
product's MMAs, the same accumulator registers.

- `statistics_by_slot`: the per-token statistic of each column's slot group, f32 [64, 8]: a lane's
  two columns share a slot, so it loads its two tokens' values of one group;
  `statistics_by_matrix_loads` the same for both statistics of one ring slot, two tokens a
  register by transposing matrix loads (the kernel's statistic_loads="matrix_loads").
- `value_product_per_warp`: P' (bf16 [64, 8] per operand; rows the warp's tokens as the key
  product's scores hold them) moved to B operands by `movmatrix.trans`, the warp's own 16
  tokens' value codes by the matrix loads above (from a ring slot TMA-swizzled a token row wide
  with `swizzled`: unswizzled, a matrix's 8 rows, a token row apart, share banks two or four at a
  time at 32- or 64-byte rows), D / 16 MMAs (twice that at 8 rows) into the
  partial output, a [4 D, 8] f32 array in the wgmma layout whose row 64 m + 16 w + r is warp w's
  m-tile m.
- `add_warp_partials` (head_dim 128, the experiments'): f32 [128, 4], channel c's 4 rows summed
  over the warps from its slot.
- `finished_own_slot_outputs`: each split's normalised output, f32 [rows, D].

Native only; the `_emulated` functions compute the same arrays by jnp for interpret mode, and
`tests/pallas_kernels/test_warp_products_inline.py` runs the inline code on numpy lane by lane.
Supported: 2- and 4-bit planar codes at head_dim 64 and 128, value groups of 32 channels, 4 or
8 query rows (`ROW_COUNTS`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.bit_packing import packed_width, unpack_codes
from pallas_kernels.subnormal_codes import code_exponent, power_of_two
from pallas_kernels.value_operand_matrix_loads import ring_swizzle_bytes, ring_transforms
from pallas_kernels.warp_key_product import COLUMNS, TILE_ROWS, warp_rows
from pallas_kernels.warpgroup_thread import thread_coordinates
from pallas_kernels.word_operand_order import MlirInt, words_per_lane

VALUE_GROUP = 32  # channels of a value group
REAL_ROWS = 4  # query rows of a slot when two slots share the 8 columns
ROW_COUNTS = (REAL_ROWS, COLUMNS)  # query rows the products take: two slots of 4, or one of 8
_CODE_UNIT_EXPONENT = 133
_PROBS_EXPONENT = 64
_CHUNK = 16  # bytes of an ldmatrix row, the unit a TMA swizzle moves
_SWIZZLE_ROW = 128  # bytes: a TMA swizzle XORs address bits 7.. into the chunk index


def value_groups(head_dim: int) -> int:
  """Value groups of a token: 4 at head_dim 128, 2 at 64."""
  return head_dim // VALUE_GROUP


def partial_rows(head_dim: int) -> int:
  """Rows of the per-warp partial outputs: head_dim / 16 m-tiles of 16 rows per warp (512 at
  head_dim 128, 256 at 64)."""
  return 4 * head_dim


def _groups_per_half(head_dim: int) -> int:
  """Value groups in each half of the channels (a row's parity): 2 at head_dim 128, 1 at 64."""
  return head_dim // 64


def value_row_channel(m: int, r: int, head_dim: int, bits: int) -> int:
  """c(m, r): the channel that row r of m-tile m of a warp's partial output holds (the module
  text; Python ints)."""
  words, fields = packed_width(head_dim, bits), 16 // bits
  if words_per_lane(head_dim, bits) == 1:  # 4 words a token: 8 half-words, one x2 load
    half_word, field = r % 8, m + 4 * (r // 8)
    return (fields * (half_word % 2) + field) * words + half_word // 2
  blk, p = divmod(m, fields)
  return (fields * (r % 2) + p) * words + 8 * blk + r // 2


def value_row_of_channel(channel, head_dim: int, bits: int):
  """(m-tile, row, slot = half, field in its half-word) of `channel` in the partial outputs, the
  inverse of `value_row_channel` (ints, jnp arrays or `MlirInt`s: a kernel computes it on its
  thread index or an iota)."""
  words, fields = packed_width(head_dim, bits), 16 // bits
  field, word = channel // words, channel % words  # field k of word `word`
  half, p = field // fields, field % fields
  if words_per_lane(head_dim, bits) == 1:  # half-word 2 word + half; rows 8 (p // 4) + that
    return p % 4, (p // 4) * 8 + word * 2 + half, half, p
  return (word // 8) * fields + p, (word % 8) * 2 + half, half, p


def query_rows(group: int) -> int:
  """The query rows (`ROW_COUNTS`) a query group of `group` heads per KV head is padded to."""
  if not 1 <= group <= COLUMNS:
    raise ValueError(f"query group {group} is not supported; allowed: 1 to {COLUMNS}")
  return REAL_ROWS if group <= REAL_ROWS else COLUMNS


def check_rows(rows: int) -> None:
  """ValueError naming `rows` and its allowed values."""
  if rows not in ROW_COUNTS:
    raise ValueError(f"rows={rows!r} is not supported; allowed: {ROW_COUNTS}")


def value_operands(rows: int, head_dim: int = 128) -> int:
  """P' operands (and sums of p v_min) per tile: at 4 rows one per pairing b (slot s of the
  columns holding group 2 s + b at head_dim 128, group s at 64), at 8 rows one per value
  group."""
  check_rows(rows)
  return _groups_per_half(head_dim) if rows == REAL_ROWS else value_groups(head_dim)


def operand_of_half(rows: int, head_dim: int, s: int, b: int) -> int:
  """Which P' an m-tile's rows of half s (r % 2 = s) take, b their group within the half: pairing
  b's at 4 rows (its slot s columns hold that group), the group's own at 8 rows."""
  return b if rows == REAL_ROWS else _groups_per_half(head_dim) * s + b


def group_in_half(m: int, head_dim: int, bits: int) -> int:
  """b: the value group within its half of m-tile m's rows (the same for both halves)."""
  return (value_row_channel(m, 0, head_dim, bits) % (head_dim // 2)) // VALUE_GROUP


def m_tiles(bits: int, head_dim: int = 128) -> list[tuple[int, int, int]]:
  """(m, blk, p) of the head_dim / 16 m-tiles: m-tile m = F blk + p holds field p of half-words
  16 blk .. 16 blk + 15 (F = 16 / bits fields a half-word); with one word per lane (4 words a
  token) blk = 0 and p = m (rows 8-15: field m + 4)."""
  if words_per_lane(head_dim, bits) == 1:
    return [(m, 0, m) for m in range(head_dim // 16)]
  fields = 16 // bits
  blocks = packed_width(head_dim, bits) // 8  # of 16 half-words
  return [(fields * blk + p, blk, p) for blk in range(blocks) for p in range(fields)]


def field_shift_and_bit(bits: int, p: int) -> tuple[int, int]:
  """(the right shift of a half-word register before the mask, the field's bit in its byte) of
  field p: fields past the low byte come from the register shifted down by 8."""
  per_byte = 8 // bits
  return 8 * (p // per_byte), bits * (p % per_byte)


def _rows_of_operands(operands: int, head_dim: int) -> int:
  """The query rows that `operands` P' (one a `value_operands`) serve; ValueError otherwise."""
  for rows in ROW_COUNTS:
    if operands == value_operands(rows, head_dim):
      return rows
  allowed = [value_operands(rows, head_dim) for rows in ROW_COUNTS]
  raise ValueError(
    f"{operands} P' operands at head_dim {head_dim}; allowed: {allowed} (4 or 8 query rows)"
  )


def value_product_per_warp(
  probs,
  words_ref,
  acc,
  tile: int = 0,
  tiles: int = 1,
  bits: int = 2,
  head_dim: int = 128,
  swizzled: bool = False,
):
  """acc f32 [4 D, 8] (wgmma layout: row 64 m + 16 w + r is warp w's m-tile m) plus each warp's
  V^T [D, 16 own tokens] . P'^T [16, 8]. `probs`: P' bf16 [64, 8] (wgmma layout: warp w's rows
  are its tokens 16 tiles w + 16 tile ..), `value_operands(rows, D)` of them: the one row r of
  m-tile m takes is `operand_of_half(rows, D, r % 2, group_in_half(m))`; `words_ref` the block's
  value words [64 tiles, W] uint32 in shared memory, `swizzled` if it was copied in with
  `value_operand_matrix_loads.ring_transforms` (`inline_mgpu`, native only)."""
  wgmma = plgpu.Layout.WGMMA
  words = packed_width(head_dim, bits)
  row_bytes = 4 * words
  operands = len(probs)
  rows = _rows_of_operands(operands, head_dim)
  one_word = words_per_lane(head_dim, bits) == 1

  swizzle = ring_swizzle_bytes(head_dim, bits) if swizzled else 0
  ring_type = plgpu.RefType(transforms=ring_transforms(head_dim, bits) if swizzled else ())

  @plgpu.inline_mgpu(
    arg_types=([wgmma] * operands, ring_type, wgmma),
    return_type=plgpu.ShapeDtypeStruct(
      (partial_rows(head_dim), COLUMNS), jnp.float32, layout=wgmma
    ),
  )
  def product(_, probs_arrays, ref, accumulator):
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, vector

    i32 = ir.IntegerType.get_signless(32)
    i8 = ir.IntegerType.get_signless(8)
    f32 = ir.F32Type.get()
    const, lane, warp, _ = thread_coordinates()

    def transposed(register):
      # P' [token, column] pairs of an 8 x 8 block -> [column, token] pairs: the B fragment
      return mgpu_utils.inline_ptx(
        "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
        mgpu_utils.bitcast(register, i32),
        result_types=i32,
        convergent=True,
      )

    # P' [64, 8] bf16: each thread's registers are (token 16 w + g + 8 h, columns 2 t, 2 t + 1)
    b_operands = []
    for probs_array in probs_arrays:
      registers = probs_array.registers.reshape(-1)  # h = 0, 1
      b_operands.append([transposed(registers[0]), transposed(registers[1])])
    matrix = arith.divui(lane, const(8))
    first = arith.addi(arith.muli(warp, const(16 * tiles)), const(16 * tile))
    if one_word:
      # .x2: lanes 8 m .. 8 m + 7 (m = 0, 1; lanes 16-31 repeat them, unread) address the rows
      # of matrix m: token 16 tiles w + 16 tile + 8 m + l % 8, its whole 16-byte row
      token = arith.addi(
        arith.addi(first, arith.muli(arith.remui(matrix, const(2)), const(8))),
        arith.remui(lane, const(8)),
      )
      chunk = const(0)
      instruction = "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {$0, $1}, [$2];"
      blocks, loads = 1, 2
    else:
      # .x4: lanes 8 m .. 8 m + 7 address the rows of matrix m: token 16 tiles w + 16 tile +
      # 8 (m / 2) + l % 8, 16-byte chunk 2 blk + m % 2 of its row (one load per 16 half-words)
      token = arith.addi(
        arith.addi(first, arith.muli(arith.divui(matrix, const(2)), const(8))),
        arith.remui(lane, const(8)),
      )
      chunk = arith.remui(matrix, const(2))
      instruction = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];"
      blocks, loads = words // 8, 4
    row = arith.muli(token, const(row_bytes))
    # Where the ring's swizzle put chunk k of the lane's row: k XOR the row's bits 7.. (a row is
    # the swizzle's width, so they are the token's low bits, the lane's own; `swizzled_offsets`).
    # Unswizzled, a matrix's 8 rows share banks two (32-byte rows) or four (64-byte) at a time.
    row_bits = (
      arith.andi(arith.divui(row, const(_SWIZZLE_ROW)), const(swizzle // _CHUNK - 1))
      if swizzle
      else None
    )

    def address(blk: int):
      block_chunk = arith.addi(chunk, const(2 * blk))
      if row_bits is not None:
        block_chunk = arith.xori(block_chunk, row_bits)
      offset = arith.addi(row, arith.muli(block_chunk, const(_CHUNK)))
      return mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [offset], i8)

    loaded = [
      mgpu_utils.inline_ptx(
        instruction,
        address(blk),
        result_types=[i32] * loads,
        has_side_effects=True,
        convergent=True,
      )
      for blk in range(blocks)
    ]
    upper = [[arith.shrui(register, const(8)) for register in block] for block in loaded]
    if rows == REAL_ROWS:
      half_masks = [None]  # one MMA an m-tile: both halves' rows against one P'
    else:
      # A lane's A registers hold rows g and g + 8 (g = lane / 4), one parity: all ones in the
      # lanes of half s's rows, zero in the others'.
      parity = arith.andi(arith.divui(lane, const(4)), const(1))
      half_masks = [arith.subi(parity, const(1)), arith.subi(const(0), parity)]
    registers = np.empty(accumulator.registers.shape, dtype=object)
    undefined = llvm.mlir_undef(ir.VectorType.get((2,), f32))
    field_mask = (1 << bits) - 1
    for m, blk, p in m_tiles(bits, head_dim):
      shift, bit = field_shift_and_bit(bits, p)
      mask = const((field_mask << bit) * 0x00010001)
      if one_word:
        # rows g: field m of the half-words (low byte); rows g + 8: field m + 4, the same bit of
        # the high byte: (a0, a1, a2, a3) = tokens 0-7 and 8-15, each low and shifted
        sources = [loaded[0][0], upper[0][0], loaded[0][1], upper[0][1]]
      else:
        sources = upper[blk] if shift else loaded[blk]
      fields_of = [arith.andi(register, mask) for register in sources]
      d = [
        vector.extract(
          accumulator.registers[(m, 0, 0, 0, h, 0, 0, 0, 0)],
          dynamic_position=[],
          static_position=ir.DenseI64ArrayAttr.get([i]),
        )
        for h in range(2)
        for i in range(2)
      ]
      b_group = group_in_half(m, head_dim, bits)
      for s, half_mask in enumerate(half_masks):
        a = fields_of if half_mask is None else [arith.andi(x, half_mask) for x in fields_of]
        b = b_operands[operand_of_half(rows, head_dim, s, b_group)]
        d = mgpu_utils.inline_ptx(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
          "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
          *a,
          *b,
          *d,
          result_types=[f32] * 4,
          convergent=True,  # warp-wide (.sync.aligned): out of divergent code
        )
      for h in range(2):
        pair = llvm.insertelement(undefined, d[2 * h], position=const(0))
        pair = llvm.insertelement(pair, d[2 * h + 1], position=const(1))
        registers[(m, 0, 0, 0, h, 0, 0, 0, 0)] = pair
    return fa.FragmentedArray(_registers=registers, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return product(list(probs), words_ref, acc)


def _contiguous_runs(channels: list[int]) -> list[tuple[int, int]]:
  """(first, count) runs of consecutive channels, in order."""
  runs = []
  for channel in channels:
    if runs and runs[-1][0] + runs[-1][1] == channel:
      runs[-1] = (runs[-1][0], runs[-1][1] + 1)
    else:
      runs.append((channel, 1))
  return runs


def value_product_per_warp_emulated(
  probs, words, acc, tile: int, tiles: int, bits: int = 2, head_dim: int = 128
):
  """`value_product_per_warp` by jnp (interpret mode): `words` the block's value words
  uint32 [64 tiles, W] (an array, not a ref). Row 64 m + 16 w + r of the increment is
  channel c(m, r) (`value_row_channel`) summed over warp w's tokens of the tile, against the P'
  its half r % 2 takes (`operand_of_half`) in every column; the code patterns' powers of two go
  into P' before the sum (they are subnormal, which XLA on CPU flushes)."""
  rows = _rows_of_operands(len(probs), head_dim)
  codes = warp_rows(unpack_codes(words, bits).astype(jnp.float32), tile, tiles)  # [64, D]
  blocks = []
  for m, _, _ in m_tiles(bits, head_dim):
    # the field's bit in its byte e (the same in every row of the m-tile): code * 2^(e - 133)
    # taken as code * (P' 2^(e - 69)) 2^-64, in the normal range throughout
    bit = int(code_exponent(value_row_channel(m, 0, head_dim, bits), head_dim, bits))
    unit = 2.0 ** (bit - (_CODE_UNIT_EXPONENT - _PROBS_EXPONENT))
    operand_of = [
      probs[operand_of_half(rows, head_dim, s, group_in_half(m, head_dim, bits))] for s in range(2)
    ]
    for w in range(4):
      tokens = slice(16 * w, 16 * w + 16)
      halves = []
      for s in range(2):  # rows r = 2 i + s, i = 0 .. 7, in static runs of channels
        channels = [value_row_channel(m, r, head_dim, bits) for r in range(s, 16, 2)]
        own = jnp.concatenate(
          [codes[tokens, first : first + count] for first, count in _contiguous_runs(channels)],
          axis=1,
        )
        halves.append(
          jnp.einsum(
            "ti,tc->ic",
            own,
            operand_of[s][tokens].astype(jnp.float32) * unit,
            precision="highest",
          )
        )
      blocks.append(jnp.stack(halves, axis=1).reshape(16, COLUMNS))  # row 2 i + s
  return acc + jnp.concatenate(blocks, axis=0) * 2.0**-_PROBS_EXPONENT


def statistics_by_slot(
  ring_ref, b: int, tile: int = 0, tiles: int = 1, rows: int = REAL_ROWS, head_dim: int = 128
):
  """f32 [64, 8] (wgmma layout): each element the statistic of its token (row 16 w + r: token
  16 tiles w + 16 tile + r) in the value group of its column's slot, from the block's
  [D / 32, 64 tiles] bf16 statistics in shared memory: at 4 query rows group 2 (column // 4) + b
  (two slots of 4 columns; group column // 4 at head_dim 64), at 8 rows group b in every column.
  A lane's two columns share a slot, so it loads its two tokens' values of one group (2 16-bit
  loads), where array code selects between two broadcast tiles on every element. Values past a
  row's length are loaded as they are (the kernel masks them; `inline_mgpu`, native only)."""
  check_rows(rows)
  per_half = _groups_per_half(head_dim)

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(),),
    return_type=plgpu.ShapeDtypeStruct(
      (TILE_ROWS, COLUMNS), jnp.float32, layout=plgpu.Layout.WGMMA
    ),
  )
  def load(_, ref):
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref, vector

    f32 = ir.F32Type.get()
    index = ir.IndexType.get()
    const, lane, warp, quad = thread_coordinates()
    if rows == REAL_ROWS:  # columns 2 quad, 2 quad + 1 are slot quad // 2's
      group = arith.addi(arith.muli(arith.divui(quad, const(2)), const(per_half)), const(b))
    else:
      group = const(b)
    token = arith.addi(
      arith.addi(arith.muli(warp, const(16 * tiles)), const(16 * tile)),
      arith.divui(lane, const(4)),
    )
    registers = np.empty(fa.WGMMA_LAYOUT.registers_shape((TILE_ROWS, COLUMNS)), dtype=object)
    for h in range(2):
      value = memref.load(
        ref,
        [arith.index_cast(index, group), arith.index_cast(index, arith.addi(token, const(8 * h)))],
      )
      registers[(0, 0, 0, 0, h, 0, 0, 0, 0)] = vector.broadcast(
        ir.VectorType.get((2,), f32), arith.extf(f32, value)
      )
    return fa.FragmentedArray(_registers=registers, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return load(ring_ref)


def statistics_by_matrix_loads(
  statistics_ref, tile: int = 0, tiles: int = 1, rows: int = REAL_ROWS, head_dim: int = 128
):
  """[(scale, minimum) f32 [64, 8] for each P' operand b]: what `statistics_by_slot` gives for
  each of the block's two statistics, from their [2, D / 32, 64 tiles] bf16 ring slot (scales,
  then minimums) by transposing matrix loads. Matrix (b, statistic) has rows 2 q + e: the 8
  tokens 16 tiles w + 16 tile + 8 e .. of the group of quad lane q's columns, so lane (g, q)
  receives tokens g and g + 8 of its group in one register's two halves: one
  `ldmatrix.x4.trans` per two operands a tile (`.x2` for one) where `statistics_by_slot` makes a
  16-bit load per token and statistic (`inline_mgpu`, native only)."""
  check_rows(rows)
  per_half = _groups_per_half(head_dim)
  groups = value_groups(head_dim)
  slot_tokens = TILE_ROWS * tiles
  operands = value_operands(rows, head_dim)
  stat_type = plgpu.ShapeDtypeStruct((TILE_ROWS, COLUMNS), jnp.float32, layout=plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=[stat_type] * (2 * operands))
  def load(_, ref):
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, vector

    i32 = ir.IntegerType.get_signless(32)
    i8 = ir.IntegerType.get_signless(8)
    f32 = ir.F32Type.get()
    const, lane, warp, _ = thread_coordinates()
    # lanes 8 m .. 8 m + 7 address matrix m's rows (an .x2 reads lanes 0-15's): row 2 q + e
    matrix, row = arith.divui(lane, const(8)), arith.remui(lane, const(8))
    quad_lane, e = arith.divui(row, const(2)), arith.remui(row, const(2))
    statistic = arith.remui(matrix, const(2))
    token = arith.addi(
      arith.addi(arith.muli(warp, const(16 * tiles)), const(16 * tile)), arith.muli(e, const(8))
    )
    b_of_matrix = arith.divui(matrix, const(2))  # 0 or 1: which of the load's two operands
    slot = None  # 8 rows: every column's group is b
    if rows == REAL_ROWS:  # columns 2 q, 2 q + 1 are slot q // 2's
      slot = arith.muli(arith.divui(quad_lane, const(2)), const(per_half))
    base = mgpu_utils.memref_ptr(ref)
    results = []
    for first in range(0, operands, 2):
      count = 2 * min(2, operands - first)
      group = arith.addi(b_of_matrix, const(first))
      if slot is not None:
        group = arith.addi(slot, group)
      element = arith.addi(
        arith.muli(arith.addi(arith.muli(statistic, const(groups)), group), const(slot_tokens)),
        token,
      )
      address = mgpu_utils.getelementptr(base, [arith.muli(element, const(2))], i8)
      names = ", ".join(f"${i}" for i in range(count))
      loaded = mgpu_utils.inline_ptx(
        f"ldmatrix.sync.aligned.m8n8.x{count}.trans.shared.b16 {{{names}}}, [${count}];",
        address,
        result_types=[i32] * count,
        has_side_effects=True,
        convergent=True,
      )
      for register in loaded:
        # bf16 -> f32: the low half shifted up, the high half with its low bits cleared
        halves = [arith.shli(register, const(16)), arith.andi(register, const(-65536))]
        array = np.empty(fa.WGMMA_LAYOUT.registers_shape((TILE_ROWS, COLUMNS)), dtype=object)
        for h, half in enumerate(halves):
          array[(0, 0, 0, 0, h, 0, 0, 0, 0)] = vector.broadcast(
            ir.VectorType.get((2,), f32), mgpu_utils.bitcast(half, f32)
          )
        results.append(
          fa.FragmentedArray(_registers=array, _layout=fa.WGMMA_LAYOUT, _is_signed=None)
        )
    return results

  arrays = load(statistics_ref)
  return [(arrays[2 * b], arrays[2 * b + 1]) for b in range(operands)]


def statistics_by_slot_emulated(statistics, b: int, tile: int, tiles: int, rows: int = REAL_ROWS):
  """`statistics_by_slot` by jnp: `statistics` the block's [D / 32, 64 tiles] (an array)."""
  check_rows(rows)
  per_half = _groups_per_half(VALUE_GROUP * statistics.shape[0])
  per_token = warp_rows(statistics.T, tile, tiles).astype(jnp.float32)  # [64, groups]
  if rows == COLUMNS:
    return jnp.broadcast_to(per_token[:, b, None], (TILE_ROWS, COLUMNS))
  slots = [
    jnp.broadcast_to(per_token[:, per_half * s + b, None], (TILE_ROWS, REAL_ROWS)) for s in range(2)
  ]
  return jnp.concatenate(slots, axis=1)


def _own_slot_rows(const, lane, warp, bits: int, head_dim: int = 128):
  """(channel, field in its half-word, slot, first row, first query row) of this thread in the
  partial outputs, MLIR i32 values: thread t = 32 w + lane takes channel t % D
  (`value_row_of_channel`: at 2 bits and head_dim 128 field f = c // 8 of word c % 8, i.e. field
  f % 8 of half-word 2 (c % 8) + f // 8, slot f // 8; rows 64 m + 16 w' + r for warps w') and the
  query rows t // D + 128 k / D (all of them at head_dim 128; every other at 64)."""
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith

  thread = arith.addi(arith.muli(warp, const(32)), lane)
  channel = arith.remui(thread, const(head_dim))
  m_tile, row, slot, field = value_row_of_channel(
    MlirInt(channel, ir.IntegerType.get_signless(32)), head_dim, bits
  )
  first_row = arith.addi(arith.muli(m_tile.value, const(TILE_ROWS)), row.value)
  return channel, field.value, slot.value, first_row, arith.divui(thread, const(head_dim))


def _sum_over_warps(ref, const, first_row, column):
  """The four warps' partial outputs at (first row + 16 w, column), added (4 loads)."""
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, memref

  as_index = functools.partial(arith.index_cast, ir.IndexType.get())
  total = None
  for other in range(4):
    row = as_index(arith.addi(first_row, const(16 * other)))
    value = memref.load(ref, [row, as_index(column)])
    total = value if total is None else arith.addf(total, value)
  return total


def add_warp_partials(partial_ref, bits: int = 2):
  """f32 [128, 4] (strided layout: thread c holds channel c's 4 rows): the four warps' partial
  outputs in `partial_ref` ([512, 8] f32 in shared memory, row 64 m + 16 w + r warp w's m-tile
  m) added, each channel from its accumulator row's slot of columns (`_own_slot_rows`; at 2 bits
  channel c is field f = c // 8 of word c % 8, i.e. half-word r = 2 (c % 8) + f // 8's field
  p = f % 8, in slot r % 2; 16 loads a thread, once per split; `inline_mgpu`, native only). At
  head_dim 128 (the experiments'; the kernel finishes with `finished_own_slot_outputs`)."""
  head_dim = 128
  layout = plgpu.Layout.WG_STRIDED((head_dim, REAL_ROWS), vec_size=4)

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(),),
    return_type=plgpu.ShapeDtypeStruct((head_dim, REAL_ROWS), jnp.float32, layout=layout),
  )
  def add(_, ref):
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    f32 = ir.F32Type.get()
    const, lane, warp, _ = thread_coordinates()
    _, _, slot, first_row, _ = _own_slot_rows(const, lane, warp, bits)
    vector_type = ir.VectorType.get((REAL_ROWS,), f32)
    register = llvm.mlir_undef(vector_type)
    for j in range(REAL_ROWS):
      column = arith.addi(arith.muli(slot, const(4)), const(j))
      total = _sum_over_warps(ref, const, first_row, column)
      register = llvm.insertelement(register, total, position=const(j))
    registers = np.empty((1,), dtype=object)
    registers[0] = register
    return fa.FragmentedArray(_registers=registers, _layout=layout.to_mgpu(), _is_signed=None)

  return add(partial_ref)


def add_warp_partials_emulated(
  partial: jax.Array, bits: int = 2, rows: int = REAL_ROWS, head_dim: int = 128
) -> jax.Array:
  """`add_warp_partials` by jnp, from the partial outputs f32 [4 D, 8] (an array): f32
  [D, rows], channel c summed over the warps from row 64 m + 16 w + r (`value_row_of_channel`),
  read from its slot s's columns at 4 query rows (from every column at 8)."""
  check_rows(rows)
  # index arrays from iotas, not numpy: a kernel may not capture an array constant
  channel = jax.lax.iota(jnp.int32, head_dim)
  m_tile, row, slot, _ = value_row_of_channel(channel, head_dim, bits)
  first_row = (TILE_ROWS * m_tile + row)[:, None]
  columns = jax.lax.iota(jnp.int32, rows)[None] + (REAL_ROWS * slot[:, None] if rows == 4 else 0)
  return sum(partial[first_row + 16 * w, columns] for w in range(4))


def _output_scale_exponents(bits: int) -> tuple[int, ...]:
  """69 - bit for a field's bit = bits k of its byte, k = 0 .. 8 / bits - 1: the power of two that
  takes a channel's raw sum to sum p v_scale code (`subnormal_codes`: codes are patterns
  code 2^(bit - 133), P' carries 2^64)."""
  return tuple(_CODE_UNIT_EXPONENT - _PROBS_EXPONENT - bits * k for k in range(8 // bits))


def _minimum_row(channel, rows: int, head_dim: int):
  """The statistics row of `channel`'s sums of p v_min (ints, jnp arrays or MlirInts): 1 + its
  group within its half (4 query rows: the slot's pairing), or 1 + its group (8 rows)."""
  if rows == REAL_ROWS:
    return (channel % (head_dim // 2)) // VALUE_GROUP + 1
  return channel // VALUE_GROUP + 1


def finished_own_slot_outputs(
  partial_ref, statistics_ref, bits: int = 2, rows: int = REAL_ROWS, head_dim: int = 128
):
  """f32 [rows, D] (strided layout: thread t holds channel t % D's rows t // D + 128 k / D):
  each split's normalised output, the four warps' sums (`value_row_of_channel`) times the
  channel's 2^(69 - bit), plus its value group's sum of p v_min, over the column's sum of p
  (`statistics_ref` row 0, column j); 0 where that sum is 0 (a split with no valid token), NaN
  where it is NaN. `statistics_ref`: f32 [1 + value_operands(rows, D), 8] in shared memory: at 4
  query rows channel c's row j is read from its slot s = c // (D / 2)'s columns 4 s + j and its
  group's sums of p v_min are row 1 + b, b = (c % (D / 2)) // 32, column 4 s + j; at 8 rows from
  column j, row 1 + c // 32 (`inline_mgpu`, native only)."""
  check_rows(rows)
  layout = plgpu.Layout.WG_STRIDED((rows, head_dim), vec_size=1)
  rows_apart = 128 // head_dim  # between a thread's query rows

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(), plgpu.RefType()),
    return_type=plgpu.ShapeDtypeStruct((rows, head_dim), jnp.float32, layout=layout),
  )
  def finish(_, ref, statistics):
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref, vector

    f32 = ir.F32Type.get()
    i32 = ir.IntegerType.get_signless(32)
    index = ir.IndexType.get()
    const, lane, warp, _ = thread_coordinates()
    channel, field, slot, first_row, first_query_row = _own_slot_rows(
      const, lane, warp, bits, head_dim
    )
    minimum_row = _minimum_row(MlirInt(channel, i32), rows, head_dim).value
    first_column = arith.muli(slot, const(REAL_ROWS)) if rows == REAL_ROWS else const(0)
    exponents = _output_scale_exponents(bits)
    bit_step = arith.remui(field, const(len(exponents)))  # the code's bit in its byte, over bits
    scale = arith.constant(f32, 2.0 ** exponents[-1])
    for k in reversed(range(len(exponents) - 1)):
      chosen = arith.cmpi(arith.CmpIPredicate.eq, bit_step, const(k))
      scale = arith.select(chosen, arith.constant(f32, 2.0 ** exponents[k]), scale)
    as_index = functools.partial(arith.index_cast, index)
    zero = arith.constant(f32, 0.0)
    registers = np.empty((rows // rows_apart,), dtype=object)
    for k in range(len(registers)):
      j = arith.addi(first_query_row, const(rows_apart * k))
      column = arith.addi(first_column, j)
      total = _sum_over_warps(ref, const, first_row, column)
      minimum = memref.load(statistics, [as_index(minimum_row), as_index(column)])
      sums = memref.load(statistics, [as_index(const(0)), as_index(j)])
      numerator = arith.addf(arith.mulf(total, scale), minimum)
      nonempty = arith.cmpf(arith.CmpFPredicate.UNE, sums, zero)  # NaN is not empty
      finished = arith.select(nonempty, arith.divf(numerator, sums), zero)
      registers[k] = vector.broadcast(ir.VectorType.get((1,), f32), finished)
    return fa.FragmentedArray(_registers=registers, _layout=layout.to_mgpu(), _is_signed=None)

  return finish(partial_ref, statistics_ref)


def finished_own_slot_outputs_emulated(
  partial: jax.Array,
  statistics: jax.Array,
  bits: int = 2,
  rows: int = REAL_ROWS,
  head_dim: int = 128,
) -> jax.Array:
  """`finished_own_slot_outputs` by jnp, from the partial outputs f32 [4 D, 8] and the
  statistics f32 [1 + value_operands(rows, D), 8] (arrays)."""
  # index arrays from iotas, not numpy: a kernel may not capture an array constant
  totals = add_warp_partials_emulated(partial, bits, rows, head_dim)  # [D channels, rows]
  channel = jax.lax.iota(jnp.int32, head_dim)
  _, _, slot, field = value_row_of_channel(channel, head_dim, bits)
  scale = power_of_two(_output_scale_exponents(bits)[0] - bits * (field % (8 // bits)))
  row = jax.lax.iota(jnp.int32, rows)[None]
  columns = row + (REAL_ROWS * slot[:, None] if rows == REAL_ROWS else 0)
  minimum = statistics[_minimum_row(channel, rows, head_dim)[:, None], columns]
  sums = statistics[0, :rows]
  finished = jnp.where(sums != 0, (totals * scale[:, None] + minimum) / sums, 0.0)
  return finished.T
