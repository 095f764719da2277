"""The value codes as wgmma's register operand: `value_operand="registers"` of the folded Mosaic
GPU kernel (KERNEL_NOTES v34).

The value product is out^T [D, N] += V^T [D, tokens] P' [tokens, N]: its A operand is the codes
with channels as rows and tokens as columns, the transpose of how the cache stores them (each
planar word holds one token's channels). Staged through shared memory, as the kernel did before,
every 64-token block writes a [64, D] bf16 tile (16 KB at head_dim 128) with `stmatrix` and the
tensor core reads it back: v34's profile put the kernel's L1 / shared-memory throughput at 82%,
its most used unit, with those stores among its most frequent instructions.

In registers, a thread of the warpgroup holds A's rows m = 64 mt + 16 warp + 8 half + lane / 4
(`mt` the 64-row tile, `half` the register's row half) at columns 8 G + 2 q and 8 G + 2 q + 1,
q = lane % 4: two consecutive tokens of one channel per 32-bit register. Channel m is field
f = m // W of planar word w = m % W (`W` words per token); the field sits in the low 16-bit half
of the word if f < P (P = 16 / bits fields per half), else in the high half, at bit
bits * (f % P) of that half. So each register is built from the same word of the two tokens:
one byte permute (PRMT) puts the byte holding the field from each token into the low byte of
each 16-bit half, and one AND keeps the field where it sits in that byte. The result is the
code masked in place, a bf16 bit pattern below 0x100, i.e. code * 2^(q - 133) with q the bit
within the byte: `subnormal_codes.code_exponent`, the same exponent the staged tile's channel
order has, so the output's per-channel scale is unchanged and the accumulator's rows are
channels in order, whatever `operand_order` the key side uses.

Per thread the word, the byte and the mask depend on the thread and on (mt, half) only, not on
the block or the column: they are computed once, and registers whose word and byte agree for
every thread share their loads and their permute (`register_sources`). At head_dim 128 with
2-bit codes: 16 32-bit loads, 16 permutes and 32 ANDs per thread and 64-token block, no stores,
and the tensor core reads no code tile.

Native only: the interpreter takes wgmma operands from shared memory and flushes subnormals, so
interpret mode stages the codes in channel order and takes the product as a dot.
`assemble_value_operand` is the same construction in numpy, for tests.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.spread_token_order import (
  DEFAULT_TOKEN_ORDER,
  check_token_order,
  token_of_column,
)
from pallas_kernels.warpgroup_thread import thread_coordinates

VALUE_OPERANDS = ("shared_memory", "registers")
DEFAULT_VALUE_OPERAND = "shared_memory"
WARPGROUP_THREADS = 128
_ROW_TILE = 64  # rows of one wgmma A tile (M)
_LOW_BYTE = 8


@dataclasses.dataclass(frozen=True)
class RegisterSource:
  """Where the registers of one (row tile, row half) come from, per thread of the warpgroup
  (int arrays [128]): the planar word, the PRMT selector that moves the field's byte of two
  tokens' words into the low bytes of the two halves, and the mask that keeps the field."""

  word: np.ndarray
  selector: np.ndarray
  mask: np.ndarray


def _thread_rows(row_tile: int, half: int) -> np.ndarray:
  thread = np.arange(WARPGROUP_THREADS)
  warp, lane = thread // 32, thread % 32
  return _ROW_TILE * row_tile + 16 * warp + 8 * half + lane // 4


