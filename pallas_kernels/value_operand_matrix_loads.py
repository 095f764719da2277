"""The value codes as wgmma's register operand by transposing matrix loads:
`value_operand="matrix_loads"` of the folded Mosaic GPU kernel (KERNEL_NOTES v43).

The value product's A operand is V^T [D, tokens]: a thread holds, per 8-token column group, one
32-bit register of two consecutive tokens (2 q, 2 q + 1; q = lane % 4) for each of its rows
64 rt + 16 warp + 8 half + lane / 4. The cache stores each token's channels in planar words, so
`value_operand="registers"` (`value_operand_registers`) builds every register from two 32-bit
loads (the same word of the two tokens) and one byte permute: 16 loads, 16 PRMT and 32 AND per
thread and 64-token block at head_dim 128 and 2 bits.

`ldmatrix.trans` does the pairing in the load: of an 8 x 8 matrix of 16-bit elements (8 tokens,
16 bytes of each), lane l receives column l / 4 of rows 2 q and 2 q + 1, i.e. the same half-word
of the two tokens in its register's two halves. Four matrices per instruction (`.x4`) give a
thread four such registers, and each holds several codes per token: one AND (after one shift
for a code in the upper byte) makes it a register of the operand, the code masked in place, a
bf16 bit pattern below 0x100 (`subnormal_codes`). At head_dim 128 and 2 bits: 2 matrix loads,
8 shifts and 32 AND per thread and 64-token block.

The price is the order of the rows. The lanes of a quad, which hold one row, receive one
half-word column; a thread's rows (2 per 64-row tile) must therefore come from the bits of one
half-word column: `bits_per_thread` = 2 x D / 64 x bits of it, the rest going to other warps
(which load the same matrices). Row (rt, warp, half, g = lane / 4) holds, with k = 2 rt + half,
the code at bit o = bits_per_thread x (warp % warps_per_half_word) + bits x k of half-word
8 x (warp // warps_per_half_word) + g: channel (16 x (half-word % 2) + o) / bits x W + half-word
/ 2 in the planar packing (field f of word w is channel f W + w). `channel_of_row` is that map
and `row_of_channel` its inverse; the kernel's epilogue and the split merges take the
accumulator's rows in this order, as they take the "word" order's. A code's bit within its
byte is the one it has in the planar word, so each channel's power of two is `code_exponent`'s.

The value ring is copied in with a TMA swizzle as wide as a token's row (32 bytes at head_dim 128
and 2 bits, 64 at 4 bits; `ring_swizzle_bytes`). Unswizzled, the 8 rows of a matrix, a token row
apart, share banks two (2 bits) or four (4 bits) at a time; the swizzle moves each 16-byte chunk
to chunk ^ (offset bits 7..) (`swizzled_offsets`), which spreads them over all 32 banks, one
wavefront per matrix (`benchmarks/shared_bank_conflicts.py`). Each lane's row address takes the
XOR once: 32 tokens' rows are 1 KB or more, so those bits of a row's offset are the lane's alone.

Native only: interpret mode stages the codes in this row order and takes the product as a dot.
`assemble_value_operand_from_matrix_loads` builds the operand in numpy, thread by thread, from
`ldmatrix.trans`'s documented lane mapping (`transposed_matrix_registers`), for tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.warpgroup_thread import thread_coordinates

MATRIX_LOADS = "matrix_loads"
WARPGROUP_THREADS = 128
_ROW_TILE = 64  # rows of one wgmma A tile (M)
_MATRIX = 8  # an ldmatrix matrix: 8 rows (tokens) of 8 16-bit columns
_MATRICES_PER_LOAD = 4  # .x4
_TOKENS_PER_LOAD = _MATRIX * _MATRICES_PER_LOAD
_HALF_WORD_BITS = 16
_BYTE = 8
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BITS = (2, 4)
_SWIZZLE_ROW = 128  # bytes: a TMA swizzle XORs address bits 7.. into the 16-byte chunk index
_CHUNK = 16


def ring_swizzle_bytes(head_dim: int, bits: int) -> int:
  """The TMA swizzle of the value ring (bytes; 0 for none): a token row's bytes, where a
  matrix's rows would otherwise share banks (rows of 32 bytes or more)."""
  row_bytes = head_dim * bits // 8
  return row_bytes if row_bytes >= 2 * _CHUNK else 0


