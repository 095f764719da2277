"""The key minimums' share of every score, q . k_min per key group, computed by the folded Mosaic
GPU kernel itself: once per program, before its loop, as one warpgroup product per 64 key groups
(`key_bias_source="kernel"`).

Since v19 XLA computed it before the kernel (`key_bias`). Under Nsight Compute on the H200
(KERNEL_NOTES v34, KIVI-2 at 32k, batch 8, 8 KV heads) that product was a GEMM fusion of 41 us
reading 17 MB, beside the kernel's 165 us: a quarter of the kernel's time for a tenth of its
bytes, and a launch of its own. Here each program copies its split's minimums, [key groups, D]
bf16 (8 KB for a 1024-token split at group 32), into a tile of shared memory and multiplies them
by its queries on the tensor core:

  bias [groups, rows] = k_min [groups, D] . q^T [D, rows]

The queries are f32; wgmma takes bf16. Each query is split into two bf16 numbers, hi = bf16(q)
and lo = bf16(q - hi), stacked as 2 * rows columns of the product's N side: k_min is bf16, so
each product k_min * hi and k_min * lo is exact in the f32 accumulator, and hi + lo carries 16 of
q's 24 mantissa bits (relative error below 2^-16 per term, against 2^-8 for the bf16 Q' of the
key product itself). The two column halves are added after the product.

The result goes to a [split groups, rows] f32 buffer in shared memory, which every block of the
loop reads in place of the per-block key-bias ring slot XLA's bias arrived in. The split's key
groups must fit that buffer: `MAX_SPLIT_KEY_GROUPS` (8 KB at 8 rows), 8192 tokens per split at
group 32, i.e. about 270k tokens at the benchmark's 64 rows x heads.

Minimums past a row's length may be NaN (and the copy of a split's last chunk may reach past the
cache's end, which TMA fills with zeros): a product row is one key group's, so only groups no
valid token picks get a NaN or meaningless bias.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.softmax_reference_bounds import EXCHANGE, HEADROOM, UNDERFLOW_MARGIN
from pallas_kernels.splits import cdiv

KEY_BIAS_SOURCES = ("xla", "kernel")
DEFAULT_KEY_BIAS_SOURCE = "xla"
# The per-program bias buffer's limit: 256 groups x 8 rows x 4 bytes = 8 KB of shared memory.
MAX_SPLIT_KEY_GROUPS = 256
_TILE_ROWS = 8  # the rows of one tile of a swizzled bf16 wgmma operand in shared memory


def check_key_bias_source(key_bias_source: str) -> None:
  """ValueError naming the setting and its allowed values."""
  if key_bias_source not in KEY_BIAS_SOURCES:
    raise ValueError(
      f"key_bias_source={key_bias_source!r} is not supported; allowed: {KEY_BIAS_SOURCES}"
    )


def split_blocks_multiple(block_tokens: int, group_size: int) -> int:
  """Blocks per split must be a multiple of this: the copy of a split's minimums into the
  swizzled k_min tile starts on a whole 8-row tile (Mosaic GPU requires the copy's offset in
  global memory to be a known multiple of the tile), so a split holds a multiple of 8 key
  groups. The split planner then makes fewer, longer splits where it must (`plan_splits`)."""
  groups_per_block = block_tokens // group_size
  return _TILE_ROWS // math.gcd(_TILE_ROWS, groups_per_block)


def split_key_groups(split_tokens: int, group_size: int) -> int:
  """Key groups of one split (the bias buffer's rows before padding to whole chunks)."""
  return cdiv(split_tokens, group_size)


def bias_chunks(split_groups: int, chunk_groups: int) -> int:
  """Products (and copies of k_min) per program: one per `chunk_groups` key groups."""
  return cdiv(split_groups, chunk_groups)


def chunk_copy_groups(split_groups: int, chunk_groups: int, chunk: int) -> int:
  """Key groups the copy of chunk `chunk` brings: the rest of the split, up to a whole chunk
  (`split_groups` is a multiple of 8, `split_blocks_multiple`, and so is each copy)."""
  return min(chunk_groups, split_groups - chunk * chunk_groups)


def padded_key_groups(key_groups: int, copy_groups: int) -> int:
  """Key groups k_min (and k_scale) must have, zeros appended, for the prologue's copies: at
  least `copy_groups` (the first chunk's copy, which may reach past a short cache's end), in
  whole 8-row tiles of the swizzled layout they are copied into (TMA requires it: caches of 12,
  15 and 22 key groups failed to compile on the H200, KERNEL_NOTES v39)."""
  rows = max(copy_groups, key_groups)
  return cdiv(rows, _TILE_ROWS) * _TILE_ROWS


def statistics_padding(
  split_tokens: int, group_size: int, chunk_groups: int, key_groups: int
) -> int:
  """Key groups of zeros a kernel appends to k_min (and k_scale) of `key_groups` for its
  prologue's copies of `chunk_groups` each: k_min must hold the largest TMA box, the first
  chunk's (`chunk_copy_groups`, which may reach past a short cache's end), in whole tiles
  (`padded_key_groups`)."""
  first_copy = chunk_copy_groups(split_key_groups(split_tokens, group_size), chunk_groups, 0)
  return padded_key_groups(key_groups, first_copy) - key_groups


def unsupported_reason(split_tokens: int, group_size: int) -> str | None:
  """Why the kernel cannot compute the bias of splits this long (None if it can)."""
  groups = split_key_groups(split_tokens, group_size)
  if groups > MAX_SPLIT_KEY_GROUPS:
    return (
      f"key_bias_source='kernel' with {split_tokens}-token splits: {groups} key groups per split, "
      f"more than the {MAX_SPLIT_KEY_GROUPS} its shared-memory bias buffer holds (more splits, "
      f"num_splits, shorten them)"
    )
  return None


def query_halves(queries: jax.Array, *, bounds: bool = False) -> jax.Array:
  """f32 [B, H, rows, D] -> bf16 [B, H, 2 * rows, D]: hi = q with its low 16 bits cleared (a bf16
  number, q truncated), then lo = bf16(q - hi) (|lo| < 2^-7 |q|, so hi + lo is within 2^-16 of
  q); with `bounds` [B, H, 4 * rows, D], then the halves of max(q, 0) (those of q where q > 0,
  else 0).

  Not hi = bf16(q), lo = bf16(q - f32(hi)): XLA's GPU compiler drops a f32 -> bf16 -> f32 round
  trip as excess precision, which made lo = bf16(q - q) = 0 and the bias bf16(q) . k_min
  (KERNEL_NOTES v39: the H200's lse 0.023 off XLA's f32 bias; the compiled HLO for an H100
  showed subtract(q, q)). Clearing bits is no conversion, so nothing can drop it."""
  queries = queries.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(queries, jnp.uint32)
  high_f32 = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)
  high = high_f32.astype(jnp.bfloat16)  # exact: the cleared bits are bf16's missing ones
  low = (queries - high_f32).astype(jnp.bfloat16)
  halves = [high, low]
  if bounds:
    positive = queries > 0
    halves += [jnp.where(positive, high, 0), jnp.where(positive, low, 0)]
  return jnp.concatenate(halves, axis=2)


