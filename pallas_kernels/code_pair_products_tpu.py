"""The TPU quantized kernel's two products with the codes as bfloat16 pairs (`bfloat16_code_pairs`).

The codes' operand rows hold 1 + code * 2^(p - 7), in the pairs' row order. What the other
operand and the result do with that:

  scores  the key scales folded into the queries per key group, as in `_scale_folded_scores`,
          queries and scales taken in row order, the rows' factors in the scales (reordered by
          one product with `pair_matrix`: exact). Each q x scale, a product of two bfloat16
          numbers, is split exactly into two bfloat16 numbers stacked as rows, so the product
          with the pairs is exact; the 1s' part (sum_c q[c] factor[c] k_scale[g, c]) is
          subtracted exactly with q . k_min, per key group, each tile taking its groups' by one
          lane gather;
  values  the value scales folded into the probabilities per value group: P' [groups x rows,
          block] = p * scale of the group, rounded to bfloat16, times the codes' rows
          (contracting the tokens), minus each P' row's exact sum (the 1s); into channel order
          and times the factors by one product with `pair_matrix` (by bfloat16 halves: the
          float32 result exact to 2^-16); each channel takes its group's rows, and p . minimum
          of its group is added.

The 1s cancel against exactly the bfloat16 operands that multiplied them: the codes' part of a
row is a small part of it (2^-7 of the 1 at p = 0), and anything but the same rounded numbers
would leave their rounding, times up to 2^7, in the result. Where the query rows are copied into
the padding (`copied_query_rows`) one array of 8 rows holds several groups' rows
(`groups_per_block`), each token or channel taking its group's block by sublane rotations.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import bfloat16_code_pairs
from pallas_kernels.bfloat16_halves import product_by_halves
from pallas_kernels.decode_attention_tpu import LANES


def rounded_to_bfloat16(x: jax.Array) -> jax.Array:
  """float32 x rounded to the nearest bfloat16 number (halves away from zero), still float32.
  By bits: XLA may drop a float32 -> bfloat16 -> float32 round trip as excess precision
  (`xla_allow_excess_precision`), and the sums of the rounded numbers must be exactly theirs."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  rounded = (bits + jnp.uint32(0x8000)) & jnp.uint32(0xFFFF0000)
  return jax.lax.bitcast_convert_type(rounded, jnp.float32)


def groups_per_block(rows: int, query_rows: int, groups: int) -> int:
  """k: how many groups one [rows, n] array holds, group j in rows [j rows / k, (j + 1) rows /
  k), where the query rows are copied to fill the rows (8 of them, `copied_query_rows`): each
  block then holds whole copies of them. 1 where they are not, or where `groups` does not
  split."""
  if rows != 8 or 8 % query_rows:
    return 1
  k = 8 // query_rows
  while groups % k:
    k //= 2
  return k


def copied_query_rows(rows: int, query_rows: int) -> bool:
  """Whether the queries' padding rows hold copies of the query rows (so that a register of 8
  rows can serve 8 / query_rows groups) rather than zeros."""
  return rows == 8 and 8 % query_rows == 0


