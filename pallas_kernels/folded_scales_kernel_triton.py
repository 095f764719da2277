"""The "folded" GPU variant of the quantized decode kernel: scales folded into stacked operands.

KIVI keys are quantized per channel within groups of `group_size` tokens, values per token
within groups of `group_size` channels. Instead of dequantizing every element (v1 "reshape",
v3 "joined" spend ~4 of their ~11 instructions per element on per-element scales), both
scales move to the small operand of each dot, one copy per quantization group, stacked along
the rows (the M side of the tensor-core tile, which a query group of 1-8 heads leaves mostly
padding anyway):

  keys:    scores[h, t] = sum_c (q[h, c] * k_scale[g, c]) code[t, c] + sum_c q[h, c] k_min[g, c]
           with g = t // group_size: one dot  Q' [groups * rows, D] . codes^T [D, block],
           then row block g is kept for the tokens of group g (a masked sum over groups). The
           second sum, one number per key group and row, comes in computed (`key_bias`).
  values:  out[h, c] = sum_t (p[h, t] * v_scale[t, k]) code[t, c] + sum_t p[h, t] v_min[t, k]
           with k = c // group_size: one dot  P' [value_groups * rows, block] . codes [block, D]
           accumulated over blocks as [value_groups, rows, D]; row block k is kept for the
           channels of group k once, after the last block. The second sum and the softmax
           denominator are kept per token ([value_groups, rows, block], [rows, block]) and
           summed over tokens once, after the last block.

The codes become tensor-core operands without an int-to-float conversion. For 2- and 4-bit
codes with bf16 operands, `(word >> s) & (mask * 0x00010001) | 0x43004300` holds two codes as
the bf16 numbers 128 + code (exact: bf16 has 8 significant bits), and one packed bf16
subtraction of 128 (HADD2) leaves the two codes themselves, exact: three instructions per pair
of elements. (Keeping the 128 in the operand and taking it out through the bias saves the
subtraction but costs two sums of the rounded Q' / P' per block, 184 instructions per 128-token
iteration against 128 HADD2, and leaves a cancellation of 128 x sum(Q') in every score.) The
compiler in jaxlib 0.11.2 does not keep to three: on an H100 the AND and the OR are two LOP3 and
the pairs are re-paired with PRMT before they are staged (benchmarks/KERNEL_NOTES.md, v8).
`code_operand="subnormal"` (the default where it applies, `subnormal_codes`) avoids both: each
code masked in place is the subnormal bf16 number code * 2^(q - 133), one AND per pair, and the
powers of two move to the queries, the probabilities and the output (v9: 1543 -> 907
instructions per block on the H100). Otherwise (8-bit codes, f16 or f32 operands) each code is
an exact float through the 2^23 magic number.

On sm_90 the value dot is taken transposed, update^T = codes^T . P'^T, so that its M side is
the head dim (>= 64) and Triton emits a warpgroup MMA (wgmma) that reads P'^T from shared
memory once per warpgroup, instead of mma.sync with every warp loading all of P' by ldmatrix.

The bit fields are joined with `join_fields` (register renaming), so the channels come out in
the fixed order `folded_channel_order`, the same for keys and values: the queries are permuted
outside, and the output is un-permuted outside after the split merge.
GEAR caches: one step is one GEAR block; its low-rank and outlier terms (`gear_terms_triton`)
are added to the scores and, being [rows, D] per block, to an accumulator of their own.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.decode_attention_triton import (
  _dot_nn,
  _dot_nt,
  load_token_rows,
  softmax_step_numerators,
  split_block_range,
  store_split_partials,
)
from pallas_kernels.float_unpacking import MAGIC_2_23, bf16_halves
from pallas_kernels.gear_terms_triton import GearRefs, gear_score_terms, gear_value_terms
from pallas_kernels.joined_fields import join_fields
from pallas_kernels.splits import SplitPlan, next_power_of_two
from pallas_kernels.subnormal_codes import (
  PROBS_SCALE,
  SCORE_SCALE,
  dot_with_code_operand,
  output_position_scale,
  query_position_scale,
  subnormal_code_pairs,
)

BF16_128 = 0x4300  # bf16 bits of 128.0: OR-ing in a code c < 128 gives 128 + c exactly


def uses_bf16_pairs(bits: int, compute_dtype) -> bool:
  """Two codes per 32-bit word become two bf16 codes with two integer ops and one packed bf16
  subtraction (2 and 4 bits)."""
  return bits in (2, 4) and jnp.dtype(compute_dtype) == jnp.dtype(jnp.bfloat16)


def _join_pairs(pairs: list) -> jax.Array:
  """[(low, high)] -> one tensor: the low halves joined, the high halves joined, then the two
  joined last, so each (low, high) pair of one word stays adjacent, i.e. stays one 32-bit
  register (same on numpy)."""
  return join_fields(
    [join_fields([low for low, _ in pairs]), join_fields([high for _, high in pairs])]
  )


def folded_channel_order(
  head_dim: int, bits: int, compute_dtype, channel_parts: int = 1
) -> np.ndarray:
  """numpy int32 [D]: channel at each position of the unpacked codes (keys and values), the
  `channel_parts` parts side by side (part p unpacks words [p W/n, (p + 1) W/n) of a token)."""
  fields = 32 // bits
  width = head_dim // fields
  part_width = width // channel_parts

  def field(k, part):
    first = k * width + part * part_width
    return np.arange(first, first + part_width, dtype=np.int32)[None, :]

  orders = []
  for part in range(channel_parts):
    if uses_bf16_pairs(bits, compute_dtype):
      half = fields // 2
      orders.append(_join_pairs([(field(j, part), field(j + half, part)) for j in range(half)])[0])
    else:
      orders.append(join_fields([field(k, part) for k in range(fields)])[0])
  return np.concatenate(orders)


def unpack_codes_for_dot(
  words: jax.Array, bits: int, compute_dtype, code_operand: str = "offset"
) -> jax.Array:
  """uint32 [rows, W] planar words -> [rows, D] codes as exact `compute_dtype` numbers,
  positions in `folded_channel_order`.

  bf16 pairs: fields j and j + n/2 of a word sit 16 bits apart, so one shift moves both to the
  bottom of their half, one AND-OR with the bits of 128.0 makes the pair (128 + c_j,
  128 + c_{j+n/2}) and one packed subtraction of 128 makes it (c_j, c_{j+n/2}), all exact;
  the pair is the 32-bit register the tensor core reads. `code_operand="subnormal"`: one AND
  per pair makes (c_j, c_{j+n/2}) * 2^(q - 133) instead (`subnormal_codes`).
  """
  fields = 32 // bits
  field_mask = (1 << bits) - 1
  if uses_bf16_pairs(bits, compute_dtype):
    if code_operand == "subnormal":
      return _join_pairs(subnormal_code_pairs(words, bits))
    half = fields // 2
    pairs = []
    for j in range(half):
      both = jnp.right_shift(words, jnp.uint32(bits * j)) if j else words
      both = (both & jnp.uint32(field_mask * 0x00010001)) | jnp.uint32(BF16_128 * 0x00010001)
      low, high = bf16_halves(both)
      bias = jnp.bfloat16(128.0)
      pairs.append((low - bias, high - bias))
    return _join_pairs(pairs)
  codes = []
  for k in range(fields):
    field = jnp.right_shift(words, jnp.uint32(bits * k)) if k else words
    magic = (field & jnp.uint32(field_mask)) | jnp.uint32(MAGIC_2_23)
    code = jax.lax.bitcast_convert_type(magic, jnp.float32) - 8388608.0  # exact
    codes.append(code.astype(compute_dtype))
  return join_fields(codes)


MIN_TILE_ROWS = 16  # the smallest M (and N) of a bf16 tensor-core tile that Triton's dot takes


def folded_rows(
  group: int, block_tokens: int, head_dim: int, group_size: int, stack_copies: bool = False
) -> int:
  """Query rows per program: the group padded to a power of two and, unless `stack_copies`,
  further, until the stacked operands have MIN_TILE_ROWS rows. With `stack_copies` the
  stacked operands are repeated to fill the tile instead (`tile_copies`), so the per-row work
  (score selection, softmax, P' build) runs on the real rows only."""
  rows = next_power_of_two(group)
  if stack_copies:
    return rows
  stacks = min(block_tokens // group_size, head_dim // group_size)
  return max(rows, -(-MIN_TILE_ROWS // stacks))


def tile_copies(stacked_rows: int) -> int:
  """Copies of a stacked operand of `stacked_rows` rows (a power of two) that fill
  MIN_TILE_ROWS rows: 1 where it has that many already."""
  return max(1, MIN_TILE_ROWS // stacked_rows)


def repeat_stacked_rows(stacked: jax.Array, copies: int) -> jax.Array:
  """[n, C] -> [copies * n, C]: the stacked operand `copies` times along the rows."""
  if copies == 1:
    return stacked
  rows, columns = stacked.shape
  return jnp.broadcast_to(stacked[None], (copies, rows, columns)).reshape(copies * rows, columns)


def first_copy_rows(product: jax.Array, copies: int) -> jax.Array:
  """[copies * n, C] -> [n, C]: the rows of the first copy of a dot's repeated operand."""
  return jnp.split(product, copies, axis=0)[0] if copies > 1 else product


def folded_supported(head_dim: int, bits: int, group_size: int, block_tokens: int) -> bool:
  """Whole key groups per block, whole bit fields per value group, whole value groups per head."""
  width = head_dim * bits // 32
  return group_size % width == 0 and block_tokens % group_size == 0 and head_dim % group_size == 0


CHANNEL_PARTS = (1, 2, 4)
MIN_PART_CHANNELS = 16  # the K side of one bf16 tensor-core step


def check_channel_parts(channel_parts: int, head_dim: int, bits: int) -> None:
  """ValueError unless `channel_parts` is one of CHANNEL_PARTS, divides the words of a token and
  leaves each part >= MIN_PART_CHANNELS channels."""
  words = head_dim * bits // 32
  if (
    channel_parts not in CHANNEL_PARTS
    or words % channel_parts
    or head_dim // channel_parts < MIN_PART_CHANNELS
  ):
    raise ValueError(
      f"channel_parts={channel_parts!r} must be one of {CHANNEL_PARTS} that divides the "
      f"{words} code words of a token (head_dim={head_dim}, bits={bits}) and leaves "
      f">= {MIN_PART_CHANNELS} channels per part"
    )


def folded_kernel(
  lengths_ref,
  order_ref,
  queries_ref,
  k_codes_ref,
  k_scale_ref,
  key_bias_ref,  # f32 [T / group_size, rows]: q . k_min per key group (`key_bias`)
  v_codes_ref,
  v_scale_ref,
  v_min_ref,
  *rest,
  plan: SplitPlan,
  tokens: int,
  bits: int,
  group_size: int,
  has_lowrank: bool = False,
  has_outliers: bool = False,
  prefetch: bool = False,
  code_operand: str = "offset",
  channel_parts: int = 1,
  score_io: bool = False,
  interpret: bool = False,
):
  """One step = one block of `plan.block_tokens` tokens (one GEAR block where the kernel
  computes GEAR's terms), one dot for K and one for V per channel part. `rest`: the GEAR refs
  if any, optional aliased starting contents of the outputs, then (out_ref, lse_ref).
  `code_operand="subnormal"`: bf16 2- and 4-bit codes as small bit patterns (`subnormal_codes`),
  the key dot's queries scaled per position once per program (`interpret`: the two code dots
  emulated, since XLA on CPU flushes subnormals).

  `prefetch`: each step issues the loads of the next block before its own arithmetic and
  carries them (register double buffering), so the global-memory latency of one block hides
  behind the work of the previous one. Loads past the split's end are masked off (no memory
  read), so the last step's prefetch costs no traffic.

  `channel_parts` n > 1: each token's code words are taken in n column slices, each unpacked
  and multiplied on its own ([block, D/n] operands, keys' scores summed, values' products in
  one accumulator per part), so only a 1/n-wide code tile is live in registers at a time: fewer
  registers per thread (more programs per SM) for more, smaller dots (KERNEL_NOTES v10).

  `score_io`: GEAR's terms are computed by XLA around the kernel (`gear_terms_xla`), so the
  kernel takes no GEAR refs but score_bias_ref float32 [R, T] (R: the query group padded to a
  power of two), adds it to the scores, and has a third output scores_ref float32 [R, T] where
  each step writes its valid tokens' scores as the softmax saw them: base-2 logits, as the bias
  is (`base_two_softmax`)."""
  outputs = 3 if score_io else 2
  out_ref, lse_ref = rest[-outputs:][:2]
  gear = GearRefs.take(rest[:-outputs], has_lowrank, has_outliers)
  block = plan.block_tokens
  key_groups = block // group_size
  start, end, num_blocks = split_block_range(plan, lengths_ref[()], tokens)
  compute_dtype = queries_ref.dtype
  subnormal = code_operand == "subnormal" and uses_bf16_pairs(bits, compute_dtype)
  rows, head_dim = queries_ref.shape
  value_groups = head_dim // group_size
  # Where the query rows are not padded to fill the tensor-core tile (`folded_rows`'
  # stack_copies), the stacked operands are repeated to fill it and one copy's product kept.
  key_copies, value_copies = tile_copies(key_groups * rows), tile_copies(value_groups * rows)
  part_words = k_codes_ref.shape[-1] // channel_parts
  part_channels = head_dim // channel_parts
  parts = [pl.ds(part * part_channels, part_channels) for part in range(channel_parts)]
  orders = [order_ref[part] for part in parts]  # [D / n] int32: channel at each position
  code_queries = []  # per part [rows, D / n]: the key dot's operand
  for part, order in zip(parts, orders):
    part_queries = queries_ref[:, part]  # folded order, pre-scaled
    if subnormal:  # exact: a power of two per position, within bf16's range
      position_scale = query_position_scale(order, head_dim, bits)[None, :]
      part_queries = (part_queries.astype(jnp.float32) * position_scale).astype(compute_dtype)
    code_queries.append(part_queries)
  query_rows = jnp.arange(rows, dtype=jnp.int32)[None, :]
  offsets = jnp.arange(block, dtype=jnp.int32)
  group_offsets = jnp.arange(key_groups, dtype=jnp.int32)
  token_is_in_group = (offsets // group_size)[None, None, :] == group_offsets[:, None, None]
  last_group = tokens // group_size - 1
  if score_io:
    if gear.present:
      raise ValueError("score_io replaces the kernel's GEAR terms; it takes no GEAR refs")
    score_bias_ref, scores_ref = rest[0], rest[-1]
    score_rows = scores_ref.shape[0]
    # The padding query rows take the last real row's bias: a load with no mask and no extra
    # memory traffic (the same addresses), and their scores are never used.
    bias_rows = jnp.minimum(jnp.arange(rows, dtype=jnp.int32), score_rows - 1)[:, None]

  def tokens_valid(first):
    return first + offsets < end  # [block]; masked lanes read no memory

  def load_words(ref, first, valid):  # per part [block, W / n]
    return tuple(
      load_token_rows(ref, first, block, valid, pl.ds(part * part_words, part_words))
      for part in range(channel_parts)
    )

  def load_keys(first):
    valid = tokens_valid(first)
    group_rows = jnp.minimum(first // group_size + group_offsets, last_group)[:, None]
    return (
      load_words(k_codes_ref, first, valid),
      tuple(k_scale_ref[group_rows, order[None, :]] for order in orders),  # [groups, D / n]
      key_bias_ref[group_rows, query_rows],  # [groups, rows]
    )

  def load_values(first):
    valid = tokens_valid(first)
    return (
      load_words(v_codes_ref, first, valid),
      load_token_rows(v_scale_ref, first, block, valid),  # [block, value_groups]
      load_token_rows(v_min_ref, first, block, valid),
    )

  def body(i, carry):
    running_max, sum_partials, accs, value_bias_partials, gear_accs, prefetched = carry
    first = start + i * block
    valid = tokens_valid(first)
    if prefetch:
      (k_words, k_scales, key_bias), loaded_values = prefetched
      prefetched = (load_keys(first + block), load_values(first + block))
    else:
      k_words, k_scales, key_bias = load_keys(first)

    part_scores = []  # summed over the parts below
    for words, k_scale, part_queries in zip(k_words, k_scales, code_queries):
      k_code = unpack_codes_for_dot(words, bits, compute_dtype, code_operand)  # [block, D / n]
      # compute_dtype is the scales' own dtype (`compute_dtype_for`), so this multiplies in
      # bf16 (HMUL2, a pair per instruction) for bf16 caches: the product of two bf16 numbers
      # is exact in float32, so it is bit for bit the float32 product and cast, at half the
      # instructions.
      stacked_queries = part_queries[None, :, :] * k_scale.astype(compute_dtype)[:, None, :]
      stacked_queries = stacked_queries.reshape(key_groups * rows, part_channels)
      part_scores.append(
        first_copy_rows(
          dot_with_code_operand(
            _dot_nt,
            repeat_stacked_rows(stacked_queries, key_copies),
            k_code,
            codes_are_lhs=False,
            emulate=subnormal and interpret,
          ),
          key_copies,
        ).reshape(key_groups, rows, block)
      )
    stacked_scores = sum(part_scores[1:], part_scores[0])
    if subnormal:
      stacked_scores = stacked_scores * SCORE_SCALE
    scores = jnp.sum(
      jnp.where(token_is_in_group, stacked_scores + key_bias[:, :, None], 0.0), axis=0
    )  # [rows, block]

    if gear.present:
      scores = scores + gear_score_terms(gear, queries_ref, first // block, first, valid)
    if score_io:
      bias_tokens = jnp.minimum(first + offsets, tokens - 1)[None, :]
      scores = scores + score_bias_ref[bias_rows, bias_tokens]
      # Only the group's rows go out, split off in registers: a store of all rows with the
      # padding rows masked would need in-bounds addresses for them, i.e. repeated ones, which
      # interpret mode writes back in no fixed order.
      real_scores = (
        jnp.split(scores, rows // score_rows, axis=0)[0] if rows > score_rows else scores
      )
      _compat.triton_store(scores_ref.at[:, pl.ds(first, block)], real_scores, mask=valid[None, :])
    running_max, correction, probs = softmax_step_numerators(running_max, scores, valid)

    v_words, v_scale, v_min = loaded_values if prefetch else load_values(first)
    v_scale, v_min = (x.astype(jnp.float32).T for x in (v_scale, v_min))  # [value_groups, block]
    if subnormal:
      v_scale = v_scale * PROBS_SCALE
    stacked_probs = (probs[None, :, :] * v_scale[:, None, :]).astype(compute_dtype)
    stacked_probs = repeat_stacked_rows(
      stacked_probs.reshape(value_groups * rows, block), value_copies
    )
    new_accs = []
    for words, acc in zip(v_words, accs):
      v_code = unpack_codes_for_dot(words, bits, compute_dtype, code_operand)  # [block, D / n]
      # Transposed so that M is the head dim: a wgmma on sm_90 (see the module docstring).
      update = dot_with_code_operand(
        _dot_nn,
        v_code.T,
        stacked_probs.T,
        codes_are_lhs=True,
        emulate=subnormal and interpret,
      ).T
      update = first_copy_rows(update, value_copies).reshape(value_groups, rows, part_channels)
      new_accs.append(acc * correction[None, :, None] + update)
    # The softmax denominator and sum_t p v_min[t] per value group stay per token, rescaled like
    # the accumulators, and are summed over tokens once after the loop: the tokens of a block
    # are spread over the warps, so a sum over them crosses the warps through shared memory and
    # a barrier every block (KERNEL_NOTES v19).
    sum_partials = sum_partials * correction[:, None] + probs
    value_bias_partials = (
      value_bias_partials * correction[None, :, None] + probs[None, :, :] * v_min[:, None, :]
    )  # [value_groups, rows, block]
    if gear.present:
      gear_updates = gear_value_terms(
        gear, probs, first // block, first, valid, orders, compute_dtype
      )
      gear_accs = tuple(
        gear_acc * correction[:, None] + update for gear_acc, update in zip(gear_accs, gear_updates)
      )
    return running_max, sum_partials, tuple(new_accs), value_bias_partials, gear_accs, prefetched

  init = (
    jnp.full((rows,), -jnp.inf, jnp.float32),
    jnp.zeros((rows, block), jnp.float32),
    tuple(
      jnp.zeros((value_groups, rows, part_channels), jnp.float32) for _ in range(channel_parts)
    ),
    jnp.zeros((value_groups, rows, block), jnp.float32),
    # GEAR's value terms are [rows, D / n] per block and part: accumulators of their own.
    tuple(jnp.zeros((rows, part_channels), jnp.float32) for _ in range(channel_parts))
    if gear.present
    else (),
    (load_keys(start), load_values(start)) if prefetch else (),
  )
  running_max, sum_partials, accs, value_bias_partials, gear_accs, _ = jax.lax.fori_loop(
    0, num_blocks, body, init
  )
  running_sum = sum_partials.sum(axis=1)
  value_bias = value_bias_partials.sum(axis=2)  # [value_groups, rows]
  outs = []
  for index, (acc, order) in enumerate(zip(accs, orders)):
    position_group = (order // group_size)[None, None, :]  # value group of each position
    in_group = position_group == jnp.arange(value_groups, dtype=jnp.int32)[:, None, None]
    if subnormal:
      acc = acc * output_position_scale(order, head_dim, bits)[None, None, :]
    out = jnp.sum(jnp.where(in_group, acc + value_bias[:, :, None], 0.0), axis=0)  # [rows, D/n]
    if gear.present:
      out = out + gear_accs[index]
    outs.append(out)
  store_split_partials(out_ref, lse_ref, running_max, running_sum, *outs)
