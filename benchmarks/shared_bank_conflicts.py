"""Shared-memory bank conflicts of the Mosaic GPU kernels' per-lane loads, from their addresses
(no GPU): how many wavefronts each warp-wide load takes, for the loads whose addresses kvjax's
own inline code chooses. The folded kernel's register value operand's code words
(`value_operand_registers`, and `value_operand_matrix_loads`' transposing matrix loads) and
own-slot value statistics (`value_stats_own_slot`); the warp kernel's
(`quantized_decode_attention_warp_mosaic_gpu`, KERNEL_NOTES v62) value-code matrix loads
(`warp_value_product`, with and without value_ring_layout="swizzled"), key words
(`warp_key_product`) and value statistics (`statistics_by_slot`).

`mosaic_static_cost.py` counts conflict-free wavefronts (the fewest a load's bytes need); this
counts what the addresses give: a bank serves one 32-bit word per wavefront, so a load takes as
many wavefronts as the most distinct words any one bank is asked for (lanes reading the same word
share it). Options that change the addresses, to see what each would remove:
- a TMA swizzle of the ring slot (`--swizzle` 32 | 64 | 128: address bits 4.. XOR bits 7..,
  as the tensor-map swizzle modes place 16-byte chunks);
- the kernel's token orders (`spread_token_order`): in "spread" operand column k of each 8
  reads token k ^ ((k >> 2) & 1), so the four token rows one load touches fall on four bank
  groups.

  PYTHONPATH=. .venv/bin/python benchmarks/shared_bank_conflicts.py --out results/x.json

A 64-bit load (the warp kernel's key words) is counted as two half-warp phases. Only the
addresses are modelled; whether the loads stall on the conflicts is for ncu to say.
"""

import argparse
import json

import numpy as np

from pallas_kernels import value_operand_matrix_loads
from pallas_kernels.bit_packing import packed_width
from pallas_kernels.spread_token_order import TOKEN_ORDERS, token_of_column
from pallas_kernels.value_operand_registers import (
  WARPGROUP_THREADS,
  register_sources,
  shared_sources,
)
from pallas_kernels.value_stats_own_slot import lane_groups

BANKS = 32
WORD_BYTES = 4
WARP = 32
SWIZZLES = (0, 32, 64, 128)  # bytes; 0: none


