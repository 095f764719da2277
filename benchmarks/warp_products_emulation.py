"""The per-warp products experiment (`warp_products_experiment.cu`) run lane by lane in numpy.

`warp_products_experiment.model_outputs` says what the experiment computes; this says how: each
warp's 32 lanes hold the registers the CUDA code builds (the masked code words, Q' pairs made by
a byte permute and a bf16x2 product, P' pairs transposed by `movmatrix`, the value codes from
`ldmatrix.trans`), and the warp-wide instructions take and give them by their documented
fragment layouts (PTX ISA: `mma.m16n8k16` with .bf16 operands and .f32 accumulators,
`movmatrix.m8n8.trans.b16`, `ldmatrix.m8n8.x4.trans.b16`). Equal outputs mean the kernel's
index bookkeeping is right, by the PTX layouts as written here; a GPU run of the experiment
(`--run`) checks those layouts themselves.
"""

import numpy as np
import warp_products_experiment as experiment

from pallas_kernels.value_operand_matrix_loads import transposed_matrix_registers

LANES = np.arange(32)
GROUP_ID, THREAD_IN_GROUP = LANES // 4, LANES % 4  # PTX's groupID, threadID_in_group


def bf16_pair_values(registers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """uint32 registers -> (low half, high half) as the bf16 numbers they hold (float64, exact)."""
  low = experiment.bf16_values((registers & 0xFFFF).astype(np.uint16)).astype(np.float64)
  high = experiment.bf16_values((registers >> 16).astype(np.uint16)).astype(np.float64)
  return low, high


def pack_bf16_pair(low: np.ndarray, high: np.ndarray) -> np.ndarray:
  """`__floats2bfloat162_rn`: two float32 arrays -> uint32 registers (low half first)."""
  low_bits = experiment.bf16_bits(np.asarray(low, np.float32)).astype(np.uint32)
  high_bits = experiment.bf16_bits(np.asarray(high, np.float32)).astype(np.uint32)
  return low_bits | (high_bits << 16)


def byte_perm(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
  """PRMT / `__byte_perm(a, b, s)`: result byte i is byte (s >> 4 i) & 7 of b:a (a bytes 0-3)."""
  both = a.astype(np.uint64) | (b.astype(np.uint64) << 32)
  result = np.zeros_like(a, dtype=np.uint32)
  for i in range(4):
    source = (selector >> (4 * i)) & 7
    result |= (((both >> (8 * source)) & 0xFF).astype(np.uint32)) << (8 * i)
  return result


def hmul2_bf16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """HMUL2.BF16: the halves multiplied and each rounded to bf16 (nearest even)."""
  a_low, a_high = bf16_pair_values(a)
  b_low, b_high = bf16_pair_values(b)
  return pack_bf16_pair((a_low * b_low).astype(np.float32), (a_high * b_high).astype(np.float32))


def mma_m16n8k16(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
  """`mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`: a uint32 [32, 4], b uint32 [32, 2],
  c float32 [32, 4] per lane -> d float32 [32, 4] = A B + C, by the fragment layouts: a_j holds
  A[g + 8 (j % 2), 2 t + 8 (j // 2) + {0, 1}], b_j holds B[2 t + 8 j + {0, 1}, g], c_j holds
  C[g + 8 (j // 2), 2 t + j % 2] (g = groupID, t = threadID_in_group)."""
  matrix_a = np.zeros((16, 16))
  matrix_b = np.zeros((16, 8))
  for j in range(4):
    low, high = bf16_pair_values(a[:, j])
    row, column = GROUP_ID + 8 * (j % 2), 2 * THREAD_IN_GROUP + 8 * (j // 2)
    matrix_a[row, column], matrix_a[row, column + 1] = low, high
  for j in range(2):
    low, high = bf16_pair_values(b[:, j])
    row = 2 * THREAD_IN_GROUP + 8 * j
    matrix_b[row, GROUP_ID], matrix_b[row + 1, GROUP_ID] = low, high
  product = matrix_a @ matrix_b
  d = np.zeros((32, 4), np.float32)
  for j in range(4):
    d[:, j] = product[GROUP_ID + 8 * (j // 2), 2 * THREAD_IN_GROUP + j % 2] + c[:, j]
  return d


def movmatrix_trans(registers: np.ndarray) -> np.ndarray:
  """`movmatrix.sync.aligned.m8n8.trans.b16`: lane l holds row l / 4, columns 2 (l % 4) + {0, 1}
  of an 8 x 8 matrix of 16-bit elements; afterwards the same of its transpose."""
  matrix = np.zeros((8, 8), np.uint32)
  matrix[GROUP_ID, 2 * THREAD_IN_GROUP] = registers & 0xFFFF
  matrix[GROUP_ID, 2 * THREAD_IN_GROUP + 1] = registers >> 16
  transposed = matrix.T
  return transposed[GROUP_ID, 2 * THREAD_IN_GROUP] | (
    transposed[GROUP_ID, 2 * THREAD_IN_GROUP + 1] << 16
  )


def ldmatrix_x4_trans(
  half_words: np.ndarray, row_of_lane: np.ndarray, column_of_lane
) -> np.ndarray:
  """`ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`: lane l addresses row l % 8 of matrix l / 8
  (its 8 16-bit elements from (row_of_lane[l], column_of_lane[l]) of `half_words`); register m of
  lane l then holds column l / 4 of matrix m's rows 2 (l % 4) and 2 (l % 4) + 1."""
  # the 32 addressed rows, then v43's model of the instruction over them
  rows = np.stack([half_words[r, c : c + 8] for r, c in zip(row_of_lane, column_of_lane)])
  return transposed_matrix_registers(rows, 0)


def field(word: np.ndarray, p: int) -> np.ndarray:
  return word & np.uint32(0x00030003 << (2 * p))


def key_registers(words: np.ndarray) -> np.ndarray:
  """The experiment's `key_registers`: uint32 [32, 2] (a token's words 2 t, 2 t + 1) -> [32, 16]."""
  registers = np.zeros((32, 16), np.uint32)
  for word in range(2):
    high = words[:, word] >> 8
    for p in range(4):
      registers[:, 8 * word + p] = field(words[:, word], p)
      registers[:, 8 * word + 4 + p] = field(high, p)
  return registers


def lane_queries(queries: np.ndarray) -> np.ndarray:
  """float32 [4, 128] queries -> uint32 [32, 16]: register i of lane (g, t) packs row g % 4's
  channels 8 f + w and 8 f + 64 + w (w = 2 t + i / 8, f = i % 8), times 2^(69 - 2 (f % 4))."""
  registers = np.zeros((32, 16), np.uint32)
  query_row = GROUP_ID % experiment.REAL_ROWS
  for i in range(16):
    word, f = 2 * THREAD_IN_GROUP + i // 8, i % 8
    scale = np.float32(2.0 ** (69 - 2 * (f % 4)))
    registers[:, i] = pack_bf16_pair(
      queries[query_row, 8 * f + word] * scale, queries[query_row, 8 * f + 64 + word] * scale
    )
  return registers


def warp_tile(state: dict, slot: dict, warp: int, tile: int, tiles: int, token_base: int):
  """One warp's 16-token tile of a block, as the experiment's loop body runs it (in place on
  `state`: the warp's output [8, 32, 4] and its lanes' sums)."""
  warp_tokens = 16 * tiles
  group = warp_tokens * warp // experiment.GROUP
  # Q' from the group's key scales: word k of lane t pairs channels 8 k + 2 t and 8 k + 2 t + 1
  scale_pairs = slot["k_scale"][group].view(np.uint32)  # [64] words of 2 bf16
  scale_words = np.stack([scale_pairs[4 * k + THREAD_IN_GROUP] for k in range(16)], axis=1)
  scaled_query = np.zeros((32, 16), np.uint32)
  for i in range(16):
    f = i % 8
    pair = byte_perm(scale_words[:, f], scale_words[:, f + 8], 0x7632 if i // 8 else 0x5410)
    scaled_query[:, i] = hmul2_bf16(state["queries"][:, i], pair)
  # the C fragment's columns 2 t, 2 t + 1: query rows 2 (t % 2) + 0, 1, in slot t / 2
  column_row, column_slot = 2 * (THREAD_IN_GROUP % 2), THREAD_IN_GROUP // 2
  bias = slot["key_bias"][group]  # [4] rows
  reference = state["reference"]
  shift = np.stack(
    [bias[column_row] - reference[column_row], bias[column_row + 1] - reference[column_row + 1]],
    axis=1,
  ).astype(np.float32)

  token0 = warp_tokens * warp + 16 * tile + GROUP_ID  # within the block: A rows token0, + 8
  key_words = slot["key_words"]
  own_words = np.stack([2 * THREAD_IN_GROUP, 2 * THREAD_IN_GROUP + 1], axis=1)  # words 2t, 2t+1
  a0 = key_registers(key_words[token0[:, None], own_words])
  a1 = key_registers(key_words[token0[:, None] + 8, own_words])
  even, odd = np.zeros((32, 4), np.float32), np.zeros((32, 4), np.float32)
  for k in range(8):
    a = np.stack([a0[:, 2 * k], a1[:, 2 * k], a0[:, 2 * k + 1], a1[:, 2 * k + 1]], axis=1)
    b = np.stack([scaled_query[:, 2 * k], scaled_query[:, 2 * k + 1]], axis=1)
    if k % 2:
      odd = mma_m16n8k16(a, b, odd)
    else:
      even = mma_m16n8k16(a, b, even)
  score_scale = np.float32(2.0**64)
  logits = (even + odd) * score_scale + shift[:, [0, 1, 0, 1]]
  p = np.exp2(logits.astype(np.float32))
  token = token_base + token0
  p[token >= state["length"], 0:2] = 0
  p[token + 8 >= state["length"], 2:4] = 0
  state["sums"][:, 0] += p[:, 0] + p[:, 2]
  state["sums"][:, 1] += p[:, 1] + p[:, 3]
  probs_scale = np.float32(2.0**64)
  b0, b1 = [], []
  for b in range(2):  # value group 2 slot + b of the lane's columns
    value_group = 2 * column_slot + b
    tokens = np.stack([token0, token0 + 8], 1)
    v_scale = experiment.bf16_values(slot["v_scale"][value_group[:, None], tokens]) * probs_scale
    v_min = experiment.bf16_values(slot["v_min"][value_group[:, None], tokens])
    state["min_sums"][:, b, 0] += p[:, 0] * v_min[:, 0] + p[:, 2] * v_min[:, 1]
    state["min_sums"][:, b, 1] += p[:, 1] * v_min[:, 0] + p[:, 3] * v_min[:, 1]
    scaled = v_scale.astype(np.float32)
    b0.append(movmatrix_trans(pack_bf16_pair(p[:, 0] * scaled[:, 0], p[:, 1] * scaled[:, 0])))
    b1.append(movmatrix_trans(pack_bf16_pair(p[:, 2] * scaled[:, 1], p[:, 3] * scaled[:, 1])))

  half_words = slot["value_words"].view(np.uint16).reshape(slot["value_words"].shape[0], -1)
  matrix = LANES // 8
  rows = warp_tokens * warp + 16 * tile + 8 * (matrix // 2) + LANES % 8
  v = ldmatrix_x4_trans(half_words, rows, 8 * (matrix % 2))
  v_high = v >> 8
  for p_field in range(8):
    source = v if p_field < 4 else v_high
    a = field(source, p_field % 4)
    b = np.stack([b0[p_field // 4], b1[p_field // 4]], axis=1)
    state["output"][p_field] = mma_m16n8k16(a, b, state["output"][p_field])


def warp_states(arrays: dict, r: int, s: int, splits: int, tiles: int) -> list[dict]:
  """The four warps' states (`warp_tile`'s: each lane's partial output, sums and minimum sums)
  after row r's split s, lane by lane."""
  tokens = arrays["key_words"].shape[1]
  block = 64 * tiles
  per_split = experiment.split_tokens(tokens, splits, tiles)
  length = int(arrays["lengths"][r])
  start = s * per_split
  blocks = -(-min(per_split, max(length - start, 0)) // block)
  queries = lane_queries(arrays["queries"][r])
  states = [
    {
      "queries": queries,
      "reference": arrays["reference"][r, s],
      "length": length,
      "output": np.zeros((8, 32, 4), np.float32),
      "sums": np.zeros((32, 2), np.float32),
      "min_sums": np.zeros((32, 2, 2), np.float32),
    }
    for _ in range(experiment.WARPS)
  ]
  for b in range(blocks):
    first = start + b * block
    tokens_of_block = slice(first, first + block)
    groups = slice(first // experiment.GROUP, (first + block) // experiment.GROUP)
    slot = {
      "key_words": arrays["key_words"][r, tokens_of_block],
      "value_words": arrays["value_words"][r, tokens_of_block],
      "k_scale": arrays["k_scale"][r, groups],
      "v_scale": arrays["v_scale"][r, :, tokens_of_block],
      "v_min": arrays["v_min"][r, :, tokens_of_block],
      "key_bias": arrays["key_bias"][r, groups],
    }
    for warp in range(experiment.WARPS):
      for tile in range(tiles):
        warp_tile(states[warp], slot, warp, tile, tiles, first)
  return states


def emulate_outputs(arrays: dict, splits: int, tiles: int) -> tuple[np.ndarray, np.ndarray]:
  """(out, sums) shaped as `model_outputs` gives them, computed lane by lane."""
  rows, tokens, _ = arrays["key_words"].shape
  shapes = experiment.array_shapes(rows, tokens, splits)
  out = np.zeros(shapes["out"][1], np.float32)
  sums = np.zeros(shapes["sums"][1], np.float32)
  for r in range(rows):
    for s in range(splits):
      states = warp_states(arrays, r, s, splits, tiles)
      # the epilogue: accumulator row r of m-tile p is half-word r's field p, in value group
      # 2 (r % 2) + p / 4: it reads the columns of slot r % 2
      column_row, column_slot = 2 * (THREAD_IN_GROUP % 2), THREAD_IN_GROUP // 2
      for state in states:
        for tile in range(8):
          for i in range(4):
            half_word = GROUP_ID + 8 * (i // 2)
            mine = half_word % 2 == column_slot
            channel = 8 * (8 * (half_word % 2) + tile) + half_word // 2
            out[r, s, column_row[mine] + i % 2, channel[mine]] += state["output"][tile][mine, i]
        for t in range(4):  # lanes of one t, summed over g; rows 2 (t % 2) + c, slot t / 2
          lanes = THREAD_IN_GROUP == t
          for c in range(2):
            query_row = 2 * (t % 2) + c
            if t // 2 == 0:
              sums[r, s, query_row, 0] += state["sums"][lanes, c].sum()
            for b in range(2):
              sums[r, s, query_row, 1 + 2 * (t // 2) + b] += state["min_sums"][lanes, b, c].sum()
  return out, sums
