"""TPU fused dequantize-attention for decoding over a KIVI / GEAR quantized segment (Mosaic).

The grid of `decode_attention_tpu` with the KV heads innermost: (batch, splits, blocks,
kv_heads), lengths scalar-prefetched, online softmax in VMEM scratch of every head. The heads
are innermost so that what the heads share per block is fetched once for all of them: the
value statistics of one group per token, which XLA stores with the heads on sublanes
(`value_stats_shared`, since v55). Since v58 the cache's arrays stay in HBM and the kernel
fetches each step's blocks itself, double-buffered, one schedule for all arrays
(`token_block_fetches_tpu`): nothing past a row's length is fetched or computed. As BlockSpecs
with index maps clamped to the row's last valid block (still the way where the blocks do not
tile the segment), Mosaic's pipeline spent about 470 bundles of scalar work a step on them.

**Tokens on lanes.** A TPU tiles the last two dimensions of every array into (8, 128) tiles, in
HBM as in VMEM, so an array whose last dimension is small is either padded to 128 lanes or laid
out with another dimension last. The cache stores per token a few packed words (uint32
[B, H, T, W], W = D bits / 32: 8 at 2 bits and head_dim 128) and a few value statistics
([B, H, T, D / group]: 4). XLA gives such arguments the layout with T last, no padding; a
kernel that took them as stored ([block, W] tiles) made XLA copy each into a row-major layout
padded to 128 lanes at every call: 16x the codes' bytes and 32x the statistics' (4.5 GB moved
for the 201 MB of a KIVI-2 call at 32k, compiled for a TPU v5e without one: KERNEL_NOTES v49),
and ran its vector work on 8 of 128 lanes. So this kernel takes the codes as [W, T] and the
value statistics as [D / group, T] (`jnp.swapaxes` in the wrapper: the layout XLA already
chose, nothing moves), and works on [channels, tokens] tiles:

  keys^T   [D, block] = codes^T * k_scale^T + k_min^T: the bit fields of the [W, block] words
           stacked along sublanes are the channels in order (`bit_packing`'s planar layout:
           field f of word w is channel f W + w); each key group's scale and minimum row
           [block / group, D] is spread over its tokens by one product with a 0/1 matrix on the
           MXU (exact), after the groups past the row's length are zeroed (they may hold NaN);
  scores   [rows, block] = q [rows, D] . keys^T;
  values^T [D, block] = codes^T * v_scale^T + v_min^T, each value group's statistics row
           repeated over its channels (a sublane broadcast);
  out      [rows, D] += p [rows, block] . values (contracting the token lanes).

Since v56: at head_dim 128 and more the key scales are folded into the queries per key group
instead (`_scale_folded_scores`); at 2 bits and head_dim 64, where a token's 4 words fill half
a register, the block's two token halves are stacked on sublanes so that every field is whole
registers (`token_halves_tpu`).

Since v57, with 2- or 4-bit codes whose words fill whole registers (2 bits from head_dim 128, 4
bits from 64) and bfloat16 statistics (`code_pairs_apply`), no code is unpacked to float32 or
dequantized: the packed words are masked into bfloat16 numbers 1 + code * 2^(p - 7), two a word
(`bfloat16_code_pairs`), which are the MXU operands of both products; the key scales are folded
into the queries, the value scales into the probabilities, and the 1s cancelled exactly
(`code_pair_products_tpu`). The softmax
runs in chunks of CHUNK_TOKENS, each against its own maximum, so that one chunk's value product
need not wait for the block's last key product. The query rows' padding holds copies of the
query rows, so that a register of 8 rows serves two key or value groups at 4 query heads a KV
head. Since v58 KIVI's 2-bit codes at head_dim 64 take pairs too, of the block's token halves
stacked on sublanes, as a virtual head of 128 channels whose halves' products are apart
(`code_pair_halves_tpu`); GEAR's there keep the unpacked token halves. Since v63 (KIVI's pairs)
each chunk's key scores come from that chunk's words read where they are needed
(`_attend_pairs_by_chunks`), the two token halves' rows share one product with their pairs, and
the halves' key statistics are not embedded into virtual channels.

The key statistics stay [B, H, T / group, D] at head_dim 128 (head_dim on lanes); below 128
channels XLA lays them out with the groups last too, and the kernel takes them as
[B, H, D, T / group] (`tokens_on_lanes`). Blocks are a multiple of 128 tokens holding whole
tiles of key-group rows (8 of 32-bit values, 16 of 16-bit ones) or, with the groups on lanes,
128 key groups and, with GEAR's low-rank factors, 128 GEAR blocks (`block_tokens_for`); or the
whole segment when it is shorter. A last block past the segment's end (Mosaic's pipeline
fetches those: `token_block_fetches_tpu`) reads padding, which the masks above keep out.

GEAR's low-rank terms are the kernel's own (`_GearLowRankBlock`, since v51): per block and
rank, each GEAR block's q . k_b row spread over its tokens by a 0/1 product and weighted by k_a
on the token lanes, added to the scores; on the value side p . v_a
summed per GEAR block by the transposed 0/1 product and multiplied into v_b, added to the
accumulator, which the online softmax rescales with the rest. Done by XLA around the kernel,
spreading each GEAR block's row over its 64 tokens was a [.., J, 64] -> [.., T] relayout
(64 of 128 lanes) and a dense [B, H, R, T] bias: about 0.2 GB copied a step in a decode loop
at 32k tokens (KERNEL_NOTES v50). GEAR's outliers are the kernel's too (since v56): per GEAR
block, one-hot products gather q at the key outliers' channels and spread them over their
tokens, and gather p at the value outliers' tokens and spread them over their channels
(`gear_outlier_terms_tpu`), the outliers read as stored ([J_blk, s] rows per block). Done by
XLA around the kernel (a dense [B, H, R, T] score bias in, the scores out, the value terms
scattered after the merge), XLA's own cost model put them at 15-31 M cycles a decode step at 32k
against the kernel's 3.5 M (v55), and their scatter crashed v6e's SparseCore compiler at 32k.
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import (
  _compat,
  bfloat16_code_pairs,
  code_pair_halves_tpu,
  code_pair_products_tpu,
  token_block_fetches_tpu,
  token_halves_tpu,
)
from pallas_kernels.bfloat16_halves import product_by_halves
from pallas_kernels.bit_packing import check_bits
from pallas_kernels.decode_attention_tpu import (
  LANES,
  SUBLANES,
  finalize,
  sublane_tile_rows,
  tile_rows,
  tokens_on_lanes,
  valid_token_masks,
)
from pallas_kernels.gear_outlier_terms_tpu import GearOutlierBlock, outlier_slots_read
from pallas_kernels.launch_settings import check_launch_settings
from pallas_kernels.own_group_rows import own_group_rows
from pallas_kernels.quantized_decode_attention_reference import check_quantized_inputs
from pallas_kernels.splits import SplitPlan, merge_split_partials, pad_query_group, plan_splits

# The kernel issues far longer than its reads take (static bundle counts of libtpu's schedule,
# `benchmarks/tpu_static_cost.py`, KERNEL_NOTES v55: KIVI-2, head_dim 128, 32k tokens, v5e:
# 3.85 M cycles a call at 512 tokens a block against 0.37 M cycles of HBM reads), and a grid
# step costs about 600 bundles besides its block's work: 4096-token blocks halve the cycles.
DEFAULT_BLOCK_TOKENS = 4096
# With the codes as bfloat16 pairs (`code_pairs_apply`) a 4096-token step is much of that
# overhead: KIVI-2 at head_dim 128, 32k tokens, v5e, 1698 bundles a 4096-token step (0.87 M
# cycles a call), 2734 an 8192-token one (0.70 M); 16384-token steps, counted before the last
# changes, 0.62 M against 0.69 M at 8192, for twice the VMEM (KERNEL_NOTES v57).
CODE_PAIR_BLOCK_TOKENS = 8192
# At 2 bits and head_dim 64 (the block's token halves on sublanes, `token_halves_tpu`, and
# KIVI's as pairs, `code_pair_halves_tpu`): KIVI-2, 32k tokens, v5e, 0.81 M cycles a call at
# 4096-token blocks, 0.63 M at 8192, 0.57 M at 16384 (twice the VMEM); unpacked (GEAR's path),
# 0.87 M at 4096, 0.81 M at 8192, 0.87 M at 16384 (KERNEL_NOTES v58).
TOKEN_HALVES_BLOCK_TOKENS = 8192


def sublane_gathers_lower() -> bool:
  """Whether Mosaic lowers a sublane gather (`jnp.take_along_axis` on axis 0) for the TPU of
  the default device (`jax.default_device`, else the first device): a v5e or newer; for a v4
  it refuses ("failed to legalize tpu.dynamic_gather", compiled for one without it, KERNEL_NOTES
  v58). True without a TPU (interpret mode). A compile for a TPU that is not there (a
  compile-only topology's device set as the default, as `tpu_compile_check` does) gets its
  target's choice."""
  device = jax.config.jax_default_device
  if device is None or isinstance(device, str):
    device = jax.devices(device)[0] if device else jax.devices()[0]
  if device.platform != "tpu":
    return True
  return tpu_generation(device.device_kind) >= 5


def tpu_generation(device_kind: str) -> int:
  """The generation of a TPU by its device kind ("TPU v4", "TPU v5 lite", "TPU v6e", ...); a
  kind naming none counts as the newest."""
  match = re.search(r"v(\d+)", device_kind)
  return int(match.group(1)) if match else 1_000


def code_pairs_apply(bits: int, head_dim: int, stats_dtype) -> bool:
  """Whether the kernel makes its matrix operands from the codes as bfloat16 pairs
  (`bfloat16_code_pairs`, `code_pair_products_tpu`): 2- and 4-bit codes with bfloat16
  statistics (the compute dtype) whose words fill whole registers, 8 words a token or more (2
  bits from head_dim 128, 4 bits from 64). At 2 bits and head_dim 64 (4 words, half a
  register) pairs of half-full registers took as long as the unpacked token halves
  (`token_halves_tpu`: KIVI-2 0.92 against 0.90 M cycles a call at 8192-token blocks, GEAR-2
  2.46 against 2.29 M; v5e, static counts, KERNEL_NOTES v57); KIVI's codes there take the
  stacked token halves' pairs instead (`code_pair_halves_tpu.applies`, since v58). Otherwise
  the kernel unpacks the codes to float32 and dequantizes them."""
  return (
    bits in bfloat16_code_pairs.PAIR_BITS
    and jnp.dtype(stats_dtype) == jnp.bfloat16
    and head_dim * bits // 32 >= 8
  )


def unsupported_reason(
  queries, k_codes, k_scale, v_scale, *, bits, group_size, lowrank, outliers, block
) -> str | None:
  del k_codes, v_scale, bits, lowrank, outliers, block
  head_dim = queries.shape[3]
  if head_dim % 64 != 0:
    return f"head_dim={head_dim} (must be a multiple of 64)"
  if group_size % 8 != 0:
    return f"group_size={group_size} (must be a multiple of 8: value groups are sublane rows)"
  if k_scale.dtype not in (jnp.float32, jnp.bfloat16):
    return f"scale dtype {k_scale.dtype} (allowed: float32, bfloat16)"
  return None


def segment_layouts(head_dim: int) -> dict[str, tuple[int, ...]]:
  """The layout (major to minor, of the stored [B, H, rows, last] arrays) in which this kernel
  reads each segment array in place: the tokens minor for the codes and the value statistics
  (their `jnp.swapaxes` is then a bitcast), and for the key statistics the channels minor at
  128 channels or more, the groups minor below (`tokens_on_lanes`). A cache that writes its
  segment inside a decode loop pins these (`jax.experimental.layout.with_layout_constraint`):
  left to itself, XLA laid out the loop's copy of the key statistics heads-minor (for the
  [B, H, 4, D] rows a 128-token block appends) and copied them into this layout at every step
  (KERNEL_NOTES v50)."""
  tokens_minor = (0, 1, 3, 2)
  key_stats = tokens_minor if tokens_on_lanes(head_dim) else (0, 1, 2, 3)
  return dict(
    k_codes=tokens_minor,
    k_scale=key_stats,
    k_min=key_stats,
    v_codes=tokens_minor,
    v_scale=tokens_minor,
    v_min=tokens_minor,
  )


def segment_token_granule(
  head_dim: int, group_size: int, stats_dtype, outlier_block: int | None = None
) -> int:
  """Tokens a segment's capacity is best a multiple of for this kernel: at 128 channels or more,
  whole tiles of key-statistic rows (8 groups of 32-bit statistics, 16 of 16-bit ones; 512
  tokens at group 32 in bfloat16). Then a capacity that is not a multiple of the block still
  ends in a short block the kernel copies itself (`token_block_fetches_tpu.last_block_extent`),
  and a TPU's default layout of the stored [B, H, groups, D] statistics is the row-major one the
  kernel reads: for a number of groups not a multiple of 8 XLA lays them out heads-second-minor,
  and a jitted decode step taking the cache in that layout copied both statistics at every call
  (2 x 16.7 MB at 32640 tokens, batch 8, 8 KV heads: KERNEL_NOTES v64). Below 128 channels the
  groups lie on lanes (128 a tile, 4096 tokens at group 32: too coarse to round a capacity to)
  and the default layout is the kernel's whatever their number: 1. With GEAR's outliers
  (`outlier_block` tokens a GEAR block), also whole 8-row tiles of their [B, H, J, s] rows: at
  head_dim 64 and 32k tokens (J = 511) a jitted decode step copied all four at every call (4 x
  8.4 MB, v65); 520 and 328 rows (J a multiple of 8, not 16) were read in place."""
  granule = 1
  if not tokens_on_lanes(head_dim):
    granule = group_size * sublane_tile_rows(jnp.dtype(stats_dtype).itemsize)
  if outlier_block:
    granule = math.lcm(granule, outlier_block * SUBLANES)
  return granule


def block_tokens_for(
  tokens: int,
  group_size: int,
  stats_dtype,
  requested: int | None,
  head_dim: int = 128,
  *,
  gear_block: int | None = None,
  lowrank: bool = False,
  outlier_itemsize: int | None = None,
  bits: int | None = None,
) -> int:
  """Tokens per kernel block: `requested` (default DEFAULT_BLOCK_TOKENS, CODE_PAIR_BLOCK_TOKENS
  where `code_pairs_apply` to `bits`, TOKEN_HALVES_BLOCK_TOKENS for codes of 4 words a token)
  rounded up to a
  multiple of 128 (the codes' lanes) whose key groups fill whole tiles of the key statistics
  (8 rows of 32-bit values or 16 of 16-bit ones; 128 lanes where `tokens_on_lanes`) and, in a
  GEAR segment, whole GEAR blocks of `gear_block`: with its low-rank factors 128 of them where
  `tokens_on_lanes` (the B factors' lanes: 8192 tokens at GEAR blocks of 64, whatever is
  requested), with its outliers (the smallest of their arrays' items `outlier_itemsize` bytes)
  whole tiles of their [GEAR blocks, s] rows; or the whole segment when that is no longer."""
  if tokens_on_lanes(head_dim):
    unit = LANES * group_size
  else:
    unit = math.lcm(LANES, group_size * sublane_tile_rows(jnp.dtype(stats_dtype).itemsize))
  if gear_block is not None:
    blocks_per_unit = LANES if lowrank and tokens_on_lanes(head_dim) else 1
    if outlier_itemsize is not None:
      blocks_per_unit = math.lcm(blocks_per_unit, sublane_tile_rows(outlier_itemsize))
    unit = math.lcm(unit, gear_block * blocks_per_unit)
  if requested is None:
    requested = DEFAULT_BLOCK_TOKENS
    if bits is not None and code_pairs_apply(bits, head_dim, stats_dtype):
      requested = CODE_PAIR_BLOCK_TOKENS
    elif bits is not None and head_dim * bits // 32 == token_halves_tpu.WORDS:
      requested = TOKEN_HALVES_BLOCK_TOKENS
  block_tokens = -(-max(requested, 1) // unit) * unit
  return tokens if tokens <= block_tokens else block_tokens


def _stacked_fields(words: jax.Array, bits: int) -> jax.Array:
  """uint32 [W, block] packed words -> float32 [W * 32 / bits, block] codes, channels in order."""
  mask = jnp.uint32(2**bits - 1)
  fields = [(words >> jnp.uint32(bits * field)) & mask for field in range(32 // bits)]
  return jnp.concatenate(fields, axis=0).astype(jnp.int32).astype(jnp.float32)


def _token_group_indicator(groups: int, group_size: int, block: int, dtype) -> jax.Array:
  """[groups, block] 0/1: 1 where token t lies in group t // group_size. A product with it
  moves a group's row onto its tokens (exact: one nonzero term per output) or sums its tokens."""
  token_group = jax.lax.broadcasted_iota(jnp.int32, (groups, block), 1) // group_size
  return (token_group == jax.lax.broadcasted_iota(jnp.int32, (groups, block), 0)).astype(dtype)


def _spread_over_tokens(stats: jax.Array, group_size: int, block: int):
  """Per-key-group rows [n, block / group] -> float32 [n, block]: column t holds group
  t // group's (`_token_group_indicator`)."""
  return jax.lax.dot_general(
    stats,
    _token_group_indicator(stats.shape[1], group_size, block, stats.dtype),
    (((1,), (0,)), ((), ())),
    preferred_element_type=jnp.float32,
    # A 16-bit row times 1 is exact in one pass; 32-bit rows need the f32 passes (Mosaic
    # refuses that precision for bf16 operands).
    precision=jax.lax.Precision.HIGHEST if stats.dtype == jnp.float32 else None,
  )


def _key_minimum_scores(queries, k_min, group_size: int, block: int, groups_axis: int):
  """float32 [rows, block]: q . k_min of each token's key group, computed per group ([rows,
  groups]) and spread over the groups' tokens. Spreading the minimums over the tokens before
  the product ([D, groups] x [groups, block] on the MXU and an add per key element) cost a
  4096-token step 3650 bundles against 3013 this way (KIVI-2, head_dim 128, v5e, static
  counts: KERNEL_NOTES v55). With 16-bit queries the per-group sums are spread as two bf16
  halves in one pass (`bfloat16_halves`; an f32 operand would take the MXU's multi-pass
  precision, which cost more than it saved: 3813 bundles); f32 queries keep that precision."""
  contracting = 1 if groups_axis == 0 else 0  # k_min [groups, D] or [D, groups]
  per_group = jax.lax.dot_general(
    queries, k_min, (((1,), (contracting,)), ((), ())), preferred_element_type=jnp.float32
  )  # [rows, groups]
  if queries.dtype == jnp.float32:
    return _spread_over_tokens(per_group, group_size, block)
  indicator = _token_group_indicator(per_group.shape[1], group_size, block, jnp.bfloat16)
  return product_by_halves(per_group, indicator, (0,))  # one nonzero term per output


def _scale_folded_scores(queries, codes, k_scale, group_size: int):
  """float32 [rows, block]: sum_c q[c] k_scale[g(t), c] codes[c, t], the key scales folded
  into the queries per key group instead of spread over the codes: per lane tile of the block,
  the queries times each of the tile's groups' scales stacked ([groups in tile x rows, D]) times
  the tile's codes, each token taking its own group's rows. codes float32 [D, block] (exact in
  the queries' dtype); k_scale [groups, D].

  Against the scales spread over the tokens by a 0/1 product and multiplied into the codes
  ([D, block] on the MXU and the VPU, and a chain of dependent MXU pushes): KIVI-2 at head_dim
  128, 4096-token steps, 3013 -> 2658 bundles, KIVI-4 3007 -> 2642 (v5e, static counts,
  KERNEL_NOTES v56). Below 128 channels, where the scales come [D, groups] and would need a
  transpose, KIVI-2 went 2933 -> 3084: there the kernel spreads them."""
  rows = queries.shape[0]
  block = codes.shape[1]
  compute_dtype = queries.dtype
  queries = queries.astype(jnp.float32)
  k_scale = k_scale.astype(jnp.float32)
  codes = codes.astype(compute_dtype)
  tile = math.lcm(LANES, group_size)  # whole lane tiles holding whole groups (48: 384 tokens)
  parts = []
  for start in range(0, block, tile):
    width = min(tile, block - start)
    first_group, groups = start // group_size, width // group_size
    scaled = jnp.concatenate(
      [queries * k_scale[g : g + 1] for g in range(first_group, first_group + groups)]
    ).astype(compute_dtype)  # [groups x rows, D]
    products = jax.lax.dot_general(
      scaled,
      codes[:, start : start + width],
      (((1,), (0,)), ((), ())),
      preferred_element_type=jnp.float32,
    )  # [groups x rows, width]
    parts.append(own_group_rows(products, rows, group_size, 0, groups))
  return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def _unpacked_key_scores(
  queries, k_codes, k_scale, k_min, *, bits: int, group_size: int, groups_axis: int
):
  """float32 [rows, block]: q . k with the codes unpacked to float32 (where `code_pairs_apply`
  does not), the scales and minimums of groups past the length zeroed. The codes are centred on
  their range's middle, the minimums moved by as much: what the bf16 operand rounds is a key's
  distance from its group's middle (at most half the group's range), and a channel's offset is
  kept exact in q . k_min instead of rounded into every key. Uncentred, the keys less their
  minimums (up to the whole range) rounded worse than the keys whole (KERNEL_NOTES v55)."""
  block = k_codes.shape[1]
  middle = (2**bits - 1) / 2
  k_min = k_min.astype(jnp.float32) + middle * k_scale.astype(jnp.float32)
  centred = lambda words: _stacked_fields(words, bits) - middle
  if token_halves_tpu.applies(k_codes.shape[0], block, group_size):
    # 2 bits at head_dim 64: the codes as whole registers
    scores = token_halves_tpu.scale_folded_key_scores(
      queries, centred(token_halves_tpu.halves_on_sublanes(k_codes)), k_scale, group_size
    )
  elif groups_axis == 0:  # the scales' rows as stored: folded into the queries
    scores = _scale_folded_scores(queries, centred(k_codes), k_scale, group_size)
  else:
    keys = centred(k_codes) * _spread_over_tokens(k_scale, group_size, block)
    scores = jax.lax.dot_general(
      queries,
      keys.astype(queries.dtype),  # the keys less their groups' middles, [D, block]
      (((1,), (0,)), ((), ())),
      preferred_element_type=jnp.float32,
    )
  return scores + _key_minimum_scores(queries, k_min, group_size, block, groups_axis)


def _repeat_over_channels(stats: jax.Array, group_size: int) -> jax.Array:
  """[D / group, block] per-value-group rows -> float32 [D, block]: row c holds row c // group."""
  groups, block = stats.shape
  stats = stats.astype(jnp.float32)
  return jnp.broadcast_to(stats[:, None, :], (groups, group_size, block)).reshape(
    groups * group_size, block
  )


class _GearLowRankBlock:
  """GEAR's low-rank terms over one kernel block of `block` tokens, `block / gear_block` GEAR
  blocks j, each with its factors: K[t] += k_a[t] . k_b[j]^T, V[t] += v_a[t] . v_b[j]^T.

  Refs: k_a and v_a [r, block] (the tokens on lanes); k_b and v_b as XLA lays out the stored
  [B, H, J, D, r]: at 128 channels or more [J_blk, r, D] (D on lanes, the rank on sublanes),
  below 128 [D, r, J_blk] (the GEAR blocks on lanes, `blocks_on_lanes`: there D would fill
  half the lanes, and XLA stores the blocks minor; read as [J, r, D] they were copied at every
  step, 2 x 16.7 MB in a decode loop at 32k tokens, KERNEL_NOTES v54). GEAR blocks past the
  row's length are zeroed before any product (they may hold NaN, and a 0/1 product would carry
  0 x NaN to every token).

  With bfloat16 factors and compute dtype (`exact_halves`) every product is one MXU pass and
  exact to 2^-16 of a term: the float32 queries, the float32 sums and p v_a taken as two
  bfloat16 halves against the bfloat16 factors or 0/1 spreads (`bfloat16_halves`). Otherwise
  float32 at HIGHEST precision, which cost GEAR-2's 4096-token step about 3900 bundles of its
  6900 on a v5e (static counts, KERNEL_NOTES v56)."""

  def __init__(
    self,
    refs,
    first,
    length,
    block: int,
    gear_block: int,
    rank: int,
    blocks_on_lanes: bool,
    compute_dtype,
  ):
    self.k_a_ref, self.k_b_ref, self.v_a_ref, self.v_b_ref = refs
    self.rank = rank
    self.blocks_on_lanes = blocks_on_lanes
    self.exact_halves = compute_dtype == jnp.bfloat16 and all(
      ref.dtype == jnp.bfloat16 for ref in refs
    )
    gear_blocks = block // gear_block
    shape, axis = ((1, gear_blocks), 1) if blocks_on_lanes else ((gear_blocks, 1), 0)
    starts = first + jax.lax.broadcasted_iota(jnp.int32, shape, axis) * gear_block
    self.live_blocks = starts < length  # [1, J_blk] or [J_blk, 1]
    spread_dtype = jnp.bfloat16 if self.exact_halves else jnp.float32
    self.spread = _token_group_indicator(gear_blocks, gear_block, block, spread_dtype)

  def _product(self, a, b, contracting):
    """a [rows, k] . b (contracting axis `contracting` of b), float32: by bfloat16 halves of a
    where `exact_halves`, else at HIGHEST precision."""
    if self.exact_halves:
      return product_by_halves(a, b, contracting)
    return jax.lax.dot_general(
      a.astype(jnp.float32),
      b.astype(jnp.float32),
      (((1,), contracting), ((), ())),
      preferred_element_type=jnp.float32,
      precision=jax.lax.Precision.HIGHEST,
    )

  def _factor_b(self, ref, rank_index: int) -> jax.Array:
    """[J_blk, D] (or [D, J_blk] with blocks_on_lanes), in the stored dtype: one rank's column
    of each live GEAR block's B, zero past the row. (Masked in float32: Mosaic refuses the
    sublane broadcast of the [1, J_blk] mask over packed 16-bit rows.)"""
    column = ref[:, rank_index, :]
    return jnp.where(self.live_blocks, column.astype(jnp.float32), 0.0).astype(column.dtype)

  def score_term(self, queries: jax.Array) -> jax.Array:
    """float32 [rows, block]: q . k_b[j(t)] . k_a[t] (natural-log logits, as q is scaled; q
    in float32)."""
    rows = queries.shape[0]
    contracting = (0,) if self.blocks_on_lanes else (1,)  # k_b [D, J_blk] or [J_blk, D]
    ranks = range(self.rank)
    per_block = jnp.concatenate(
      [self._product(queries, self._factor_b(self.k_b_ref, i), contracting) for i in ranks]
    )  # [r rows, J_blk]: every rank spread over the tokens in one product
    spread = self._product(per_block, self.spread, (0,))  # [r rows, block]
    k_a = self.k_a_ref[...].astype(jnp.float32)  # [r, block]
    term = None
    for i in range(self.rank):
      part = spread[i * rows : (i + 1) * rows] * k_a[i : i + 1]
      term = part if term is None else term + part
    return term

  def value_term(self, probs: jax.Array, valid_tokens: jax.Array) -> jax.Array:
    """float32 [rows, D]: sum_t p[t] v_a[t] . v_b[j(t)]^T, with p the block's unnormalised
    probabilities (so the online softmax rescales it with the rest of the accumulator)."""
    rows = probs.shape[0]
    v_a = jnp.where(valid_tokens, self.v_a_ref[...].astype(jnp.float32), 0.0)  # [r, block]
    weighted = jnp.concatenate([probs * v_a[i : i + 1] for i in range(self.rank)])
    per_block = self._product(weighted, self.spread, (1,))  # [r rows, J_blk]
    block_axis = 1 if self.blocks_on_lanes else 0
    term = None
    for i in range(self.rank):
      factor = self._factor_b(self.v_b_ref, i)
      part = self._product(per_block[i * rows : (i + 1) * rows], factor, (block_axis,))
      term = part if term is None else term + part
    return term


def _value_statistics(ref, head, heads_shared: bool) -> jax.Array:
  """float32 [D / group, block]: this head's value statistics rows. With `heads_shared` the
  block holds every KV head's single row ([H, block]: one value group per token, stored with
  the heads on sublanes) and the head's row is taken by a mask: a load at a dynamic sublane
  offset into a packed 16-bit tile Mosaic refuses ("cannot statically prove that index in
  dimension 1 is a multiple of 2", compiled for a TPU v5e and v6e)."""
  stats = ref[...].astype(jnp.float32)
  if not heads_shared:
    return stats
  heads = jax.lax.broadcasted_iota(jnp.int32, stats.shape, 0)
  return jnp.where(heads == head, stats, 0.0).sum(axis=0, keepdims=True)


CHUNK_TOKENS = 1024


def _attend_pairs_by_chunks(
  refs,
  head,
  valid_tokens,
  k_scale,
  k_min,
  state_refs,
  *,
  bits: int,
  group_size: int,
  query_rows: int,
  groups_axis: int,
  value_stats_shared: bool,
  sublane_gathers: bool,
  halves: bool,
):
  """A block's attention with the codes as bfloat16 pairs (`code_pair_products_tpu`), chunk by
  chunk of CHUNK_TOKENS tokens: each chunk's key scores from its own words, its softmax against
  its own maximum and its value partials, each read from the refs where the chunk needs it;
  the chunks merged at the end. Static bundles of an 8192-token KIVI-2 step on a v5e, head_dim
  128 / 64: 2157 / 2471 with the block's pairs and scores made whole first (v58), 2076 / 1638
  chunk by chunk with the two token halves' rows in one product each and their key scales
  put into virtual pair rows without embedding the statistics (KERNEL_NOTES v63).

  refs: (queries [rows, D], `pair_query_rows` [2 rows, D], k_codes [W, block], v_codes [W,
  block], v_scale, v_min, `pair_matrix` [D, D]); with `halves` (`code_pair_halves_tpu`), the
  matrix is `half_value_matrix` [4 D, D], each half's pair queries [2 rows, 2 D] follow, and
  each chunk of lanes holds a chunk of both token halves. The key statistics zero past the
  length; scores and P' are masked per chunk."""
  queries_ref, pair_queries_ref, k_codes_ref, v_codes_ref, v_scale_ref, v_min_ref = refs[:6]
  matrix = refs[6][...]
  max_ref, sum_ref, acc_ref = state_refs
  rows = max_ref.shape[0]
  block = k_codes_ref.shape[1]
  span = block // 2 if halves else block  # the pairs' lanes
  chunk = CHUNK_TOKENS if span % CHUNK_TOKENS == 0 else span
  if halves:
    half_pair_queries_ref = refs[7]
    per_group = code_pair_products_tpu.group_constants(
      queries_ref[...], pair_queries_ref[...], k_scale, k_min, groups_axis=1
    )
    groups, virtual = per_group.shape[1] // 2, 2 * matrix.shape[1]
    terms = [  # each half's scales, group constants and pair queries
      (
        code_pair_products_tpu.pair_ordered_scales(
          k_scale[:, half * groups : (half + 1) * groups],
          matrix[half * virtual : (half + 1) * virtual],
          groups_axis=1,
        ),
        per_group[:, half * groups : (half + 1) * groups],
        half_pair_queries_ref[half * rows : (half + 1) * rows, :],
      )
      for half in range(2)
    ]
  else:
    terms = [
      code_pair_products_tpu.key_score_terms(
        queries_ref[...], pair_queries_ref[...], k_scale, k_min, matrix, groups_axis
      )
      + (pair_queries_ref[:rows, :],)
    ]

  def pieces(local):  # each half's tokens in lanes local .. local + chunk
    return [slice(h * span + local, h * span + local + chunk) for h in range(len(terms))]

  def pairs(local, codes_ref):  # one chunk of lanes' pairs serve both halves
    words = jnp.concatenate([codes_ref[:, piece] for piece in pieces(local)])
    return bfloat16_code_pairs.code_pairs(words, bits)

  def chunk_scores(local):  # each half's
    scores = code_pair_products_tpu.key_scores_sharing_pairs(
      [(pair_queries, scales, per_group) for scales, per_group, pair_queries in terms],
      pairs(local, k_codes_ref),
      group_size,
      query_rows,
      sublane_gathers,
      token_offset=local,
    )
    return [
      jnp.where(valid_tokens[:, piece], half_scores, -jnp.inf)
      for half_scores, piece in zip(scores, pieces(local))
    ]

  chunks = range(0, span, chunk)
  # Every chunk's key scores are issued before the first softmax (the scheduler's starting
  # order; KERNEL_NOTES v63): each chunk's softmax and value product right after its own key
  # product, the step was 20-28% longer than v58's (v5e); with the key scores four chunks
  # ahead, as short on a v5e and a v4 but up to 10% longer on a v6e.
  scores_of = [chunk_scores(local) for local in chunks]
  parts = []
  for local, chunk_scores_of_halves in zip(chunks, scores_of):
    prob_sets, maxima = [], []
    for scores, piece in zip(chunk_scores_of_halves, pieces(local)):
      v_stats = jnp.concatenate(
        [
          _value_statistics(ref.at[:, piece], head, value_stats_shared)
          for ref in (v_scale_ref, v_min_ref)
        ]
      )
      # Past the length the statistics may hold NaN, which would reach P'.
      v_stats = jnp.where(valid_tokens[:, piece], v_stats, 0.0)
      chunk_max = scores.max(axis=1, keepdims=True)  # -inf: a chunk past the length
      probs = jnp.exp(scores - jnp.where(chunk_max == -jnp.inf, 0.0, chunk_max))
      prob_sets.append((probs, v_stats))
      maxima.append(chunk_max)
    partials = code_pair_products_tpu.value_partials_sharing_pairs(
      prob_sets, pairs(local, v_codes_ref), query_rows, sublane_gathers
    )
    for half, ((probs, _), chunk_max, (codes_part, minimums)) in enumerate(
      zip(prob_sets, maxima, partials)
    ):
      parts.append((half, chunk_max, probs.sum(axis=1, keepdims=True), codes_part, minimums))
  previous_max = max_ref[...]
  new_max = functools.reduce(jnp.maximum, [part[1] for part in parts], previous_max)
  total_sum, total_minimums = sum_ref[...] * jnp.exp(previous_max - new_max), 0
  total_codes = [0] * len(terms)  # each half's: its pair rows of `half_value_matrix`
  for half, chunk_max, chunk_sum, codes_part, minimums in parts:
    weight = jnp.exp(chunk_max - new_max)  # [rows, 1]; 0 for a chunk past the length
    total_sum = total_sum + weight * chunk_sum
    weight_per_array = jnp.concatenate([weight] * (codes_part.shape[0] // rows))
    total_codes[half] = total_codes[half] + weight_per_array * codes_part
    total_minimums = total_minimums + weight_per_array * minimums
  update = code_pair_products_tpu.pair_value_update(
    jnp.concatenate(total_codes, axis=1), total_minimums, matrix, group_size, query_rows, rows
  )
  acc_ref[...] = acc_ref[...] * jnp.exp(previous_max - new_max) + update
  sum_ref[...] = total_sum
  max_ref[...] = new_max


def _quantized_kernel(
  lengths_ref,
  *refs,
  plan: SplitPlan,
  bits: int,
  group_size: int,
  groups_axis: int,
  rank: int,
  outliers: bool,
  outlier_count: int,
  gear_block: int,
  value_stats_shared: bool,
  gear_queries: bool,
  code_pairs: bool,
  pair_halves: bool,
  query_rows: int,
  fetched: tuple[tuple[int, token_block_fetches_tpu.TokenBlockWindow], ...],
  sublane_gathers: bool,
):
  # refs: the inputs, [the aliased initial outputs], out, lse, three scratch buffers, then the
  # fetches' buffers and semaphores (`token_block_fetches_tpu.fetch_scratch`). The inputs:
  #   queries [H, rows, D], compute dtype, pre-scaled: every KV head's query rows;
  #   k_codes uint32 [W, block]; k_scale, k_min [block / group, D] ([D, block / group] with
  #   groups_axis 1); v_codes uint32 [W, block]; v_scale, v_min [D / group, block] ([H, block]
  #   with value_stats_shared); [the queries in float32 for GEAR's terms ([H, rows, D],
  #   `gear_queries`)]; [the pair queries and the pair matrix (`code_pairs`)]; [GEAR's low-rank
  #   factors (rank > 0): k_a, k_b, v_a, v_b]; [its outliers: k_index, k_value, v_index,
  #   v_value, each [J_blk, s]].
  # The inputs at the `fetched` positions are HBM refs, replaced below by the step's blocks.
  # out, lse and the scratch hold every KV head ([H, rows, ...]): the heads are the grid's
  # innermost axis.
  # The state's three buffers, then (where the kernel fetches its blocks) the fetches'.
  scratch_count = 3 + (len(fetched) + 1 if fetched else 0)
  scratch = refs[-scratch_count:]
  refs = list(refs[:-scratch_count])
  row, split, step, head = (pl.program_id(axis) for axis in range(4))
  kv_heads = scratch[0].shape[0]
  max_ref, sum_ref, acc_ref = (ref.at[head] for ref in scratch[:3])
  out_ref, lse_ref = refs[-2:]
  length = lengths_ref[row]
  if fetched:  # else Mosaic's pipeline fetched the blocks (`token_block_fetches_tpu`)
    fetches = token_block_fetches_tpu.TokenBlockFetches(
      [refs[position] for position, _ in fetched],
      scratch[3:-1],
      scratch[-1],
      [window for _, window in fetched],
    )
    slot, whole_slot = fetches.step(
      row=row, split=split, step=step, head=head, length=length, plan=plan, kv_heads=kv_heads
    )
    for index, (position, _) in enumerate(fetched):
      refs[position] = fetches.current(index, slot, whole_slot)
  queries_ref, k_codes_ref, k_scale_ref, k_min_ref, v_codes_ref, v_scale_ref, v_min_ref = refs[:7]
  rest = refs[7:]
  gear_queries_ref = rest[0] if gear_queries else queries_ref
  rest = rest[1:] if gear_queries else rest
  pair_queries_ref, pair_matrix_ref = rest[:2] if code_pairs else (None, None)
  rest = rest[2:] if code_pairs else rest
  # With `pair_halves` (`code_pair_halves_tpu`): pair_matrix_ref holds `half_value_matrix`,
  # and each half's pair queries follow.
  half_pair_queries_ref = rest[0] if pair_halves else None
  rest = rest[1:] if pair_halves else rest
  lowrank_refs = rest[:4] if rank else None
  rest = rest[4:] if rank else rest
  outlier_refs = rest[:4] if outliers else None
  block = plan.block_tokens
  compute_dtype = queries_ref.dtype
  queries_ref = queries_ref.at[head]
  gear_queries_ref = gear_queries_ref.at[head]
  if code_pairs:
    pair_queries_ref = pair_queries_ref.at[head]
  if pair_halves:
    half_pair_queries_ref = half_pair_queries_ref.at[head]

  @pl.when(step == 0)
  def _init():
    max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
    sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  first = (split * plan.blocks_per_split + step) * block

  @pl.when(first < length)
  def _attend():
    valid_tokens, _ = valid_token_masks(first, length, block)  # [1, block]
    groups = k_scale_ref.shape[groups_axis]
    group_shape = (groups, 1) if groups_axis == 0 else (1, groups)
    group_starts = first + jax.lax.broadcasted_iota(jnp.int32, group_shape, groups_axis) * (
      group_size
    )
    # Groups past the length may hold anything (NaN): zero them before the 0/1 product, where
    # 0 * NaN would reach every token.
    live_groups = group_starts < length
    k_scale = jnp.where(live_groups, k_scale_ref[...], 0)
    k_min = jnp.where(live_groups, k_min_ref[...], 0)
    if code_pairs and not (rank or outliers):
      _attend_pairs_by_chunks(
        (queries_ref, pair_queries_ref, k_codes_ref, v_codes_ref, v_scale_ref, v_min_ref)
        + (pair_matrix_ref,)
        + ((half_pair_queries_ref,) if pair_halves else ()),
        head,
        valid_tokens,
        k_scale,
        k_min,
        (max_ref, sum_ref, acc_ref),
        bits=bits,
        group_size=group_size,
        query_rows=query_rows,
        groups_axis=groups_axis,
        value_stats_shared=value_stats_shared,
        sublane_gathers=sublane_gathers,
        halves=pair_halves,
      )
      return
    if code_pairs:
      scores = code_pair_products_tpu.key_scores(
        queries_ref[...],
        pair_queries_ref[...],
        bfloat16_code_pairs.code_pairs(k_codes_ref[...], bits),
        k_scale,
        k_min,
        pair_matrix_ref[...],
        group_size=group_size,
        query_rows=query_rows,
        groups_axis=groups_axis,
        sublane_gathers=sublane_gathers,
      )
    else:
      scores = _unpacked_key_scores(
        queries_ref[...],
        k_codes_ref[...],
        k_scale,
        k_min,
        bits=bits,
        group_size=group_size,
        groups_axis=groups_axis,
      )
    if rank:
      lowrank = _GearLowRankBlock(
        lowrank_refs,
        first,
        length,
        block,
        gear_block,
        rank,
        blocks_on_lanes=groups_axis == 1,
        compute_dtype=compute_dtype,
      )
      scores = scores + lowrank.score_term(gear_queries_ref[...])
    if outliers:
      read = outlier_slots_read(outlier_count, outlier_refs[0].shape[-1], gear_block)
      outlier_terms = GearOutlierBlock(
        *(ref[...][:, :read] for ref in outlier_refs),
        count=outlier_count,
        first=first,
        length=length,
        gear_block=gear_block,
        head_dim=queries_ref.shape[-1],
        operand_dtype=compute_dtype,
      )
      scores = scores + outlier_terms.score_term(gear_queries_ref[...])
    scores = jnp.where(valid_tokens, scores, -jnp.inf)
    v_scale, v_min = (
      _value_statistics(ref, head, value_stats_shared) for ref in (v_scale_ref, v_min_ref)
    )
    token_halves = token_halves_tpu.applies(k_codes_ref.shape[0], block, group_size)
    if code_pairs:
      v_pairs = bfloat16_code_pairs.code_pairs(v_codes_ref[...], bits)
      # Past the length the statistics may hold NaN, which would reach P'.
      v_stats = jnp.where(valid_tokens, jnp.concatenate([v_scale, v_min]), 0.0)
    previous_max = max_ref[...]
    new_max = jnp.maximum(previous_max, scores.max(axis=1, keepdims=True))
    correction = jnp.exp(previous_max - new_max)  # 0 on the first block (max was -inf)
    probs = jnp.exp(scores - new_max)  # 0 past the length
    sum_ref[...] = sum_ref[...] * correction + probs.sum(axis=1, keepdims=True)
    max_ref[...] = new_max
    if code_pairs:
      update = code_pair_products_tpu.pair_value_update(
        *code_pair_products_tpu.pair_value_partials(
          probs, v_pairs, v_stats, query_rows, sublane_gathers
        ),
        pair_matrix_ref[...],
        group_size,
        query_rows,
        probs.shape[0],
      )
    elif token_halves:
      fields = 32 // bits
      in_rows = functools.partial(
        token_halves_tpu.value_statistics_in_rows, group_size=group_size, fields=fields
      )
      v_words = token_halves_tpu.halves_on_sublanes(v_codes_ref[...])
      values = _stacked_fields(v_words, bits) * in_rows(v_scale) + in_rows(v_min)
      # Slots past the length may hold anything: zero them so 0 * NaN cannot leak.
      live = in_rows(valid_tokens.astype(jnp.float32), group_size=4 * fields)
      values = jnp.where(live > 0, values, 0.0)
      update = token_halves_tpu.value_update(
        probs.astype(compute_dtype), values.astype(compute_dtype)
      )
    else:
      values = _stacked_fields(v_codes_ref[...], bits) * _repeat_over_channels(
        v_scale, group_size
      ) + _repeat_over_channels(v_min, group_size)  # [D, block]
      # Slots past the length may hold anything: zero them so 0 * NaN cannot leak.
      values = jnp.where(valid_tokens, values, 0.0)
      update = jax.lax.dot_general(
        probs.astype(compute_dtype),
        values.astype(compute_dtype),
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
      )
    if rank:
      update = update + lowrank.value_term(probs, valid_tokens)
    if outliers:
      update = update + outlier_terms.value_term(probs)
    acc_ref[...] = acc_ref[...] * correction + update

  @pl.when(step == plan.blocks_per_split - 1)
  def _write():
    finalize(max_ref, sum_ref, acc_ref[...], out_ref.at[head], lse_ref.at[head])


@_compat.waits_when_interpreted  # the jax 0.11.2 interpreter hang: `finished_if_interpreted`
@functools.partial(
  jax.jit,
  static_argnames=(
    "bits",
    "group_size",
    "sm_scale",
    "block",
    "block_tokens",
    "num_splits",
    "interpret",
    "sublane_gathers",
    "outlier_count",
  ),
)
def quantized_decode_attention_partials_tpu(
  queries,
  k_codes,
  k_scale,
  k_min,
  v_codes,
  v_scale,
  v_min,
  lengths,
  initial_partials=None,
  *,
  bits: int,
  group_size: int,
  sm_scale: float,
  lowrank=None,
  outliers=None,
  block: int = 64,
  block_tokens: int | None = None,
  num_splits: int | None = 2,
  interpret: bool = False,
  sublane_gathers: bool | None = None,
  outlier_count: int | None = None,
):
  """Per-split partials (out f32 [B,H,S,rows,D], lse f32 [B,H,S,rows]), GEAR's low-rank and
  outlier terms included. `initial_partials`: buffers for those outputs (aliased; tests poison
  them). `outlier_count`: the outliers a GEAR block holds, in the first slots of its [s] rows;
  the kernel does not read the slots past them (padding: `stored_outlier_slots`); None: every
  slot. Interpreted, the outputs are waited
  for before this returns. A length past the capacity counts as the capacity, as in the
  reference. What the kernel does not take (`unsupported_reason`, settings outside
  `launch_settings`' values) is a ValueError: the dispatch runs the reference for it.
  `sublane_gathers`: whether the code-pair products gather statistics rows on sublanes (a TPU
  v5e or newer); None: `sublane_gathers_lower` for the default device's TPU."""
  if sublane_gathers not in (None, True, False):
    raise ValueError(f"sublane_gathers={sublane_gathers!r}; allowed: None, True, False")
  check_bits(bits)
  check_launch_settings(dict(block_tokens=block_tokens, num_splits=num_splits))
  sizes = check_quantized_inputs(
    queries,
    k_codes,
    k_scale,
    k_min,
    v_codes,
    v_scale,
    v_min,
    lengths,
    bits=bits,
    group_size=group_size,
    lowrank=lowrank,
    outliers=outliers,
    block=block,
  )
  batch, kv_heads, group, head_dim, tokens, width = sizes[:6]
  outlier_count = check_outlier_count(outlier_count, outliers)
  reason = unsupported_reason(
    queries,
    k_codes,
    k_scale,
    v_scale,
    bits=bits,
    group_size=group_size,
    lowrank=lowrank,
    outliers=outliers,
    block=block,
  )
  if reason is not None:
    raise ValueError(f"the TPU quantized decode-attention kernel does not take {reason}")
  # The index maps clamp blocks to the row's last valid one: past the capacity it would not
  # exist (an out-of-bounds block read).
  lengths = jnp.minimum(lengths.astype(jnp.int32), tokens)
  rank = 0 if lowrank is None else lowrank[0].shape[-1]
  gear = lowrank is not None or outliers is not None
  block_tokens = block_tokens_for(
    tokens,
    group_size,
    k_scale.dtype,
    block_tokens,
    head_dim,
    gear_block=block if gear else None,
    lowrank=lowrank is not None,
    outlier_itemsize=None if outliers is None else min(x.dtype.itemsize for x in outliers),
    bits=bits,
  )
  groups_axis = 1 if tokens_on_lanes(head_dim) else 0
  rows = tile_rows(group)
  plan = plan_splits(tokens, block_tokens, batch * kv_heads, num_splits, target_programs=1)
  compute_dtype = k_scale.dtype if k_scale.dtype == jnp.bfloat16 else jnp.float32
  natural_queries = queries.astype(jnp.float32) * sm_scale
  key_groups = block_tokens // group_size
  value_groups = head_dim // group_size

  # The grid's axes are (batch, split, block, KV head), the heads innermost: a block of value
  # statistics shared by the heads (`value_stats_shared`) is then fetched once for all of them.
  # The cache's arrays are fetched by the kernel (`token_block_fetches_tpu`): each is an input
  # kept in HBM and a window of its token blocks (BlockSpecs where the blocks do not tile them).
  fetch = token_block_fetches_tpu.TokenBlockWindow
  if groups_axis == 1:  # [B, H, D, T / group]: the layout XLA gives them below 128 channels
    k_scale, k_min = jnp.swapaxes(k_scale, 2, 3), jnp.swapaxes(k_min, 2, 3)
    key_stat_window = fetch((head_dim, key_groups), 1)
  else:
    key_stat_window = fetch((key_groups, head_dim), 0)
  codes_window = fetch((width, block_tokens), 1)  # [B, H, W, T]
  # One value group per token: XLA stores the [B, H, T, 1] statistics with the heads on
  # sublanes ([B, 1, H, T]), where one head's row is a block of one sublane, which Mosaic
  # refuses (and a DMA of it too: the offset is not tile-aligned). Taken [B, H, T] (a bitcast
  # there), a block of every head's row serves the heads' consecutive steps. As [B, H, 1, T]
  # rows XLA copied both statistics into rows padded to two sublanes at every call (2 x 8 MiB
  # a step at 32k tokens, batch 8: KERNEL_NOTES v55).
  value_stats_shared = value_groups == 1
  if value_stats_shared:
    value_stats = (v_scale[..., 0], v_min[..., 0])
    value_stat_window = fetch((kv_heads, block_tokens), 1, heads_whole=True)
  else:
    value_stats = (jnp.swapaxes(v_scale, 2, 3), jnp.swapaxes(v_min, 2, 3))
    value_stat_window = fetch((value_groups, block_tokens), 1)
  # The codes as pairs of a virtual head of the token halves (`code_pair_halves_tpu`): KIVI's
  # 2-bit codes at head_dim 64. GEAR's terms there keep the unpacked token halves.
  pair_halves = not gear and code_pair_halves_tpu.applies(
    bits, head_dim, k_scale.dtype, block_tokens, group_size
  )
  code_pairs = code_pairs_apply(bits, head_dim, k_scale.dtype) or pair_halves

  def padded_queries(queries, dtype):
    """[B, H, rows, D]: the query rows, then copies of them where the code pairs' products fill
    registers with several groups' rows (`code_pair_products_tpu.fill_query_rows`), or zeros."""
    if code_pairs:
      return code_pair_products_tpu.fill_query_rows(queries.astype(dtype), rows)
    return pad_query_group(queries, rows, dtype)

  queries_spec = pl.BlockSpec(
    (None, kv_heads, rows, head_dim), lambda b, s, i, h, lens: (b, 0, 0, 0)
  )
  args, in_specs, windows = [padded_queries(natural_queries, compute_dtype)], [queries_spec], []

  def add_fetched(array, window):
    args.append(array)
    in_specs.append(None)  # below, once every window is known
    windows.append((len(args) - 1, window))

  add_fetched(jnp.swapaxes(k_codes, 2, 3), codes_window)
  add_fetched(k_scale, key_stat_window)
  add_fetched(k_min, key_stat_window)
  add_fetched(jnp.swapaxes(v_codes, 2, 3), codes_window)
  add_fetched(value_stats[0], value_stat_window)
  add_fetched(value_stats[1], value_stat_window)
  # GEAR's terms take the queries in float32 (exact to 2^-16 by bfloat16 halves, as the
  # reference's are): rounded to bfloat16 like the main product's, they multiplied the
  # outliers (the largest entries) by a relative error of 2^-9.
  gear_queries = gear and compute_dtype != jnp.float32
  if gear_queries:
    args.append(padded_queries(natural_queries, jnp.float32))
    in_specs.append(queries_spec)
  whole_array = lambda shape: pl.BlockSpec(shape, lambda b, s, i, h, lens: (0,) * len(shape))
  per_row = lambda shape: pl.BlockSpec(
    (None, kv_heads, *shape), lambda b, s, i, h, lens: (b, 0) + (0,) * len(shape)
  )
  if code_pairs:  # args[0]: the queries
    args.append(code_pair_products_tpu.pair_query_rows(args[0], bits))
    in_specs.append(per_row((2 * rows, head_dim)))
  if pair_halves:
    virtual = 2 * head_dim
    args.append(jnp.asarray(code_pair_halves_tpu.half_value_matrix(head_dim, bits), jnp.bfloat16))
    in_specs.append(whole_array((2 * virtual, head_dim)))
    half_pair_queries = code_pair_halves_tpu.half_pair_queries(args[0], bits)
    args.append(half_pair_queries.reshape(batch, kv_heads, 2 * rows, virtual))
    in_specs.append(per_row((2 * rows, virtual)))
  elif code_pairs:
    args.append(jnp.asarray(bfloat16_code_pairs.pair_matrix(head_dim, bits), jnp.bfloat16))
    in_specs.append(whole_array((head_dim, head_dim)))
  if lowrank is not None:
    k_a, k_b, v_a, v_b = lowrank  # [B, H, T, r], [B, H, J, D, r], the same
    # Both as XLA lays the stored arrays out (the transposes are bitcasts there): A with the
    # tokens last; B with the channels last at 128 channels or more, the GEAR blocks last below
    # (`_GearLowRankBlock`).
    gear_blocks = block_tokens // block
    if groups_axis == 1:
      as_stored = lambda factor: jnp.transpose(factor, (0, 1, 3, 4, 2))  # [B, H, D, r, J]
      factor_b_window = fetch((head_dim, rank, gear_blocks), 2)
    else:
      as_stored = lambda factor: jnp.swapaxes(factor, 3, 4)  # [B, H, J, r, D]
      factor_b_window = fetch((gear_blocks, rank, head_dim), 0)
    factor_a_window = fetch((rank, block_tokens), 1)
    add_fetched(jnp.swapaxes(k_a, 2, 3), factor_a_window)
    add_fetched(as_stored(k_b), factor_b_window)
    add_fetched(jnp.swapaxes(v_a, 2, 3), factor_a_window)
    add_fetched(as_stored(v_b), factor_b_window)
  if outliers is not None:  # [B, H, J, s] as stored (`OUTLIER_LAYOUT`)
    for array in outliers:
      add_fetched(array, fetch((block_tokens // block, array.shape[-1]), 0))
  # Each array the kernel can copy itself (its last block whole tiles, if short) it fetches;
  # the others come by BlockSpecs.
  own = []
  for position, window in windows:
    array = args[position]
    if token_block_fetches_tpu.last_block_extent(window, array.shape, array.dtype) is not None:
      args[position] = _compat.tpu_kept_in_hbm(array)
      in_specs[position] = token_block_fetches_tpu.hbm_spec()
      own.append((position, window))
    else:
      in_specs[position] = token_block_fetches_tpu.block_spec(window, plan=plan, kv_heads=kv_heads)
  windows = own
  # Every head's partials of a split in one block, written back once, after its last step:
  # a head's own block would be left and revisited at every step, and Pallas writes an output
  # block back whenever its index changes.
  out_specs = [
    pl.BlockSpec((None, kv_heads, None, rows, head_dim), lambda b, s, i, h, lens: (b, 0, s, 0, 0)),
    pl.BlockSpec((None, kv_heads, None, rows, 1), lambda b, s, i, h, lens: (b, 0, s, 0, 0)),
  ]
  out_shape = [
    jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows, head_dim), jnp.float32),
    jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows, 1), jnp.float32),
  ]
  aliases = {}
  if initial_partials is not None:
    if len(initial_partials) != len(out_shape):
      raise ValueError(
        f"initial_partials must hold {len(out_shape)} arrays (the outputs), got "
        f"{len(initial_partials)}"
      )
    in_specs += out_specs
    # Operand numbering counts the scalar-prefetch operand first.
    aliases = {1 + len(args) + index: index for index in range(len(out_shape))}
    initial = list(initial_partials)
    initial[1] = initial[1][..., None]
    args += initial
  grid_spec = _compat.prefetch_scalar_grid_spec(
    num_scalar_prefetch=1,
    grid=(batch, plan.num_splits, plan.blocks_per_split, kv_heads),
    in_specs=in_specs,
    out_specs=out_specs,
    scratch_shapes=[
      _compat.tpu_vmem_scratch((kv_heads, rows, 1), jnp.float32),
      _compat.tpu_vmem_scratch((kv_heads, rows, 1), jnp.float32),
      _compat.tpu_vmem_scratch((kv_heads, rows, head_dim), jnp.float32),
      *(
        token_block_fetches_tpu.fetch_scratch(
          [window for _, window in windows], [args[position].dtype for position, _ in windows]
        )
        if windows
        else []
      ),
    ],
  )
  kernel = functools.partial(
    _quantized_kernel,
    plan=plan,
    bits=bits,
    group_size=group_size,
    groups_axis=groups_axis,
    rank=rank,
    outliers=outliers is not None,
    outlier_count=outlier_count,
    gear_block=block,
    value_stats_shared=value_stats_shared,
    gear_queries=gear_queries,
    code_pairs=code_pairs,
    pair_halves=pair_halves,
    query_rows=group,
    fetched=tuple(windows),
    sublane_gathers=sublane_gathers_lower() if sublane_gathers is None else sublane_gathers,
  )
  outputs = pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=out_shape,
    input_output_aliases=aliases,
    # The fetches' offsets are in bounds by construction (`token_block_fetches_tpu`: no block
    # at or past a length clamped to the capacity, the last one copied short): Mosaic's checks
    # of them took 215 of a KIVI-2 8192-token step's 2595 bundles (head_dim 128, v5e).
    compiler_params=_compat.tpu_compiler_params(
      ("parallel", "parallel", "arbitrary", "arbitrary"), own_copies_in_bounds=bool(windows)
    ),
    interpret=_compat.tpu_interpret_params() if interpret else False,
    name=f"quantized_decode_attention_{bits}bit_tpu",
  )(lengths, *args)
  return outputs[0], outputs[1][..., 0]


def check_outlier_count(outlier_count, outliers) -> int:
  """The outliers a GEAR block holds (`outlier_count`, or every slot where it is None), checked
  against the outlier arrays' slots; 0 without outliers."""
  if outliers is None:
    if outlier_count is not None:
      raise ValueError(f"outlier_count={outlier_count!r} is given without outliers; allowed: None")
    return 0
  slots = outliers[0].shape[-1]
  if outlier_count is None:
    return slots
  if type(outlier_count) is not int or not 1 <= outlier_count <= slots:
    raise ValueError(
      f"outlier_count={outlier_count!r} must be an int in [1, {slots}] (the outliers' slots)"
    )
  return outlier_count


def quantized_decode_attention_tpu(
  queries,
  k_codes,
  k_scale,
  k_min,
  v_codes,
  v_scale,
  v_min,
  lengths,
  *,
  bits,
  group_size,
  sm_scale,
  lowrank=None,
  outliers=None,
  block=64,
  **config,
):
  """(out f32 [B,H,G,D], lse f32 [B,H,G]); same contract as the reference."""
  partials = quantized_decode_attention_partials_tpu(
    queries,
    k_codes,
    k_scale,
    k_min,
    v_codes,
    v_scale,
    v_min,
    lengths,
    bits=bits,
    group_size=group_size,
    sm_scale=sm_scale,
    lowrank=lowrank,
    outliers=outliers,
    block=block,
    **config,
  )
  return merge_split_partials(partials[0], partials[1], queries.shape[2])