def wavefronts(byte_addresses) -> int:
  """Wavefronts one warp-wide load of at most 4 bytes per lane takes: the most distinct 32-bit
  words any bank is asked for."""
  words = np.unique(np.asarray(byte_addresses, np.int64) // WORD_BYTES)
  return int(np.bincount(words % BANKS, minlength=BANKS).max())


def swizzled(byte_addresses, swizzle: int):
  """Shared-memory byte addresses after a TMA swizzle of `swizzle` bytes (0: unchanged), by the
  rule the kernel's matrix loads address their swizzled ring with
  (`value_operand_matrix_loads.swizzled_offsets`: 16-byte chunk XOR address bits 7..)."""
  if swizzle not in SWIZZLES:
    raise ValueError(f"swizzle={swizzle!r} is not supported; allowed: {SWIZZLES}")
  addresses = np.asarray(byte_addresses, np.int64)
  return value_operand_matrix_loads.swizzled_offsets(addresses, swizzle)


def value_code_loads(head_dim: int, bits: int, block: int = 64, token_order: str = "natural"):
  """Byte addresses [lanes] of each warp-wide 32-bit load `value_operand_from_registers` issues
  per block: warp w, lane (r, q) reads its word of token 8 G + 2 q + t for each group of
  register sources that share their loads (`shared_sources`), column group G and token t of
  the pair (rows of W words, 4 bytes each)."""
  words_per_token = head_dim * bits // 32
  lane = np.arange(WARP)
  sources = register_sources(head_dim, bits)
  loads = []
  for same_word in shared_sources(sources):
    source = sources[same_word[0][0]]
    for warp in range(WARPGROUP_THREADS // WARP):
      word = source.word[warp * WARP : (warp + 1) * WARP]
      for column_group in range(block // 8):
        for t in range(2):
          token = token_of_column(8 * column_group + 2 * (lane % 4) + t, token_order)
          loads.append((token * words_per_token + word) * WORD_BYTES)
  return loads


def value_code_matrix_loads(head_dim: int, bits: int, block: int = 64):
  """Byte addresses of each matrix `value_operand_from_matrix_loads` reads per block: an
  `ldmatrix.x4` reads four 8 x 16-byte matrices, one wavefront each at best; matrix m's rows are
  the addresses of lanes 8 m .. 8 m + 7 (token 32 i + lane of the block at byte 16 x the warp's
  half-word block), each row's four words listed."""
  token_bytes = head_dim * bits // 8
  _, warps_per_half_word = value_operand_matrix_loads.thread_bits(head_dim, bits)
  lane = np.arange(WARP)
  loads = []
  for warp in range(WARPGROUP_THREADS // WARP):
    for load in range(block // WARP):
      rows = (WARP * load + lane) * token_bytes + 16 * (warp // warps_per_half_word)
      for matrix in range(4):
        row = rows[8 * matrix : 8 * matrix + 8]
        loads.append((row[:, None] + WORD_BYTES * np.arange(4)[None, :]).ravel())
  return loads


def own_slot_statistic_loads(
  rows: int, real_rows: int, value_groups: int, slot_tokens: int = 64, token_order: str = "natural"
):
  """Byte addresses [lanes] of each warp-wide 16-bit load `own_slot_statistics` issues for one
  64-token block and statistic: warp w, lane (r, q) reads its own slot's group of token
  16 w + 8 half + r in a [value groups, slot_tokens] bf16 ring slot (slot_tokens: the block
  times blocks_per_copy, the groups' stride)."""
  lane = np.arange(WARP)
  tiles = -(-value_groups // (rows // real_rows))
  loads = []
  for tile in range(tiles):
    groups = lane_groups(tile, rows, real_rows, value_groups)
    for warp in range(WARPGROUP_THREADS // WARP):
      group = groups[warp * WARP : (warp + 1) * WARP]
      for half in range(2):
        token = token_of_column(16 * warp + 8 * half + lane // 4, token_order)
        loads.append((group * slot_tokens + token) * 2)
  return loads


WARP_TILES = 2  # the warp kernel's 16-token tiles a warp per 128-token block


def warp_value_matrix_loads(head_dim: int, bits: int, swizzled_ring: bool):
  """Byte addresses of each matrix the warp kernel's value product reads per 128-token block
  (`warp_value_product.value_product_per_warp`: per warp and tile, `ldmatrix.x4.trans` per 16
  half-words, rows token 16 tiles w + 16 tile + 8 (m / 2) + l % 8 at chunk 2 blk + m % 2; at 4
  words a token one `.x2` of whole 16-byte rows), each row's four words listed; `swizzled_ring`:
  the ring's TMA swizzle a token row wide (`value_operand_matrix_loads.ring_swizzle_bytes`)."""
  words = packed_width(head_dim, bits)
  row_bytes = 4 * words
  swizzle = value_operand_matrix_loads.ring_swizzle_bytes(head_dim, bits) if swizzled_ring else 0
  lane = np.arange(WARP)
  loads = []
  for warp in range(WARPGROUP_THREADS // WARP):
    for tile in range(WARP_TILES):
      first = 16 * WARP_TILES * warp + 16 * tile
      if words == 4:  # .x2: matrix m's rows are tokens 8 m + l % 8
        matrices, rows = 2, [(first + 8 * (lane // 8 % 2) + lane % 8) * row_bytes]
      else:
        token = first + 8 * (lane // 16) + lane % 8
        matrices = 4
        rows = [token * row_bytes + 16 * (2 * blk + lane // 8 % 2) for blk in range(words // 8)]
      for offsets in rows:
        for matrix in range(matrices):
          row = swizzled(offsets[8 * matrix : 8 * matrix + 8], swizzle)
          loads.append((row[:, None] + WORD_BYTES * np.arange(4)[None, :]).ravel())
  return loads


def warp_key_word_loads(head_dim: int, bits: int):
  """Byte addresses of each phase of the warp kernel's key-word loads per 128-token block
  (`warp_key_product.own_token_words`: lane (g, q) reads words 8 j + 2 q, + 1 of tokens g and
  g + 8 of its tile, one 64-bit load each, counted as two half-warp phases; at 4 words a token
  `own_token_codes_one_word_per_lane`, word q, one 32-bit load)."""
  words = packed_width(head_dim, bits)
  row_bytes = 4 * words
  lane = np.arange(WARP)
  loads = []
  for warp in range(WARPGROUP_THREADS // WARP):
    for tile in range(WARP_TILES):
      token = 16 * WARP_TILES * warp + 16 * tile + lane // 4
      for h in range(2):
        if words == 4:
          loads.append((token + 8 * h) * row_bytes + WORD_BYTES * (lane % 4))
          continue
        for j in range(words // 8):
          address = (token + 8 * h) * row_bytes + 8 * (lane % 4) + 32 * j
          for phase in range(2):
            half = address[16 * phase : 16 * phase + 16]
            loads.append(np.concatenate([half, half + WORD_BYTES]))
  return loads


def warp_statistic_loads(head_dim: int, rows: int):
  """Byte addresses of the warp kernel's 16-bit value-statistic loads per 128-token block
  (`warp_value_product.statistics_by_slot`, both statistics: lane (g, q) reads tokens g and g + 8
  of its tile in its columns' group, at 4 query rows group (q / 2) (D / 64) + b, at 8 group b,
  from a [D / 32, 128] bf16 ring slot)."""
  per_half = head_dim // 64
  operands = per_half if rows == 4 else head_dim // 32
  lane = np.arange(WARP)
  loads = []
  for warp in range(WARPGROUP_THREADS // WARP):
    for tile in range(WARP_TILES):
      token = 16 * WARP_TILES * warp + 16 * tile + lane // 4
      for b in range(operands):
        group = (lane % 4) // 2 * per_half + b if rows == 4 else np.full(WARP, b)
        for _statistic in range(2):
          for h in range(2):
            loads.append((group * 128 + token + 8 * h) * 2)
  return loads


def load_wavefronts(loads, swizzle: int = 0) -> dict:
  """{"loads", "wavefronts", "conflict_free"}: per block, summed over the warpgroup's four
  warps, the warp-wide loads (or matrices), the wavefronts their addresses take, and the fewest
  they could (one per load: at most 128 bytes each)."""
  total = sum(wavefronts(swizzled(addresses, swizzle)) for addresses in loads)
  return {"loads": len(loads), "wavefronts": total, "conflict_free": len(loads)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", help="write the rows as JSON here")
  args = parser.parse_args()
  rows = []
  for head_dim in (64, 128):
    for bits in (2, 4):
      for swizzle in SWIZZLES:
        loads = value_code_matrix_loads(head_dim, bits)
        shape = f"head_dim {head_dim}, {bits}-bit"
        rows.append(dict(kind="value codes, matrix loads", shape=shape, token_order="natural",
                         swizzle=swizzle, **load_wavefronts(loads, swizzle)))  # fmt: skip
      for token_order in TOKEN_ORDERS:
        for swizzle in SWIZZLES:
          loads = value_code_loads(head_dim, bits, token_order=token_order)
          shape = f"head_dim {head_dim}, {bits}-bit"
          rows.append(dict(kind="value codes", shape=shape, token_order=token_order,
                           swizzle=swizzle, **load_wavefronts(loads, swizzle)))  # fmt: skip
  for rows_, real_rows, value_groups in ((8, 4, 4), (8, 2, 4), (8, 8, 4), (16, 4, 8)):
    for block in (64, 128):
      for token_order in TOKEN_ORDERS:
        loads = own_slot_statistic_loads(rows_, real_rows, value_groups, block, token_order)
        shape = f"{rows_} rows ({real_rows} real), {value_groups} groups, slot of {block} tokens"
        rows.append(dict(kind="own-slot statistics", shape=shape, token_order=token_order,
                         swizzle=0, **load_wavefronts(loads)))  # fmt: skip
  for head_dim in (64, 128):
    for bits in (2, 4):
      shape = f"head_dim {head_dim}, {bits}-bit"
      swizzle = value_operand_matrix_loads.ring_swizzle_bytes(head_dim, bits)
      for swizzled_ring in (False, True):
        loads = warp_value_matrix_loads(head_dim, bits, swizzled_ring)
        rows.append(dict(kind="warp: value codes, matrix loads", shape=shape,
                         token_order="natural", swizzle=swizzle if swizzled_ring else 0,
                         **load_wavefronts(loads)))  # fmt: skip
      rows.append(dict(kind="warp: key words", shape=shape, token_order="natural", swizzle=0,
                       **load_wavefronts(warp_key_word_loads(head_dim, bits))))  # fmt: skip
    for query_rows in (4, 8):
      rows.append(dict(kind="warp: value statistics", shape=f"head_dim {head_dim}, "
                       f"{query_rows} query rows", token_order="natural", swizzle=0,
                       **load_wavefronts(warp_statistic_loads(head_dim, query_rows))))  # fmt: skip
  print("| loads | shape | token order | swizzle | loads per block | wavefronts | conflict-free |")
  print("|---|---|---|---:|---:|---:|---:|")
  for row in rows:
    print(
      f"| {row['kind']} | {row['shape']} | {row['token_order']} | {row['swizzle']} "
      f"| {row['loads']} | {row['wavefronts']} | {row['conflict_free']} |"
    )
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
