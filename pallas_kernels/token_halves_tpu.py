"""2-bit codes at head_dim 64 on a TPU as whole vector registers: a block's two token halves
side by side on sublanes.

At 2 bits and 64 channels a token's codes are W = 4 words, so the quantized kernel's [W, block]
code tiles fill half of each (8, 128) vector register, and every field it unpacks ([4, block]
pieces stacked into [64, block]) works on half-empty registers and is moved into place
sublane by sublane: KIVI-2 issued 2933 bundles a 4096-token step at head_dim 64 against KIVI-4's
1978 (whose 8 words fill the registers; v5e, static counts, KERNEL_NOTES v55). Here the block's
second half of tokens goes onto sublanes 4-7 ([8, block / 2]: row h * 4 + w holds word w of
token h * block / 2 + t'), so each field is whole registers and the fields stack into
[(f, h, w) = 128, block / 2] rows: channel 4 f + w of token h * block / 2 + t'. The products
follow the rows:

  scores  per 128-token tile of the halves, [q of half 0 (zero on half 1's rows) times each of
          the tile's key groups' scales ; the same for half 1] . the tile's codes: the key
          scales folded into the queries (as at 128 channels), each token taking its half's and
          group's rows; the scales put on the rows' lanes by a 0/1 product (exact);
  values  [p of half 0 ; p of half 1] [2 rows, block/2] . values^T -> [2 rows, 128], channel
          4 f + w the sum of row block 0's column (f, 0, w) and row block 1's (f, 1, w); the
          value statistics reach the rows by sublane broadcasts of their halves.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.own_group_rows import own_group_rows

WORDS = 4  # the codes' words a token at 2 bits and head_dim 64: half a register's sublanes


def applies(words: int, block: int, group_size: int) -> bool:
  """Whether a block of `block` tokens with `words` words a token takes this layout: half-full
  registers (4 words), halves of whole lane tiles holding whole key groups."""
  return words == WORDS and 128 % group_size == 0 and block % 256 == 0


def halves_on_sublanes(rows: jax.Array) -> jax.Array:
  """[n, block] -> [2 n, block / 2]: the second half of the tokens below the first."""
  half = rows.shape[1] // 2
  return jnp.concatenate([rows[:, :half], rows[:, half:]], axis=0)


def _half(shape, axis: int) -> jax.Array:
  """int32 of `shape`: h of each position (f, h, w) along `axis`."""
  return jax.lax.broadcasted_iota(jnp.int32, shape, axis) // WORDS % 2


def _channel(shape, axis: int) -> jax.Array:
  """int32 of `shape`: the channel 4 f + w of each position (f, h, w) along `axis`."""
  position = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
  return position // (2 * WORDS) * WORDS + position % WORDS


def _exact_product(a, b, contracting):
  """a . b where one operand is 0/1: exact in one pass for 16-bit operands, HIGHEST for f32."""
  precision = jax.lax.Precision.HIGHEST if jnp.float32 in (a.dtype, b.dtype) else None
  return jax.lax.dot_general(
    a, b, (contracting, ((), ())), preferred_element_type=jnp.float32, precision=precision
  )


def scale_folded_key_scores(
  queries: jax.Array, codes: jax.Array, k_scale: jax.Array, group_size: int
) -> jax.Array:
  """float32 [rows, block]: sum_c q[c] k_scale[c, g(t)] codes[c, t] for queries [rows, 64], the
  codes' rows [128, block / 2] (float32, exact in the queries' dtype) and the block's scales
  [64, G]: the scales folded into the queries per key group. Per 128-token tile of the halves,
  the queries of each half (zero on the other half's rows) times each of the tile's groups'
  scales, stacked ([2 x groups in tile x rows, 128]), times the tile's codes; each token takes
  its half's and group's rows. Against the scales spread onto the rows by two 0/1 products and
  multiplied into the codes: KIVI-2 2154 -> 2035 bundles a 4096-token step (v5e, static
  counts, KERNEL_NOTES v56), and the keys are no longer rounded to bfloat16 (q x scale is)."""
  rows = queries.shape[0]
  channels, groups = k_scale.shape
  lanes = (rows, 2 * channels)
  at_rows = jnp.take_along_axis(queries.astype(jnp.float32), _channel(lanes, 1), axis=1)
  half = _half(lanes, 1)
  by_half = [jnp.where(half == h, at_rows, 0.0) for h in range(2)]
  # The scales on the rows' lanes, [G, 128]: a 0/1 product placing channel 4 f + w on lane
  # (f, h, w) (exact: one nonzero term).
  place = (
    _channel((2 * channels, channels), 0)
    == jax.lax.broadcasted_iota(jnp.int32, (2 * channels, channels), 1)
  ).astype(k_scale.dtype)
  scale_lanes = _exact_product(k_scale, place, ((0,), (1,)))
  compute_dtype = queries.dtype
  codes = codes.astype(compute_dtype)
  half_block = codes.shape[1]
  half_groups = groups // 2
  tile = 128
  per_tile = tile // group_size
  halves = ([], [])
  for start in range(0, half_block, tile):
    first = start // group_size
    scaled = jnp.concatenate(
      [
        by_half[h] * scale_lanes[h * half_groups + g : h * half_groups + g + 1]
        for h in range(2)
        for g in range(first, first + per_tile)
      ]
    ).astype(compute_dtype)  # [2 x groups in tile x rows, 128]
    products = jax.lax.dot_general(
      scaled,
      codes[:, start : start + tile],
      (((1,), (0,)), ((), ())),
      preferred_element_type=jnp.float32,
    )
    for h in range(2):
      halves[h].append(own_group_rows(products, rows, group_size, h * per_tile, per_tile))
  return jnp.concatenate(halves[0] + halves[1], axis=1)


def value_statistics_in_rows(stats: jax.Array, group_size: int, fields: int) -> jax.Array:
  """float32 [4 fields, block / 2]: per-token value statistics [D / group, block] repeated onto
  the rows (f, h, w) of channel 4 f + w (its value group (4 f) // group: a group holds whole
  fields' channels, group >= 8). A token mask [1, block] with group = 4 fields gives the
  mask's rows."""
  half = stats.shape[1] // 2
  stats = stats.astype(jnp.float32)
  by_group = [
    jnp.concatenate(
      [
        jnp.broadcast_to(stats[g : g + 1, :half], (WORDS, half)),
        jnp.broadcast_to(stats[g : g + 1, half:], (WORDS, half)),
      ]
    )
    for g in range(stats.shape[0])
  ]  # [8 (h, w), block / 2] each
  return jnp.concatenate([by_group[WORDS * f // group_size] for f in range(fields)])


def value_update(probs: jax.Array, values: jax.Array) -> jax.Array:
  """float32 [rows, 64]: p [rows, block] . V for the values' rows [128, block / 2] (in the
  probabilities' dtype)."""
  rows, block = probs.shape
  half = block // 2
  stacked = jnp.concatenate([probs[:, :half], probs[:, half:]])  # [2 rows, block / 2]
  both = jax.lax.dot_general(
    stacked, values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
  )  # [2 rows, 128]: lanes (f, h', w)
  channels = values.shape[0] // 2
  channel = jax.lax.broadcasted_iota(jnp.int32, (rows, channels), 1)
  lane = channel // WORDS * 2 * WORDS + channel % WORDS  # (f, 0, w) of channel 4 f + w
  first = jnp.take_along_axis(both[:rows], lane, axis=1)
  second = jnp.take_along_axis(both[rows:], lane + WORDS, axis=1)
  return first + second
