"""The key product per warp (KERNEL_NOTES v44, v45): each warp's own tokens of a block against Q'
of their own key group, by `mma.sync.m16n8k16` with both operands in registers.

The warpgroup product (`wgmma`) of the folded kernel reads its B operand, Q', from shared memory:
staged by all four warps and published by a fence and a barrier every block, and its A tile spans
the four warps, so every product is one wait for all of them (v34's profile: 30-40% of the loop's
stalls). Here a warp takes `16 tiles` consecutive tokens of a block (32 at `tiles=2`: one key
group of 32 tokens), and builds its group's Q' in registers:

- A: the warp's key codes masked in place (`subnormal_codes`), in MMA_LHS
  (`word_operand_order.stage_words_in_word_order(..., operand_layout="mma_lhs")`) from the words
  `own_token_words` loads (row 16 w + r of a tile: token 16 tiles w + 16 tile + r);
- B: Q'^T [128 positions, 8 columns] of the warp's group. B register (k-tile kt, half kh) of lane
  (g, q) holds positions 16 kt + 8 kh + 2 q + {0, 1}, i.e. channels c and c + 64 with
  c = C(16 kt) + 2 q + kh (`word_operand_order`'s C(L): 8 kt at 2 bits, 16 (kt % 4) + 8 (kt // 4)
  at 4): their scales are the low (kh = 0) or high (kh = 1) halves of the scale words at channels
  C(16 kt) + 2 q and C(16 kt) + 64 + 2 q, paired by one byte permute and multiplied with the
  lane's query pair (HMUL2, a bf16 product as the folded kernel's Q');
- the accumulators start at the group's key bias (q . k_min) over 2^64, exactly, so the scores
  leave the product with the bias in them; 8 MMAs a tile in one dependent chain (two chains took
  one register over four programs per SM, v44).

Columns are the 8 query rows of the operands (`COLUMNS`; 4 real rows, the padding rows repeating
them), scores f32 [64, 8] in the wgmma layout (= MMA_ACC with four warps along M). Native only:
`key_scores_per_warp_emulated` computes the same arrays by jnp for interpret mode, and
`tests/pallas_kernels/test_warp_products_inline.py` runs the inline code on numpy lane by lane.

At head_dim 64 the product has 4 k-tiles. With 4-bit codes a token is 8 words, and everything
above holds with D / 2 = 32 for 64. With 2-bit codes a token is 4 words, not a whole 8-word
group of the wgmma layout: each lane of a quad takes one word (`word_operand_order`'s one word
per lane order, C(L) = (p + 8 h) 4 + q), loaded by `own_token_codes_one_word_per_lane` (one
32-bit load a row) and masked straight into the MMA_LHS registers; B register (kt, kh) then pairs
channels c = 4 (2 kt + kh) + q and c + 32, not adjacent in the scales, so its scale pair is two
16-bit loads instead of a word load and a byte permute.

Supported: 2- and 4-bit planar codes at head_dim 64 and 128 (4, 8 or 16 words a token), key
groups of 32 tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.bit_packing import packed_width, unpack_codes
from pallas_kernels.subnormal_codes import code_exponent, power_of_two
from pallas_kernels.warpgroup_thread import thread_coordinates
from pallas_kernels.word_operand_order import (
  channel_at_position,
  channels_in_word_order,
  masked_pair_registers,
  stage_words_in_word_order,
  words_per_lane,
)

TILE_ROWS = 64  # rows of a per-warp tile array: 16 tokens of each of the four warps
COLUMNS = 8  # the products' N: query rows (the padding rows repeat the real ones)
HEAD_DIMS = (64, 128)
SUPPORTED_BITS = (2, 4)
KEY_GROUP = 32  # tokens of a key group
_CODE_UNIT_EXPONENT = 133  # bf16 pattern m < 0x100 is m * 2^-133
_SCORE_EXPONENT = 64
# the key product's scores are the true ones over 2^64 (`subnormal_codes`)
SCORE_UNSCALE = 2.0**-_SCORE_EXPONENT


def _token_of_row(const, lane, warp, tile: int, tiles: int):
  """Token (in the block) of this thread's first row of a tile array: 16 tiles w + 16 tile +
  lane / 4 (`warp_rows`); its second row is 8 tokens on."""
  from jaxlib.mlir.dialects import arith

  return arith.addi(
    arith.addi(arith.muli(warp, const(16 * tiles)), const(16 * tile)),
    arith.divui(lane, const(4)),
  )


def own_token_words(words_ref, tile: int, tiles: int, bits: int = 2, head_dim: int = 128):
  """uint32 [64, W] (wgmma layout) of the block's key words [64 tiles, W] in shared memory (W
  words a token, a multiple of 8: 8 at 2 bits, 16 at 4 at head_dim 128, 8 at 4 bits at 64): row
  16 w + r holds token 16 tiles w + 16 tile + r (`warp_rows`). A thread loads words 8 j + 2 q,
  8 j + 2 q + 1 of its two rows, one 64-bit load each per 8-word column group j (`inline_mgpu`,
  native only)."""
  words = packed_width(head_dim, bits)

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(),),
    return_type=plgpu.ShapeDtypeStruct((TILE_ROWS, words), jnp.uint32, layout=plgpu.Layout.WGMMA),
  )
  def load(_, ref):
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    i8 = ir.IntegerType.get_signless(8)
    pair_type = ir.VectorType.get((2,), ir.IntegerType.get_signless(32))
    const, lane, warp, quad = thread_coordinates()
    token = _token_of_row(const, lane, warp, tile, tiles)
    offset = arith.addi(arith.muli(token, const(4 * words)), arith.muli(quad, const(8)))
    address = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [offset], i8)
    registers = np.empty(fa.WGMMA_LAYOUT.registers_shape((TILE_ROWS, words)), dtype=object)
    for j in range(words // 8):
      for h in range(2):
        row = mgpu_utils.getelementptr(address, [8 * 4 * words * h + 4 * 8 * j], i8)
        registers[(0, j, 0, 0, h, 0, 0, 0, 0)] = llvm.load(pair_type, row)
    return fa.FragmentedArray(_registers=registers, _layout=fa.WGMMA_LAYOUT, _is_signed=False)

  return load(words_ref)


def own_token_codes_one_word_per_lane(words_ref, tile: int, tiles: int, bits: int = 2):
  """bf16 [64, 64] key-code operand (MMA_LHS, the one word per lane order) of the block's key
  words [64 tiles, 4] in shared memory (head_dim 64 at 2 bits): row 16 w + r holds token
  16 tiles w + 16 tile + r. Lane (g, q) loads word q of its two rows (one 32-bit load each) and
  masks its 8 pairs into registers G = p (columns 8 p + 2 q, + 1; `inline_mgpu`, native only)."""
  head_dim = 64
  if words_per_lane(head_dim, bits) != 1:
    raise ValueError(f"bits={bits} is not supported by the one word per lane operand; allowed: 2")
  words = packed_width(head_dim, bits)
  layout = plgpu.Layout.MMA_LHS(jnp.bfloat16)

  @plgpu.inline_mgpu(
    arg_types=(plgpu.RefType(),),
    return_type=plgpu.ShapeDtypeStruct((TILE_ROWS, head_dim), jnp.bfloat16, layout=layout),
  )
  def load(_, ref):
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    i32 = ir.IntegerType.get_signless(32)
    i8 = ir.IntegerType.get_signless(8)
    const, lane, warp, quad = thread_coordinates()
    token = _token_of_row(const, lane, warp, tile, tiles)
    offset = arith.addi(arith.muli(token, const(4 * words)), arith.muli(quad, const(4)))
    address = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [offset], i8)
    mosaic_layout = layout.to_mgpu()
    registers = np.empty(mosaic_layout.registers_shape((TILE_ROWS, head_dim)), dtype=object)
    for h in range(2):  # rows g and g + 8
      row = mgpu_utils.getelementptr(address, [8 * 4 * words * h], i8)
      for p, masked in enumerate(masked_pair_registers(llvm.load(i32, row), bits)):
        # MMA_LHS tiles columns by 16: column group p is half p % 2 of k-tile p // 2
        registers[(0, p // 2, 0, p % 2, h, 0, 0, 0, 0)] = masked
    return fa.FragmentedArray(_registers=registers, _layout=mosaic_layout, _is_signed=None)

  return load(words_ref)


def own_token_key_operand(words_ref, tile: int, tiles: int, bits: int, head_dim: int):
  """bf16 [64, D] key-code operand (MMA_LHS, word order) of tile `tile` of each warp's tokens:
  one word a lane at 4 words a token (`own_token_codes_one_word_per_lane`), else the wgmma
  word array staged (`own_token_words`, `stage_words_in_word_order`; native only)."""
  if words_per_lane(head_dim, bits) == 1:
    return own_token_codes_one_word_per_lane(words_ref, tile, tiles, bits)
  words = own_token_words(words_ref, tile, tiles, bits, head_dim)
  return stage_words_in_word_order(words, bits, operand_layout="mma_lhs")


def key_product_per_warp(
  keys, queries, k_scale_ref, key_bias_ref, tiles: int = 1, bits: int = 2, head_dim: int = 128
):
  """f32 [64, 8] scores (wgmma layout) per 16-token tile of `keys`: each warp's tokens against Q'
  of its own key group (warp w's tokens are group w tiles / 2 of the block), plus that group's
  bias, all over 2^64. `keys` a list of `tiles` bf16 [64, D] key-code arrays in the MMA_LHS
  layout (word order; row 16 w + r: token 16 tiles w + 16 tile + r), `queries` bf16 [D, 8] in
  MMA_RHS (position-major, times 2^(69 - bit)), `k_scale_ref` the block's key scales
  [groups, D] bf16 (channel order) and `key_bias_ref` its q . k_min [groups, 8] f32, both in
  shared memory (`inline_mgpu`, native only)."""
  lane_words = words_per_lane(head_dim, bits)
  lhs = plgpu.Layout.MMA_LHS(jnp.bfloat16)
  score_type = plgpu.ShapeDtypeStruct((TILE_ROWS, COLUMNS), jnp.float32, layout=plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(
    arg_types=(
      [lhs] * tiles,
      plgpu.Layout.MMA_RHS(jnp.bfloat16),
      plgpu.RefType(),
      plgpu.RefType(),
    ),
    return_type=[score_type] * tiles,
  )
  def product(_, key_tiles, b, scale_ref, bias_ref):
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm

    i32 = ir.IntegerType.get_signless(32)
    i8 = ir.IntegerType.get_signless(8)
    f32 = ir.F32Type.get()
    pair_type = ir.VectorType.get((2,), ir.BF16Type.get())
    i16 = ir.IntegerType.get_signless(16)
    const, lane, warp, quad = thread_coordinates()
    group = arith.divui(arith.muli(warp, const(tiles)), const(2))
    # byte offset of channel T q (T words a lane: 2, or 1 at one word per lane) of the warp's
    # group's D scales
    base = arith.muli(
      arith.addi(arith.muli(group, const(head_dim)), arith.muli(quad, const(lane_words))),
      const(2),
    )
    scales = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(scale_ref), [base], i8)

    def load_scale(channel: int, element_type):
      return llvm.load(element_type, mgpu_utils.getelementptr(scales, [2 * channel], i8))

    def scale_pairs(kt: int) -> list:
      """The kh = 0, 1 scale pairs (channels c, c + D / 2) of k-tile kt's B registers."""
      if lane_words == 1:  # c = C(16 kt + 8 kh) + q: two 16-bit loads a pair
        pairs = []
        for kh in range(2):
          first = int(channel_at_position(16 * kt + 8 * kh, head_dim, bits))
          low, high = (arith.extui(i32, load_scale(c, i16)) for c in (first, first + head_dim // 2))
          pairs.append(arith.ori(low, arith.shli(high, const(16))))
        return pairs
      # c = C(16 kt) + 2 q + kh: the low or high halves of the words at C(16 kt) + 2 q and
      # D / 2 on, paired by one byte permute
      first = int(channel_at_position(16 * kt, head_dim, bits))
      low, high = load_scale(first, i32), load_scale(first + head_dim // 2, i32)
      return [
        mgpu_utils.inline_ptx(
          "prmt.b32 $0, $1, $2, " + ("0x7632" if kh else "0x5410") + ";",
          low,
          high,
          result_types=i32,
        )
        for kh in range(2)
      ]

    b_registers = []  # Q' of the warp's group, built once for its tiles
    for kt in range(head_dim // 16):
      for kh, pair in enumerate(scale_pairs(kt)):
        query = b.registers[(kt, 0, kh, 0, 0, 0, 0, 0)]
        product_pair = arith.mulf(query, mgpu_utils.bitcast(pair, pair_type))
        b_registers.append(mgpu_utils.bitcast(product_pair, i32))
    # the group's bias of the lane's columns 2 q, 2 q + 1, over 2^64: the accumulators' start
    bias_offset = arith.muli(
      arith.addi(arith.muli(group, const(COLUMNS)), arith.muli(quad, const(2))), const(4)
    )
    bias_address = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(bias_ref), [bias_offset], i8)
    unscale = arith.constant(f32, SCORE_UNSCALE)
    bias = [
      arith.mulf(llvm.load(f32, mgpu_utils.getelementptr(bias_address, [4 * c], i8)), unscale)
      for c in range(2)
    ]
    results = []
    undefined = llvm.mlir_undef(ir.VectorType.get((2,), f32))
    for a in key_tiles:
      accumulator = [bias[0], bias[1], bias[0], bias[1]]
      for kt in range(head_dim // 16):
        a_registers = [
          mgpu_utils.bitcast(a.registers[(0, kt, 0, s, h, 0, 0, 0, 0)], i32)
          for s, h in ((0, 0), (0, 1), (1, 0), (1, 1))
        ]
        accumulator = mgpu_utils.inline_ptx(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
          "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
          *a_registers,
          *b_registers[2 * kt : 2 * kt + 2],
          *accumulator,
          result_types=[f32] * 4,
          convergent=True,  # warp-wide (.sync.aligned): out of divergent code
        )
      registers = np.empty(fa.WGMMA_LAYOUT.registers_shape((TILE_ROWS, COLUMNS)), dtype=object)
      for h in range(2):
        pair = llvm.insertelement(undefined, accumulator[2 * h], position=const(0))
        registers[(0, 0, 0, 0, h, 0, 0, 0, 0)] = llvm.insertelement(
          pair, accumulator[2 * h + 1], position=const(1)
        )
      results.append(
        fa.FragmentedArray(_registers=registers, _layout=fa.WGMMA_LAYOUT, _is_signed=None)
      )
    return results

  return product(keys, queries, k_scale_ref, key_bias_ref)


def warp_rows(block: jax.Array, tile: int, tiles: int) -> jax.Array:
  """The [64, ...] rows of a tile array from a block's [64 tiles, ...] per-token rows (row
  16 w + r: token 16 tiles w + 16 tile + r), by a reshape and a slice (a kernel may not capture
  an index array)."""
  split = block.reshape(4, tiles, 16, *block.shape[1:])
  return split[:, tile].reshape(TILE_ROWS, *block.shape[1:])


def per_row_group(groups: jax.Array, tiles: int) -> jax.Array:
  """A block's per-key-group rows [>= 2 tiles, ...] repeated to the [64, ...] rows of a tile
  array: warp w's tokens are group w tiles / 2."""
  count = 2 * tiles
  return jnp.repeat(groups[:count], TILE_ROWS // count, axis=0)


def key_scores_per_warp_emulated(
  words: jax.Array,  # uint32 [64 tiles, W]: the block's key words
  queries: jax.Array,  # bf16 [D, 8]: positions in the word order, times 2^(69 - bit)
  k_scale: jax.Array,  # bf16 [>= 2 tiles, D]: the block's key scales, channel order
  key_bias: jax.Array,  # f32 [>= 2 tiles, 8]: the block's q . k_min
  tiles: int,
  bits: int = 2,
) -> list:
  """What `own_token_words`, `stage_words_in_word_order` (or
  `own_token_codes_one_word_per_lane`) and `key_product_per_warp` give, by jnp (interpret mode):
  per tile, f32 [64, 8] with row 16 w + r the scores of token 16 tiles w + 16 tile + r against
  bf16(query x its key group's scale), plus the group's bias, over 2^64. The code operands'
  powers of two go into Q' before the sum (a code pattern is subnormal, which XLA on CPU
  flushes), so the terms are the native ones within f32 rounding."""
  head_dim = queries.shape[0]
  position = jax.lax.iota(jnp.int32, head_dim)
  exponent = code_exponent(channel_at_position(position, head_dim, bits), head_dim, bits)
  # The code operand at position L is code * 2^(e(L) - 133), the query there q 2^(69 - e(L)):
  # the product is taken as code * (Q' 2^(e(L) - 69)) 2^-64, in the normal range throughout.
  code_unit = power_of_two(exponent - (_CODE_UNIT_EXPONENT - _SCORE_EXPONENT))[None, :, None]
  codes = channels_in_word_order(unpack_codes(words, bits).astype(jnp.float32), 1, bits)
  scales = per_row_group(channels_in_word_order(k_scale.astype(jnp.float32), 1, bits), tiles)
  scaled = (queries.astype(jnp.float32)[None] * scales[:, :, None]).astype(jnp.bfloat16)
  operand = scaled.astype(jnp.float32) * code_unit  # [64, positions, 8]
  bias = per_row_group(key_bias.astype(jnp.float32), tiles) * SCORE_UNSCALE
  return [
    jnp.einsum("rp,rpc->rc", warp_rows(codes, t, tiles), operand, precision="highest")
    * SCORE_UNSCALE
    + bias
    for t in range(tiles)
  ]