def register_sources(head_dim: int, bits: int) -> dict[tuple[int, int], RegisterSource]:
  """{(row tile, row half): RegisterSource} for the A operand's [head_dim, tokens] registers."""
  words = head_dim * bits // 32
  per_half = 16 // bits
  sources = {}
  for row_tile in range(head_dim // _ROW_TILE):
    for half in range(2):
      channel = _thread_rows(row_tile, half)
      field = channel // words
      position = bits * (field % per_half)  # the field's bit within its 16-bit half
      byte = 2 * (field // per_half) + position // _LOW_BYTE  # its byte within the word
      # result byte 0 <- the first token's byte, byte 2 <- the second token's (PRMT numbers the
      # first operand's bytes 0-3 and the second's 4-7); bytes 1 and 3 are masked off
      selector = byte | (byte << 4) | ((byte + 4) << 8) | ((byte + 4) << 12)
      mask = (((1 << bits) - 1) << (position % _LOW_BYTE)) * 0x00010001
      sources[(row_tile, half)] = RegisterSource(channel % words, selector, mask)
  return sources


def shared_sources(sources: dict) -> list[list[list[tuple[int, int]]]]:
  """The (row tile, row half) keys grouped by equal word for every thread (which share their
  loads), and within that by equal selector (which share their permute, and differ only in their
  masks)."""

  def group_by(keys, same):
    groups = []
    for key in keys:
      group = next((g for g in groups if same(sources[g[0]], sources[key])), None)
      if group is None:
        groups.append([key])
      else:
        group.append(key)
    return groups

  by_word = group_by(sources, lambda a, b: np.array_equal(a.word, b.word))
  return [group_by(keys, lambda a, b: np.array_equal(a.selector, b.selector)) for keys in by_word]


def prmt(first: np.ndarray, second: np.ndarray, selector: np.ndarray) -> np.ndarray:
  """PTX prmt.b32 (default mode) on uint32 arrays: result byte i is byte (selector >> 4 i) & 7
  of the eight bytes first[0..3], second[0..3]."""
  first, second, selector = (np.asarray(x, np.uint64) for x in (first, second, selector))
  pool = first | (second << np.uint64(32))
  result = np.zeros(np.broadcast_shapes(first.shape, second.shape, selector.shape), np.uint64)
  for i in range(4):
    index = (selector >> np.uint64(4 * i)) & np.uint64(7)
    byte = (pool >> (np.uint64(8) * index)) & np.uint64(0xFF)
    result |= byte << np.uint64(8 * i)
  return result.astype(np.uint32)


def assemble_value_operand(
  words: np.ndarray, bits: int, token_order: str = DEFAULT_TOKEN_ORDER
) -> np.ndarray:
  """uint32 [tokens, W] planar words -> uint16 [D, tokens]: the bf16 bit patterns the kernel's
  registers hold, built as `value_operand_from_registers` builds them, thread by thread; column
  k holds token `token_of_column(k, token_order)` (`spread_token_order`)."""
  tokens, width = words.shape
  head_dim = width * 32 // bits
  operand = np.zeros((head_dim, tokens), np.uint16)
  thread = np.arange(WARPGROUP_THREADS)
  quad = thread % 4
  for (row_tile, half), source in register_sources(head_dim, bits).items():
    rows = _thread_rows(row_tile, half)
    for column_group in range(tokens // 8):
      column = 8 * column_group + 2 * quad
      first, second = (token_of_column(column + t, token_order) for t in (0, 1))
      register = prmt(words[first, source.word], words[second, source.word], source.selector)
      register &= source.mask.astype(np.uint32)
      operand[rows, column] = register & 0xFFFF
      operand[rows, column + 1] = register >> 16
  return operand


def value_operand_unsupported_reason(head_dim: int, block_tokens: int) -> str | None:
  """Why the value codes cannot be the register operand at these sizes (None if they can)."""
  if head_dim % _ROW_TILE:
    return f"value_operand='registers' at head_dim={head_dim}: not a multiple of {_ROW_TILE}"
  if block_tokens % _ROW_TILE:
    return (
      f"value_operand='registers' with block_tokens={block_tokens}: not a multiple of {_ROW_TILE}"
    )
  return None


def value_operand_from_registers(
  words_ref,
  head_dim: int,
  bits: int,
  *,
  first_token: int = 0,
  tokens: int | None = None,
  token_order: str = DEFAULT_TOKEN_ORDER,
) -> jax.Array:
  """Tokens [first_token, first_token + tokens) (default: all) of a [slot tokens, W] uint32
  planar-word ref in shared memory -> bf16 [D, tokens] in the wgmma layout: channel m's codes of
  every token, masked in place, column k holding token `token_of_column(k, token_order)` of the
  block (`inline_mgpu`, native only)."""
  check_token_order(token_order)
  tokens = words_ref.shape[0] - first_token if tokens is None else tokens
  sources = register_sources(head_dim, bits)
  groups = shared_sources(sources)

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(),),
    return_type=plgpu.ShapeDtypeStruct((head_dim, tokens), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
  )
  def assemble(_, ref):
    # Imported here: the CUDA-only lowering modules stay out of CPU runs.
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, memref

    index_type = ir.IndexType.get()
    pair_type = ir.VectorType.get((2,), ir.BF16Type.get())
    const, lane, warp, quad = thread_coordinates()

    def per_thread(row_tile, half):
      """(word, selector, mask) of this thread, as `register_sources` computes them."""
      words = head_dim * bits // 32
      per_half = 16 // bits
      channel = arith.addi(
        arith.muli(warp, const(16)),
        arith.addi(arith.divui(lane, const(4)), const(_ROW_TILE * row_tile + 8 * half)),
      )
      field = arith.divui(channel, const(words))
      position = arith.muli(arith.remui(field, const(per_half)), const(bits))
      byte = arith.addi(
        arith.muli(arith.divui(field, const(per_half)), const(2)),
        arith.divui(position, const(_LOW_BYTE)),
      )
      selector = arith.addi(arith.muli(byte, const(0x1111)), const(0x4400))
      mask = arith.muli(
        arith.shli(const((1 << bits) - 1), arith.remui(position, const(_LOW_BYTE))),
        const(0x00010001),
      )
      return arith.remui(channel, const(words)), selector, mask

    # Columns 2 q and 2 q + 1 of each 8 hold tokens 2 q and 2 q + 1, in the spread order
    # swapped for q >= 2 (`spread_token_order`): the thread's two token offsets, then each
    # column group's tokens are those plus a constant (an address offset, no arithmetic).
    swapped = arith.divui(quad, const(2)) if token_order == "spread" else const(0)
    pair_offsets = (
      arith.addi(arith.muli(quad, const(2)), swapped),
      arith.addi(arith.muli(quad, const(2)), arith.subi(const(1), swapped)),
    )
    registers = np.empty(fa.WGMMA_LAYOUT.registers_shape((head_dim, tokens)), dtype=object)
    for same_word in groups:
      thread_sources = {key: per_thread(*key) for keys in same_word for key in keys}
      word_index = arith.index_cast(index_type, thread_sources[same_word[0][0]][0])
      for column_group in range(tokens // 8):
        pair = [
          memref.load(
            ref,
            [
              arith.index_cast(
                index_type, arith.addi(offset, const(first_token + 8 * column_group))
              ),
              word_index,
            ],
          )
          for offset in pair_offsets
        ]
        for same_selector in same_word:
          # prmt's first operand's bytes are 0-3, the second's 4-7 (utils.prmt names them
          # high and low)
          permuted = mgpu_utils.prmt(*pair, thread_sources[same_selector[0]][1])
          for row_tile, half in same_selector:
            masked = arith.andi(permuted, thread_sources[(row_tile, half)][2])
            index = (row_tile, column_group, 0, 0, half, 0, 0, 0, 0)
            registers[index] = mgpu_utils.bitcast(masked, pair_type)
    return fa.FragmentedArray(_registers=registers, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return assemble(words_ref)