def queries_with_halves(
  code_queries: jax.Array,  # [B, H, D, rows]: the key product's queries, D in operand positions
  queries: jax.Array,  # f32 [B, H, rows, D]: the same queries, D in channel order
  *,
  bounds: bool,
) -> jax.Array:
  """bf16 [B, H, 2 or 4 * rows + rows, D]: the `query_halves`, then the key product's queries
  transposed and rounded to bf16 (as the kernel rounds them). One array, so that XLA computes
  the kernel's queries in one fusion: as two arrays (the f32 code queries and the halves) they
  took two (compiled for an H100 without a GPU, KERNEL_NOTES v38), a launch each in the decode
  loop. The kernel copies the halves (whole 8-row tiles of their swizzled layout, as Mosaic GPU
  requires of the copy) and the queries apart, and reads the queries transposed."""
  transposed = jnp.swapaxes(code_queries, 2, 3).astype(jnp.bfloat16)  # [B, H, rows, D]
  return jnp.concatenate([query_halves(queries, bounds=bounds), transposed], axis=2)


def copy_queries_with_halves(queries_gmem, halves_smem, queries_smem, barrier) -> None:
  """Starts the two copies of one (row, KV head)'s `queries_with_halves` array (`queries_gmem`,
  [2 or 4 * rows + rows, D]): the halves into `halves_smem` (whole 8-row tiles of their swizzled
  layout, as Mosaic GPU requires of the copy) and the key product's queries into `queries_smem`,
  both arriving on `barrier`."""
  halves_rows = halves_smem.shape[0]
  plgpu.copy_gmem_to_smem(queries_gmem.at[pl.ds(0, halves_rows)], halves_smem, barrier)
  rows = queries_gmem.shape[0] - halves_rows
  plgpu.copy_gmem_to_smem(queries_gmem.at[pl.ds(halves_rows, rows)], queries_smem, barrier)


def copies_per_chunk(bounds: bool) -> int:
  """TMA copies (and barriers) per chunk: k_min, and with the bounds k_scale."""
  return 2 if bounds else 1