def ring_transforms(head_dim: int, bits: int) -> tuple:
  """The value ring slot's shared-memory transforms ([tokens, W] uint32 words): 8-row tiles of
  a whole token row, swizzled by `ring_swizzle_bytes`; none where that is 0. The matrix loads'
  inline code is declared with the same, as Pallas requires of a transformed ref."""
  swizzle = ring_swizzle_bytes(head_dim, bits)
  if not swizzle:
    return ()
  return (plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle))


def swizzled_offsets(byte_offsets, swizzle: int):
  """Where a TMA swizzle of `swizzle` bytes puts each byte offset of a buffer (aligned to the
  swizzle's pattern): its 16-byte chunk index XOR the offset's bits from bit 7 on, as many as
  the swizzle has chunks (0: unchanged; ints, numpy or jnp)."""
  if not swizzle:
    return byte_offsets
  chunk_mask = swizzle // _CHUNK - 1
  return byte_offsets ^ (((byte_offsets // _SWIZZLE_ROW) & chunk_mask) * _CHUNK)


def thread_bits(head_dim: int, bits: int) -> tuple[int, int]:
  """(bits of a half-word one thread's rows take, warps sharing one half-word column)."""
  bits_per_thread = 2 * (head_dim // _ROW_TILE) * bits
  return bits_per_thread, _HALF_WORD_BITS // bits_per_thread


def unsupported_reason(head_dim: int, bits: int, block_tokens: int) -> str | None:
  """Why the value codes cannot reach the operand by matrix loads here (None if they can)."""
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return f"value_operand='matrix_loads' at head_dim={head_dim}; allowed: {SUPPORTED_HEAD_DIMS}"
  if bits not in SUPPORTED_BITS:
    return f"value_operand='matrix_loads' with bits={bits}; allowed: {SUPPORTED_BITS}"
  if block_tokens % _ROW_TILE:
    return (
      f"value_operand='matrix_loads' with block_tokens={block_tokens}: not a multiple of "
      f"{_ROW_TILE}"
    )
  return None


def channel_of_row(row, head_dim: int, bits: int):
  """The channel the value product's accumulator row `row` holds (ints, numpy or jnp)."""
  words = head_dim * bits // 32
  bits_per_thread, warps_per_half_word = thread_bits(head_dim, bits)
  row_tile, warp = row // _ROW_TILE, (row % _ROW_TILE) // 16
  half, g = (row % 16) // 8, row % 8
  half_word = _MATRIX * (warp // warps_per_half_word) + g
  bit = bits_per_thread * (warp % warps_per_half_word) + bits * (2 * row_tile + half)
  field = (_HALF_WORD_BITS * (half_word % 2) + bit) // bits
  return field * words + half_word // 2


def row_of_channel(channel, head_dim: int, bits: int):
  """The accumulator row holding `channel`: `channel_of_row`'s inverse (ints, numpy or jnp)."""
  words = head_dim * bits // 32
  bits_per_thread, warps_per_half_word = thread_bits(head_dim, bits)
  field, word = channel // words, channel % words
  half_word = 2 * word + (bits * field) // _HALF_WORD_BITS
  bit = (bits * field) % _HALF_WORD_BITS
  warp = (half_word // _MATRIX) * warps_per_half_word + bit // bits_per_thread
  k = (bit % bits_per_thread) // bits
  return _ROW_TILE * (k // 2) + 16 * warp + 8 * (k % 2) + half_word % _MATRIX


def transposed_matrix_registers(half_words: np.ndarray, first_column: int) -> np.ndarray:
  """`ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16` in numpy: uint16 [32 rows, C] in shared
  memory, each lane addressing one row of matrix lane / 8 at 16-bit column `first_column` ->
  uint32 [32 lanes, 4]: register m of lane l holds column first_column + l / 4 of rows
  8 m + 2 (l % 4) (low half) and 8 m + 2 (l % 4) + 1 (high half)."""
  lane = np.arange(32)
  column = first_column + lane // 4
  registers = np.zeros((32, _MATRICES_PER_LOAD), np.uint32)
  for m in range(_MATRICES_PER_LOAD):
    row = _MATRIX * m + 2 * (lane % 4)
    low = half_words[row, column].astype(np.uint32)
    high = half_words[row + 1, column].astype(np.uint32)
    registers[:, m] = low | (high << np.uint32(16))
  return registers


def _row_sources(head_dim: int, bits: int) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
  """Per (row tile, half): the thread's shift (int [128]) and mask (int [128]) that turn its
  loaded register into that row's operand register."""
  bits_per_thread, warps_per_half_word = thread_bits(head_dim, bits)
  warp = np.arange(WARPGROUP_THREADS) // 32
  sources = []
  for row_tile in range(head_dim // _ROW_TILE):
    for half in range(2):
      bit = bits_per_thread * (warp % warps_per_half_word) + bits * (2 * row_tile + half)
      shift = _BYTE * (bit // _BYTE)
      mask = (((1 << bits) - 1) << (bit % _BYTE)) * 0x00010001
      sources.append((row_tile, half, shift, mask))
  return sources


def assemble_value_operand_from_matrix_loads(words: np.ndarray, bits: int) -> np.ndarray:
  """uint32 [tokens, W] planar words -> uint16 [D, tokens]: the bf16 bit patterns the kernel's
  registers hold, row r holding channel `channel_of_row(r)`, built as
  `value_operand_from_matrix_loads` builds them, thread by thread."""
  tokens, width = words.shape
  head_dim = width * 32 // bits
  half_words = words.view(np.uint16).reshape(tokens, 2 * width)  # little endian: low half first
  _, warps_per_half_word = thread_bits(head_dim, bits)
  thread = np.arange(WARPGROUP_THREADS)
  warp, lane = thread // 32, thread % 32
  operand = np.zeros((head_dim, tokens), np.uint16)
  for first in range(0, tokens, _TOKENS_PER_LOAD):
    loaded = np.zeros((WARPGROUP_THREADS, _MATRICES_PER_LOAD), np.uint32)
    for w in range(4):
      first_column = _MATRIX * (w // warps_per_half_word)
      block = half_words[first : first + _TOKENS_PER_LOAD]
      loaded[warp == w] = transposed_matrix_registers(block, first_column)
    for row_tile, half, shift, mask in _row_sources(head_dim, bits):
      rows = _ROW_TILE * row_tile + 16 * warp + 8 * half + lane // 4
      for m in range(_MATRICES_PER_LOAD):
        register = (loaded[:, m] >> shift.astype(np.uint32)) & mask.astype(np.uint32)
        column = first + _MATRIX * m + 2 * (lane % 4)
        operand[rows, column] = register & 0xFFFF
        operand[rows, column + 1] = register >> 16
  return operand


def value_operand_from_matrix_loads(
  words_ref, head_dim: int, bits: int, *, first_token: int = 0, tokens: int | None = None
) -> jax.Array:
  """Tokens [first_token, first_token + tokens) (default: all) of a [slot tokens, W] uint32
  planar-word ref in shared memory -> bf16 [D, tokens] in the wgmma layout, row r holding
  channel `channel_of_row(r)`'s codes of every token, masked in place (`inline_mgpu`, native
  only)."""
  tokens = words_ref.shape[0] - first_token if tokens is None else tokens
  if reason := unsupported_reason(head_dim, bits, tokens):
    raise ValueError(reason)
  token_bytes = head_dim * bits // 8
  _, warps_per_half_word = thread_bits(head_dim, bits)
  sources = _row_sources(head_dim, bits)
  swizzle = ring_swizzle_bytes(head_dim, bits)
  if first_token % _TOKENS_PER_LOAD:
    raise ValueError(f"first_token={first_token} is not a multiple of {_TOKENS_PER_LOAD}")

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(transforms=ring_transforms(head_dim, bits)),),
    return_type=plgpu.ShapeDtypeStruct((head_dim, tokens), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
  )
  def assemble(_, ref):
    # Imported here: the CUDA-only lowering modules stay out of CPU runs.
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith

    i32 = ir.IntegerType.get_signless(32)
    i8 = ir.IntegerType.get_signless(8)
    pair_type = ir.VectorType.get((2,), ir.BF16Type.get())
    const, lane, warp, _ = thread_coordinates()
    # Lanes 8 m .. 8 m + 7 address the rows of matrix m: token `lane` of each 32, at the 16
    # bytes of the warp's block of 8 half-words, where the ring's swizzle put them
    # (`swizzled_offsets` of the lane's row; the block's first token and each load's 32 tokens
    # add whole KB, which leave the swizzle bits alone).
    column_block = arith.divui(warp, const(warps_per_half_word))
    lane_row = arith.muli(lane, const(token_bytes))
    chunk = column_block
    if swizzle:
      chunk_mask = swizzle // _CHUNK - 1
      row_bits = arith.andi(arith.divui(lane_row, const(_SWIZZLE_ROW)), const(chunk_mask))
      chunk = arith.xori(column_block, row_bits)
    offset = arith.addi(
      lane_row, arith.addi(arith.muli(chunk, const(_CHUNK)), const(first_token * token_bytes))
    )
    row_address = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [offset], i8)

    def by_warp(values):
      """An i32 holding values[32 w] in warp w: a constant where the warps agree."""
      per_warp = [int(values[32 * w]) for w in range(4)]
      if len(set(per_warp)) == 1:
        return const(per_warp[0])
      value = const(per_warp[0])
      for w in range(1, 4):
        is_warp = arith.cmpi(arith.CmpIPredicate.eq, warp, const(w))
        value = arith.select(is_warp, const(per_warp[w]), value)
      return value

    # Rows whose shift is 0 in every warp take the loaded register as it is; rows with the
    # same shifts share one shift.
    thread_sources = [
      (row_tile, half, tuple(shift[::32]), by_warp(mask)) for row_tile, half, shift, mask in sources
    ]
    shift_amounts = {
      key: by_warp(np.repeat(key, 32)) for _, _, key, _ in thread_sources if any(key)
    }

    registers = np.empty(fa.WGMMA_LAYOUT.registers_shape((head_dim, tokens)), dtype=object)
    for load in range(tokens // _TOKENS_PER_LOAD):
      address = mgpu_utils.getelementptr(row_address, [load * _TOKENS_PER_LOAD * token_bytes], i8)
      # A warp-wide collective that reads the ring slot: kept in program order (side effects)
      # and out of divergent code (convergent).
      loaded = mgpu_utils.inline_ptx(
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
        address,
        result_types=[i32] * _MATRICES_PER_LOAD,
        has_side_effects=True,
        convergent=True,
      )
      for m, register in enumerate(loaded):
        column_group = _MATRICES_PER_LOAD * load + m
        shifted = {key: arith.shrui(register, amount) for key, amount in shift_amounts.items()}
        for row_tile, half, key, mask_value in thread_sources:
          masked = arith.andi(shifted.get(key, register), mask_value)
          index = (row_tile, column_group, 0, 0, half, 0, 0, 0, 0)
          registers[index] = mgpu_utils.bitcast(masked, pair_type)
    return fa.FragmentedArray(_registers=registers, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return assemble(words_ref)