def fill_query_rows(queries: jax.Array, rows: int) -> jax.Array:
  """[..., rows, D]: the query rows [..., q, D], then copies of them where `copied_query_rows`,
  else zeros."""
  query_rows = queries.shape[-2]
  if copied_query_rows(rows, query_rows):
    return jnp.concatenate([queries] * (rows // query_rows), axis=-2)
  padding = [(0, 0)] * (queries.ndim - 2) + [(0, rows - query_rows), (0, 0)]
  return jnp.pad(queries, padding)


def _row_block(shape, k: int) -> jax.Array:
  return jax.lax.broadcasted_iota(jnp.int32, shape, 0) // (shape[0] // k)


def _sublane_rows(stats: jax.Array, first: int, k: int, shape, gathers: bool) -> jax.Array:
  """[rows, n]: block j of rows from stats row first + j ([groups, n]). With `gathers`, by one
  sublane gather from the 8-row slab holding rows first .. first + k - 1 (a TPU v5e or newer:
  Mosaic refuses a sublane gather for a v4, "failed to legalize tpu.dynamic_gather"); else
  each row broadcast over its block, the blocks joined (k broadcasts and k - 1 selects)."""
  if not gathers:
    size = shape[0] // k
    return jnp.concatenate(
      [jnp.broadcast_to(stats[first + j : first + j + 1], (size, shape[1])) for j in range(k)]
    )
  slab_start = first // 8 * 8
  slab = stats[slab_start : slab_start + 8]
  if slab.shape[0] < 8:
    slab = jnp.concatenate([slab, jnp.zeros((8 - slab.shape[0], slab.shape[1]), slab.dtype)])
  index = _row_block(shape, k) + (first - slab_start)
  return jnp.take_along_axis(slab, index, axis=0)


def _own_group_rows(arrays: jax.Array, group: jax.Array, k: int, rows: int) -> jax.Array:
  """[rows, n]: column t's rows of its group group[t] ([1, n]) in every block of rows, from
  arrays [groups / k x rows, n] of k groups' blocks of rows each: each column's array chosen,
  then its group's block rotated into every block (`_own_block_everywhere`)."""
  chosen = arrays[:rows]
  for v in range(1, arrays.shape[0] // rows):
    chosen = jnp.where(group // k == v, arrays[v * rows : (v + 1) * rows], chosen)
  return _own_block_everywhere(chosen, group % k, k)


def _own_block_everywhere(x: jax.Array, own_block: jax.Array, k: int) -> jax.Array:
  """x [rows, n] whose block own_block[t] (of k blocks of rows; [1, n]) holds token t's rows:
  those rows in every block, by sublane rotations (block m of the result is block j of x
  rotated by (m - j) blocks)."""
  if k == 1:
    return x
  size = x.shape[0] // k
  rotation = (_row_block(x.shape, k) - own_block) % k
  out = x
  for shift in range(1, k):
    out = jnp.where(rotation == shift, pltpu.roll(x, shift * size, 0), out)
  return out


def pair_ordered_scales(k_scale: jax.Array, matrix: jax.Array, groups_axis: int = 0) -> jax.Array:
  """float32 [groups, R]: the key scales [groups, D] (or [D, groups] with `groups_axis` 1;
  bfloat16, channel order) in the pairs' row order, times the rows' factors, by `matrix`
  [R, D] (`pair_matrix`, or a virtual head's rows of real channels: `code_pair_halves_tpu`;
  exact: one nonzero term, a power of two)."""
  return jax.lax.dot_general(
    k_scale.astype(jnp.bfloat16),
    matrix,
    (((1 - groups_axis,), (1,)), ((), ())),
    preferred_element_type=jnp.float32,
  )


def pair_query_rows(queries: jax.Array, bits: int) -> jax.Array:
  """[..., 2 rows, D]: queries [..., rows, D] (bfloat16) in the pairs' row order, then times
  their rows' factors in channel order (both exact), for `key_scores`. The reordering is a
  product with a 0/1 matrix: as a gather on the channels XLA laid the result out channels-major
  and copied it into the kernel's layout at every call (2 MiB at batch 8, 8 KV heads, v57)."""
  head_dim = queries.shape[-1]
  channel, factor = bfloat16_code_pairs.pair_rows(head_dim, bits)
  order = np.zeros((head_dim, head_dim), np.float32)
  order[np.arange(head_dim), channel] = 1.0
  in_row_order = jnp.einsum(
    "...c,rc->...r",
    queries,
    jnp.asarray(order, queries.dtype),
    preferred_element_type=jnp.float32,
  )  # exact: one nonzero term
  factor_of_channel = np.zeros(head_dim, np.float32)
  factor_of_channel[channel] = factor
  factored = queries.astype(jnp.float32) * factor_of_channel
  return jnp.concatenate([in_row_order, factored], axis=-2).astype(queries.dtype)


def key_scores(
  queries: jax.Array,
  pair_queries: jax.Array,
  pairs: jax.Array,
  k_scale: jax.Array,
  k_min: jax.Array,
  matrix: jax.Array,
  *,
  group_size: int,
  query_rows: int,
  groups_axis: int = 0,
  sublane_gathers: bool = True,
) -> jax.Array:
  """float32 [rows, block]: q . k for queries bfloat16 [rows, D] (channel order), pair_queries
  bfloat16 [2 rows, D] (the queries in the pairs' row order, then the queries times their rows'
  factors in channel order: `pair_query_rows`), the key pairs [D, block], the key statistics
  [groups, D] (or [D, groups] with `groups_axis` 1, as stored below 128 channels; bfloat16,
  zero past the length) and `pair_matrix` bfloat16 [D, D]."""
  rows = queries.shape[0]
  scales, per_group = key_score_terms(queries, pair_queries, k_scale, k_min, matrix, groups_axis)
  return pair_key_scores(
    pair_queries[:rows], pairs, scales, per_group, group_size, query_rows, sublane_gathers
  )


def key_score_terms(
  queries: jax.Array,
  pair_queries: jax.Array,
  k_scale: jax.Array,
  k_min: jax.Array,
  matrix: jax.Array,
  groups_axis: int = 0,
) -> tuple[jax.Array, jax.Array]:
  """(scales float32 [groups, D] in the pairs' row order, per_group float32 [rows, groups]) of
  a block's key statistics, `key_scores`' arguments: what `pair_key_scores` takes for any of
  the block's token ranges. The scales' product is issued first: the other way round (v57's
  order, when every key score of a block came first) the chunked step is 1-2% longer (static
  v5e bundles, KERNEL_NOTES v63)."""
  return (
    pair_ordered_scales(k_scale, matrix, groups_axis),
    group_constants(queries, pair_queries, k_scale, k_min, groups_axis),
  )


def group_constants(
  queries: jax.Array,
  pair_queries: jax.Array,
  k_scale: jax.Array,
  k_min: jax.Array,
  groups_axis: int = 0,
) -> jax.Array:
  """float32 [rows, groups]: each key group's q . k_min less the pairs' 1s (sum_c q[c]
  factor[c] k_scale[g, c]), from the queries [rows, D] and `pair_query_rows` [2 rows, D] (its
  factored rows), in channel order."""
  rows = queries.shape[0]
  channels_axis = 1 - groups_axis
  return jax.lax.dot_general(
    jnp.concatenate([queries, -pair_queries[rows:]], axis=1),
    jnp.concatenate([k_min, k_scale], axis=channels_axis),
    (((1,), (channels_axis,)), ((), ())),
    preferred_element_type=jnp.float32,
  )


def pair_key_scores(
  queries: jax.Array,
  pairs: jax.Array,
  scales: jax.Array,
  per_group: jax.Array,
  group_size: int,
  query_rows: int,
  sublane_gathers: bool = True,
  token_offset: int = 0,
) -> jax.Array:
  """float32 [rows, n]: q . k of each of tokens token_offset .. token_offset + n - 1 of a
  block, from queries bfloat16 [rows, D], their pairs bfloat16 [D, n] (`code_pairs`), and the
  whole block's scales float32 [groups, D] in the pairs' row order (`pair_ordered_scales`:
  exact bfloat16 numbers times the rows' factors) and per_group float32 [rows, groups]: each
  key group's q . k_min less the pairs' 1s (sum_r q[r] scales[g, r]); `key_score_terms`.

  Per lane tile, the queries times each of the tile's key groups' scales (the key scales
  folded into the queries), k groups an array of rows (`groups_per_block`); each product of
  two bfloat16 numbers is exact in float32 and exactly the sum of two bfloat16 numbers, its
  rounding and the rest, stacked as rows: one product, exact, so that the 1s cancel exactly.
  Each token takes its own group's rows."""
  return key_scores_sharing_pairs(
    [(queries, scales, per_group)], pairs, group_size, query_rows, sublane_gathers, token_offset
  )[0]


def key_scores_sharing_pairs(
  query_sets,
  pairs: jax.Array,
  group_size: int,
  query_rows: int,
  sublane_gathers: bool = True,
  token_offset: int = 0,
) -> list[jax.Array]:
  """`pair_key_scores` of several sets of (queries, scales, per_group) against the same pairs,
  each set's scores: one product a lane tile for every set's rows, so that each tile of pairs
  is pushed into the MXU once (the token halves' virtual heads share their pairs:
  `code_pair_halves_tpu`)."""
  rows, channels = query_sets[0][0].shape
  block = pairs.shape[1]
  tile = math.lcm(LANES, group_size)
  query_sets = [(queries.astype(jnp.float32), *rest) for queries, *rest in query_sets]
  parts = [[] for _ in query_sets]
  for start in range(0, block, tile):
    width = min(tile, block - start)
    first, groups = (token_offset + start) // group_size, width // group_size
    k = groups_per_block(rows, query_rows, groups)
    arrays = [range(first + v * k, first + (v + 1) * k) for v in range(groups // k)]
    operands = []
    for queries, scales, _ in query_sets:
      scaled = jnp.concatenate(
        [
          queries * _sublane_rows(scales, array[0], k, (rows, channels), sublane_gathers)
          for array in arrays
        ]
      )  # [groups / k x rows, D], exact
      high = rounded_to_bfloat16(scaled)
      operands += [high, scaled - high]
    both = jax.lax.dot_general(
      jnp.concatenate(operands).astype(jnp.bfloat16),
      pairs[:, start : start + width],
      (((1,), (0,)), ((), ())),
      preferred_element_type=jnp.float32,
    )
    size = len(arrays) * rows
    token_group = jax.lax.broadcasted_iota(jnp.int32, (1, width), 1) // group_size
    # Each token's group's constant, by one lane gather from the lane tile of per_group that
    # holds the tile's groups (a broadcast of each group's column took one XLU permute a group).
    base = first // LANES * LANES
    lanes = jax.lax.broadcasted_iota(jnp.int32, (rows, width), 1) // group_size + (first - base)
    for index, (_, _, per_group) in enumerate(query_sets):
      at = 2 * index * size
      products = both[at : at + size] + both[at + size : at + 2 * size]
      scores = _own_group_rows(products, token_group, k, rows)
      source = per_group[:, base : base + LANES]
      if source.shape[1] < LANES:
        source = jnp.concatenate(
          [source, jnp.zeros((rows, LANES - source.shape[1]), source.dtype)], axis=1
        )
      parts[index].append(scores + jnp.take_along_axis(source, lanes, axis=1))
  return [jnp.concatenate(part, axis=1) if len(part) > 1 else part[0] for part in parts]


def pair_value_partials(
  probs: jax.Array,
  pairs: jax.Array,
  v_stats: jax.Array,
  query_rows: int,
  sublane_gathers: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """(codes' part float32 [groups / k x rows, D rows], minimums' part float32 [groups / k x
  rows, 1]) of p . V for p float32 [rows, n] (0 past the length), pairs bfloat16 [D, n] and the
  value statistics float32 [2 D / group, n], the scales' rows then the minimums' (one array, so
  that at 4 value groups one slab of 8 rows holds both; zero past the length: they may hold NaN
  there), k value groups an array of rows (`groups_per_block`). Both are linear in p: partials
  of several token ranges, each weighted by row, add up (`pair_value_update`)."""
  return value_partials_sharing_pairs([(probs, v_stats)], pairs, query_rows, sublane_gathers)[0]


def value_partials_sharing_pairs(
  prob_sets,
  pairs: jax.Array,
  query_rows: int,
  sublane_gathers: bool = True,
) -> list[tuple[jax.Array, jax.Array]]:
  """`pair_value_partials` of several sets of (probs, v_stats) against the same pairs, each
  set's two parts: one product for every set's P' rows, so that the pairs are pushed into the
  MXU once."""
  rows, _ = prob_sets[0][0].shape
  groups = prob_sets[0][1].shape[0] // 2
  k = groups_per_block(rows, query_rows, groups)
  arrays = [range(v * k, (v + 1) * k) for v in range(groups // k)]
  weighted, minimums = [], []
  for probs, v_stats in prob_sets:
    scale_rows, minimum_rows = (
      [
        _sublane_rows(v_stats, offset + array[0], k, probs.shape, sublane_gathers)
        for array in arrays
      ]
      for offset in (0, groups)
    )
    weighted.append(
      rounded_to_bfloat16(jnp.concatenate([probs * rows_of for rows_of in scale_rows]))
    )  # [groups / k x rows, n], float32 holding bfloat16 numbers
    # sum_t p[t] v_min[g, t] on the vector unit: as a product its weights would be v_min's
    # [tokens, groups] tiles, a push into the MXU per 128 tokens for a few columns.
    minimums.append(
      jnp.concatenate([(probs * rows_of).sum(axis=1, keepdims=True) for rows_of in minimum_rows])
    )
  products = jax.lax.dot_general(
    jnp.concatenate(weighted).astype(jnp.bfloat16),
    pairs,
    (((1,), (1,)), ((), ())),
    preferred_element_type=jnp.float32,
  )  # [sets x groups / k x rows, D rows]
  size = weighted[0].shape[0]
  return [
    # less the rows' 1s
    (products[index * size : (index + 1) * size] - set_weighted.sum(axis=1, keepdims=True), mins)
    for index, (set_weighted, mins) in enumerate(zip(weighted, minimums))
  ]


def pair_value_update(
  codes_part: jax.Array,
  minimums: jax.Array,
  matrix: jax.Array,
  group_size: int,
  query_rows: int,
  rows: int,
) -> jax.Array:
  """float32 [rows, D] in channel order from `pair_value_partials`' two parts and `pair_matrix`
  bfloat16 [D, D]: into channel order and times the factors by one product (by bfloat16
  halves, exact to 2^-16), each channel taking its value group's rows."""
  channels = matrix.shape[1]
  groups = channels // group_size
  k = groups_per_block(rows, query_rows, groups)
  in_channels = product_by_halves(codes_part, matrix, (0,)) + minimums
  group_of = jax.lax.broadcasted_iota(jnp.int32, (1, channels), 1) // group_size
  return _own_group_rows(in_channels, group_of, k, rows)