def split_key_statistics(
  k_min_gmem,  # bf16 [B, H, T / group_size, D]
  k_scale_gmem,  # bf16 [B, H, T / group_size, D]; read only with `references_smem`
  query_halves_smem,  # bf16 [2 or 4 * rows, D] (`query_halves`), already copied
  tile_smem,  # bf16 [chunk_groups, D], a wgmma operand tile free until the loop
  split_bias_smem,  # f32 [chunks * chunk_groups, rows]
  references_smem,  # f32 [rows]: the split's softmax references, or None (no bounds)
  chunk_barriers,  # `copies_per_chunk` per chunk
  *,
  row,
  head,
  first_group,  # the split's first key group
  groups_used,  # key groups holding a token of the split below the row's length (traced)
  split_groups: int,
  bits: int,
  max_over_groups=None,
) -> None:
  """Fills `split_bias_smem` with q . k_min for the split's key groups, chunk by chunk: a copy,
  one product on the tensor core, the halves added, a store.

  With `references_smem`, also the split's softmax references, as `softmax_reference_bounds`
  computes them before the kernel for row_max="bound" (the same bounds, valid groups, headroom
  and criterion, but per row: EXCHANGE in each row the bounds cannot serve, where XLA's puts it
  in every row of such a split; the kernels take the exact path if any row has it,
  `any_row_exchanges`): per chunk a second copy,
  k_scale into the same tile, and one product against [hi, lo, hi+, lo+] (the halves of q and of
  max(q, 0)), so that sum_c max(q_c, 0) k_scale[g, c] is a product and sum_c min(q_c, 0) k_scale
  [g, c] the difference of two; each bound's max over the valid groups, a reduction across the
  four warps once per program. The bounds carry 2^-16-relative rounding beside HEADROOM's 32
  bits: they decide how far p may sit from 1, not the softmax.

  Every chunk runs (the bounds need each chunk's max; a chunk past the row's length only reads).
  Ends with `commit_smem`: the stores visible to every warp and the tile free for the loop.
  `max_over_groups`: the max over axis 0 of a wgmma-layout array (default jnp's, through Pallas's
  program-wide scratch; `warpgroup_reductions.reduce_rows` with several warpgroups a program)."""
  if max_over_groups is None:
    max_over_groups = functools.partial(jnp.max, axis=0)
  chunk_groups = tile_smem.shape[0]
  rows = split_bias_smem.shape[1]
  bounds = references_smem is not None
  copies = copies_per_chunk(bounds)
  levels = float(2**bits - 1)
  top = floor = None

  def copy_chunk(source_gmem, c, k):
    copied = chunk_copy_groups(split_groups, chunk_groups, c)
    barrier = chunk_barriers.at[c * copies + k]
    plgpu.copy_gmem_to_smem(
      source_gmem.at[
        row, head, pl.ds(pl.multiple_of(first_group + c * chunk_groups, _TILE_ROWS), copied)
      ],
      tile_smem.at[pl.ds(0, copied)],
      barrier,
    )
    plgpu.barrier_wait(barrier)

  def product(columns):
    def run(acc_ref):
      plgpu.wgmma(acc_ref, tile_smem, query_halves_smem.at[pl.ds(0, columns)].T)
      return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC((chunk_groups, columns), jnp.float32))

  def column_pair(products, pair):
    return (
      products[:, 2 * pair * rows : (2 * pair + 1) * rows]
      + products[:, (2 * pair + 1) * rows : (2 * pair + 2) * rows]
    )

  for c in range(bias_chunks(split_groups, chunk_groups)):
    copy_chunk(k_min_gmem, c, 0)
    bias = column_pair(product(2 * rows), 0)
    split_bias_smem[pl.ds(c * chunk_groups, chunk_groups), :] = bias
    # Every warp's share of the product has read the tile before the next copy overwrites it.
    plgpu.commit_smem()
    if not bounds:
      continue
    copy_chunk(k_scale_gmem, c, 1)
    products = product(4 * rows)
    plgpu.commit_smem()
    with_scale, with_positive = column_pair(products, 0), column_pair(products, 1)
    group = c * chunk_groups + plgpu.broadcasted_iota(
      jnp.int32, (chunk_groups, rows), 0, layout=plgpu.Layout.WGMMA
    )
    valid = group < groups_used
    negative = levels * (with_scale - with_positive)
    upper = max_over_groups(jnp.where(valid, levels * with_positive + bias, -jnp.inf))
    lower = max_over_groups(jnp.where(valid, negative + bias, -jnp.inf))
    top = upper if top is None else jnp.maximum(top, upper)
    floor = lower if floor is None else jnp.maximum(floor, lower)
  if bounds:
    # NaN (an empty split's -inf - -inf, NaN statistics) and inf compare False: exact path.
    served = top - floor <= HEADROOM + UNDERFLOW_MARGIN
    references_smem[...] = jnp.where(served, top - HEADROOM, EXCHANGE)
    plgpu.commit_smem()


def any_row_exchanges(references_smem):
  """Whether any row of a split's references (f32 [rows] in shared memory) is EXCHANGE: a
  scalar every thread computes alike, so that the whole warpgroup takes one branch."""
  rows = references_smem.shape[0]
  exchange = references_smem[0] == EXCHANGE
  for r in range(1, rows):
    exchange = exchange | (references_smem[r] == EXCHANGE)
  return exchange
