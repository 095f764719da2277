"""GPU decode attention over a quantized (KIVI) K/V segment: Mosaic GPU, both products per warp by
`mma.sync` (`kernel_config={"lowering": "mosaic_gpu", "variant": "warp"}`; KERNEL_NOTES v44, v45).

The folded kernel (`quantized_decode_attention_folded_mosaic_gpu`) multiplies with warpgroup MMAs:
their B operands (Q', P') are staged in shared memory by all four warps and published by a fence
and a barrier every block, and each product's A tile spans the four warps, so every product is a
wait for all of them (v34's profile: 30-40% of the loop's stalls). Here each warp takes its own
32 consecutive tokens of a 128-token block (one key group), both products by `mma.sync.m16n8k16`
with operands in registers (`warp_key_product`, `warp_value_product`):

  keys:   scores [32 tokens, 8 columns] = codes . Q'^T of the warp's key group, Q' built in
          registers from the group's scales and the lane's queries, the accumulators starting
          at the group's bias q . k_min (XLA's `key_bias`, or the kernel's own);
  softmax: against the split's fixed reference (`softmax_reference_bounds`: XLA's, or the
          kernel's own): no reduction over tokens, so no warp waits for another;
  values: each warp's partial output [128 channels, 8 columns] += V^T codes of its tokens . P'^T,
          P' = p v_scale 2^64 of two value groups per 8 columns at up to 4 query heads per KV
          head, of one at 5 to 8 (twice the MMAs; `warp_value_product`);
  after the loop: the sums over tokens, and the four warps' partial outputs added, once a split.

The ring (TMA copies of a block's key words, key scales, XLA's key bias, value words and
group-major value statistics, issued by the first warp, or with copy_issuer="slot_owner" by warp
s % 4 for slot s) is the only thing the warps share in the loop: one barrier per block before a
slot is refilled, or with ring_release="per_warp" each warp's arrival on the slot's mbarrier,
which only the issuing warp waits for. Opt-in, untimed (KERNEL_NOTES v62): the value words
TMA-swizzled a token row wide (value_ring_layout="swizzled": no bank conflicts in the value
matrix loads) and the value statistics read by matrix loads from one ring
(statistic_loads="matrix_loads": one `ldmatrix` where there were 8 16-bit loads a tile). A split
the bounds cannot serve
(reference `EXCHANGE`) runs an exact online softmax instead, in a loop of its own, its row max
reduced across the warps at every block.

Outputs per split, as the folded kernel's partial_slots="own" writes them: each channel's own
value slot, normalised (f32 [rows, D], rows 4 or 8,
`warp_value_product.finished_own_slot_outputs`: the sum over the warps, the codes' powers of two
and P's 2^64 taken out, the group's sum of p v_min added, over the sum of p), and the
log-sum-exp per column (natural). The splits are merged by
XLA (`merge_split_partials`) or by the folded kernels' Triton merge (`split_merge="triton"`).

With `key_bias_source="kernel"` each program computes q . k_min and its split's softmax
references itself before its loop (`key_bias_in_kernel.split_key_statistics`, the folded
kernel's prologue), and XLA computes no product for the kernel.

Interpret mode runs the same kernel with the inline pieces replaced by their jnp counterparts
(`*_emulated`: same inputs, same arrays out), so everything around them (ring, masks, softmax
arms, statistics, epilogue, merge) is what a GPU runs; the inline code itself is checked lane by
lane on numpy (`tests/pallas_kernels/test_warp_products_inline.py`), and natively only on a GPU.

Supported (`unsupported_reason`): KIVI 2- and 4-bit codes, head_dim 64 and 128 (at 64 with 2-bit
codes a token is 4 words: the key operand one word a lane, the value codes one 8-half-word
matrix load per 16 tokens; `warp_key_product`, `warp_value_product`), group size 32 (key
groups of 32 tokens, value groups of 32 channels), 1 to 8 query heads per KV head (padded to 4
rows, which the 8 columns repeat, or to 8), bf16 statistics, no GEAR terms; value scales below
2^31 (P' carries p v_scale 2^64 in bf16 with p <= 2^32). Slots past a row's length may hold
anything, NaN included: scores, probabilities and statistics are selected away there.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat, key_bias_in_kernel, value_operand_matrix_loads
from pallas_kernels import quantized_decode_attention_folded_mosaic_gpu as folded
from pallas_kernels.base_two_softmax import base_two_queries, natural_log_sum_exp
from pallas_kernels.bit_packing import packed_width
from pallas_kernels.decode_attention_mosaic_gpu import padded_lengths, swizzled_operand_transforms
from pallas_kernels.key_bias import DEFAULT_KEY_PRODUCT, check_key_product, key_bias
from pallas_kernels.key_bias_in_kernel import (
  DEFAULT_KEY_BIAS_SOURCE,
  any_row_exchanges,
  bias_chunks,
  check_key_bias_source,
  copies_per_chunk,
  queries_with_halves,
  split_key_groups,
  split_key_statistics,
)
from pallas_kernels.softmax_reference_bounds import (
  EXCHANGE,
  key_score_bounds,
  split_softmax_references,
)
from pallas_kernels.split_merge_triton import (
  check_split_merge,
  merge_value_slot_partials_triton,
  pop_split_merge,
)
from pallas_kernels.splits import SplitPlan, merge_split_partials, pad_query_group
from pallas_kernels.subnormal_codes import QUERY_EXPONENT, code_exponent, power_of_two
from pallas_kernels.warp_key_product import (
  COLUMNS,
  HEAD_DIMS,
  KEY_GROUP,
  SUPPORTED_BITS,
  TILE_ROWS,
  key_product_per_warp,
  key_scores_per_warp_emulated,
  own_token_key_operand,
)
from pallas_kernels.warp_value_product import (
  finished_own_slot_outputs,
  finished_own_slot_outputs_emulated,
  partial_rows,
  query_rows,
  statistics_by_matrix_loads,
  statistics_by_slot,
  statistics_by_slot_emulated,
  value_groups,
  value_operands,
  value_product_per_warp,
  value_product_per_warp_emulated,
)
from pallas_kernels.word_operand_order import channels_in_word_order

TILES = 2  # 16-token tiles a warp takes per block: 32 tokens, one key group
BLOCK_TOKENS = 4 * 16 * TILES
# Ring stages by code width: 4 at 2 bits (53 KB, four programs per SM), 2 at 4 bits (48 KB, four;
# 86 KB with 4 stages, two), sm_90a static count (KERNEL_NOTES v45).
DEFAULT_NUM_STAGES = {2: 4, 4: 2}
NUM_STAGES = (2, 3, 4)
SCORE_SCALE = 2.0**64  # the key product's scores are the true ones over this
PROBS_SCALE = 2.0**64  # P' = p v_scale 2^64 (`subnormal_codes`)
REDUCTION_SCRATCH_BYTES = 1024
# Key groups per prologue chunk with key_bias_source="kernel": a 16 KB k_min / k_scale tile, the
# M of one warpgroup product (a multiple of 64).
PROLOGUE_CHUNK_GROUPS = 64
MAX_QUERY_GROUP = COLUMNS
# Code words a token must be a multiple of: 4 (head_dim 64 at 2 bits, one word a lane of a quad;
# `word_operand_order.words_per_lane`), where the other Mosaic GPU kernels need 8.
WORDS_MULTIPLE = 4
# Which warp issues a ring slot's copies: the first, for every slot (v45), or warp slot % 4
# ("slot_owner": with 4 stages each warp a quarter of the blocks, so no warp carries the copies'
# ~63 instructions a block alone; KERNEL_NOTES v46).
COPY_ISSUERS = ("first_warp", "slot_owner")
DEFAULT_COPY_ISSUER = "first_warp"
# How a ring slot is released for its refill: one warpgroup barrier a block ("barrier", v45), or
# each warp's arrival on the slot's barrier, which the issuing warp alone waits for ("per_warp":
# no warp waits for another in the loop, only for its data; KERNEL_NOTES v46).
RING_RELEASES = ("barrier", "per_warp")
DEFAULT_RING_RELEASE = "barrier"
# When each warp loads its queries' B fragments (16 registers a thread at 8 columns) from shared
# memory: every block, before its key product ("per_block": 8 64-bit loads a block, and ptxas
# no longer holds them through the loop: 127 -> 114 registers at the defaults, 142 -> 126 at 8
# query rows, 127 -> 115 with ring_release="per_warp", +1 instruction a block; KERNEL_NOTES
# v46), or once before the loop ("once", v45).
QUERY_LOADS = ("per_block", "once")
DEFAULT_QUERY_LOADS = "per_block"
# How the value ring's slots hold the block's value words: token rows as the cache has them
# ("rows", v45), or TMA-swizzled a token row wide ("swizzled": `value_operand_matrix_loads`'
# swizzle, the same at head_dim 64 with 2-bit codes, whose 16-byte rows need none). The matrix
# loads' 8 rows of a matrix are a token row apart: unswizzled they share banks two at a time at
# 32-byte rows (head_dim 128 with 2-bit codes, 64 with 4-bit), four at 64-byte rows (128, 4-bit);
# swizzled, one wavefront a matrix (`benchmarks/shared_bank_conflicts.py`, KERNEL_NOTES v62).
VALUE_RING_LAYOUTS = ("rows", "swizzled")
DEFAULT_VALUE_RING_LAYOUT = "rows"
# How each lane loads its tokens' value statistics (scale and minimum of its columns' group):
# one 16-bit load a token and statistic ("per_token", v45: 8 loads a tile at 4 query rows and
# head_dim 128), or by transposing matrix loads, two tokens a register ("matrix_loads": one
# `ldmatrix.x4` a tile there; `warp_value_product.statistics_by_matrix_loads`). At V59's
# settings 469 -> 458 instructions a block at 124 -> 128 registers, the most that four programs
# an SM allow (sm_90a static count, KERNEL_NOTES v62).
STATISTIC_LOADS = ("per_token", "matrix_loads")
DEFAULT_STATISTIC_LOADS = "per_token"
# Settings no other Mosaic GPU variant takes (`copy_issuer` is the folded kernel's too, with its
# own values).
WARP_ONLY_SETTINGS = ("ring_release", "query_loads", "value_ring_layout", "statistic_loads")


def statistics_rows(rows: int, head_dim: int = 128) -> int:
  """Per column, the split's sums the epilogue finishes the output with
  (`finished_own_slot_outputs`): of p, then of p v_min per P' operand (`value_operands`: at 4
  query rows for value groups 2 s (slot s's columns) and 2 s + 1 at head_dim 128, group s at 64;
  at 8 rows for each value group)."""
  return 1 + value_operands(rows, head_dim)


def unsupported_reason(
  queries,
  k_codes,
  k_scale,
  v_scale,
  *,
  bits,
  group_size,
  block_tokens=None,
  key_bias_source=None,
  num_splits=None,
  **segment,
) -> str | None:
  """Why this kernel cannot take this segment with these settings (None if it can)."""
  segment = {key: segment[key] for key in ("lowrank", "outliers", "block") if key in segment}
  reason = folded.unsupported_reason(
    queries,
    k_codes,
    k_scale,
    v_scale,
    bits=bits,
    group_size=group_size,
    block_tokens=BLOCK_TOKENS,
    words_multiple=WORDS_MULTIPLE,
    **segment,
  )
  if reason is not None:
    return reason
  if bits not in SUPPORTED_BITS:
    return f"bits={bits} (the warp variant takes {SUPPORTED_BITS})"
  if queries.shape[3] not in HEAD_DIMS:
    return f"head_dim={queries.shape[3]} (the warp variant takes {HEAD_DIMS})"
  if group_size != KEY_GROUP:
    return f"group_size={group_size} (the warp variant takes {KEY_GROUP})"
  if queries.shape[2] > MAX_QUERY_GROUP:
    return f"query group {queries.shape[2]} (the warp variant takes 1 to {MAX_QUERY_GROUP})"
  if k_codes.shape[2] % 8:
    return f"{k_codes.shape[2]} cached tokens (the warp variant takes a multiple of 8)"
  if key_bias_source == "kernel":
    plan = folded.folded_split_plan(
      queries, k_codes, BLOCK_TOKENS, num_splits, group_size=group_size, key_bias_source="kernel"
    )
    return key_bias_in_kernel.unsupported_reason(plan.split_tokens, KEY_GROUP)
  return None


def check_settings(
  block_tokens=None,
  num_splits=None,
  num_stages=None,
  key_products=None,
  key_bias_source=None,
  split_merge=None,
  copy_issuer=None,
  ring_release=None,
  query_loads=None,
  value_ring_layout=None,
  statistic_loads=None,
) -> None:
  """ValueError naming a setting the warp variant does not take, and its allowed values (None:
  the setting's default)."""
  for name, value, allowed in (
    ("copy_issuer", copy_issuer, COPY_ISSUERS),
    ("ring_release", ring_release, RING_RELEASES),
    ("query_loads", query_loads, QUERY_LOADS),
    ("value_ring_layout", value_ring_layout, VALUE_RING_LAYOUTS),
    ("statistic_loads", statistic_loads, STATISTIC_LOADS),
  ):
    if value not in (None, *allowed):
      raise ValueError(f"{name}={value!r} is not supported by the warp variant; allowed: {allowed}")
  if block_tokens not in (None, BLOCK_TOKENS):
    raise ValueError(
      f"block_tokens={block_tokens!r} is not supported by the warp variant; allowed: "
      f"None or {BLOCK_TOKENS} (four warps of {16 * TILES} tokens)"
    )
  if num_stages not in (None, *NUM_STAGES):
    raise ValueError(
      f"num_stages={num_stages!r} is not supported by the warp variant; allowed: {NUM_STAGES}"
    )
  folded.dequantizing.check_settings(
    block_tokens=BLOCK_TOKENS, num_splits=num_splits, num_stages=num_stages or NUM_STAGES[0]
  )
  if key_products is not None:
    check_key_product(key_products)
  if key_bias_source is not None:
    check_key_bias_source(key_bias_source)
  if split_merge is not None:
    check_split_merge(split_merge)


def fence_shared_reads_before_async_writes(emulate: bool) -> None:
  """`fence.proxy.async.shared::cta`: shared-memory accesses ordered before (this thread's, and
  through an mbarrier it has waited on, the arriving threads') the TMA copies issued after it
  (`commit_smem` is this fence and a warpgroup barrier). In interpret mode `commit_smem`, which
  the interpreter models as the fence alone (its race detector checks the order); natively an
  `inline_mgpu` fence."""
  if emulate:
    plgpu.commit_smem()
    return

  @plgpu.inline_mgpu()
  def fence(_):
    from jaxlib.mlir.dialects import nvvm  # CUDA-only lowering modules stay out of CPU runs

    nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

  fence()


def _warp_kernel(
  *refs,
  plan: SplitPlan,
  tokens: int,
  num_stages: int,
  bits: int,
  head_dim: int,
  kernel_bias: bool,
  rows: int,
  copy_issuer: str,
  ring_release: str,
  query_loads: str,
  value_ring_layout: str,
  statistic_loads: str,
  emulate,
):
  """One program: a split of one (row, KV head). `refs`: the inputs (`_kernel_arrays`), the
  outputs, the scratch (`_scratch_types`), in their order. `rows`: the query rows (4 or 8,
  `warp_value_product.query_rows`); `copy_issuer`, `ring_release`, `query_loads`,
  `value_ring_layout`, `statistic_loads`: `COPY_ISSUERS`, `RING_RELEASES`, `QUERY_LOADS`,
  `VALUE_RING_LAYOUTS`, `STATISTIC_LOADS`. Shapes below at head_dim D = 128 (W = 8 words
  a token at 2 bits); at 64 every 128 channels is 64 and W is 4 (2 bits) or 8 (4 bits)."""
  if ring_release == "per_warp":
    *refs, consumed_barriers = refs  # per ring slot: each warp's arrival once it has read it
  if kernel_bias:
    (
      lengths_gmem,  # int32 [>= B]
      queries_gmem,  # bf16 [B, H, 4 x 8 + 8, 128]: the query halves, then the code queries
      k_words_gmem,  # uint32 [B, H, T, 8]
      k_scale_gmem,  # bf16 [B, H, >= T / 32, 128]
      k_min_gmem,  # bf16 [B, H, >= T / 32, 128]
      v_words_gmem,  # uint32 [B, H, T, 8]
      v_scale_gmem,  # bf16 [B, H, 4, T]: group-major
      v_min_gmem,  # bf16 [B, H, 4, T]
      out_gmem,  # f32 [B, H, S, rows, 128]: each split's normalised output (own slot at 4 rows)
      lse_gmem,  # f32 [B, H, S, 8]: each split's log-sum-exp (natural), by column
      lengths_smem,
      queries_smem,  # bf16 [8, 128]: the code queries, columns x positions
      reference_smem,  # f32 [8]
      k_words_smem,  # [stages, 128, 8]
      k_scale_smem,  # [stages, 4, 128]
      v_words_smem,  # [stages, 128, 8] uint32
      # v_scale, v_min: two rings [stages, 4, 128], or with statistic_loads="matrix_loads" one
      # [stages, 2, 4, 128] (both statistics from one address a lane)
      v_stats_smem,
      statistics_smem,  # f32 [1 + value_operands(rows), 8]: `statistics_rows`
      lse_smem,  # f32 [8]
      # the prologue's (halves bf16 [32, 128]: `key_bias_in_kernel.query_halves` with the bounds';
      # tile bf16 [chunk groups, 128]: its k_min / k_scale chunk), then in the same bytes the
      # epilogue's (partials f32 [512, 8]; out f32 [rows, 128])
      ((halves_smem, tile_smem), (partial_smem, out_smem)),
      split_bias_smem,  # f32 [chunks x chunk groups, 8]: the split's q . k_min
      setup_barrier,
      ring_barriers,
      chunk_barriers,
    ) = refs
  else:
    (
      lengths_gmem,
      queries_gmem,  # bf16 [B, H, 128, 8]: word order, times 2^(69 - bit), rows repeated
      k_words_gmem,
      k_scale_gmem,  # bf16 [B, H, T / 32, 128]
      key_bias_gmem,  # f32 [B, H, T / 32, 8]: XLA's q . k_min
      v_words_gmem,
      v_scale_gmem,
      v_min_gmem,
      reference_gmem,  # f32 [B, H, S, 8]: XLA's softmax references
      out_gmem,
      lse_gmem,
      lengths_smem,
      queries_smem,  # bf16 [128, 8]: positions x columns
      reference_smem,
      k_words_smem,
      k_scale_smem,
      key_bias_smem,  # [stages, 4, 8]
      v_words_and_partial_smem,  # [stages, 128, 8] uint32, after the loop the partials f32 [512, 8]
      v_stats_smem,
      out_smem,
      statistics_smem,
      lse_smem,
      setup_barrier,
      ring_barriers,
    ) = refs
  row, head, split = (lax.axis_index(name) for name in ("row", "head", "split"))
  if not kernel_bias:
    v_words_smem, partial_smem = v_words_and_partial_smem
  plgpu.copy_gmem_to_smem(lengths_gmem, lengths_smem, setup_barrier)
  if kernel_bias:
    # one array (`key_bias_in_kernel.queries_with_halves`), copied apart
    key_bias_in_kernel.copy_queries_with_halves(
      queries_gmem.at[row, head], halves_smem, queries_smem, setup_barrier
    )
  else:
    plgpu.copy_gmem_to_smem(queries_gmem.at[row, head], queries_smem, setup_barrier)
    plgpu.copy_gmem_to_smem(reference_gmem.at[row, head, split], reference_smem, setup_barrier)
  plgpu.barrier_wait(setup_barrier)
  start = split * plan.split_tokens
  end = jnp.minimum(jnp.minimum(start + plan.split_tokens, lengths_smem[row]), tokens)
  blocks = (jnp.maximum(end - start, 0) + BLOCK_TOKENS - 1) // BLOCK_TOKENS
  wgmma = plgpu.Layout.WGMMA

  def statistic_ring(slot, k):
    """Ring slot `slot` of value statistic k (0: scales, 1: minimums), [4, 128]."""
    if statistic_loads == "matrix_loads":
      return v_stats_smem.at[slot, k]
    return v_stats_smem[k].at[slot]

  def fetch(i):
    slot, first = lax.rem(i, num_stages), start + i * BLOCK_TOKENS
    barrier = ring_barriers.at[slot]
    tokens_of = pl.ds(first, BLOCK_TOKENS)
    groups_of = pl.ds(first // KEY_GROUP, BLOCK_TOKENS // KEY_GROUP)
    source = lambda ref: ref.at[row, head]
    plgpu.copy_gmem_to_smem(source(k_words_gmem).at[tokens_of], k_words_smem.at[slot], barrier)
    plgpu.copy_gmem_to_smem(source(k_scale_gmem).at[groups_of], k_scale_smem.at[slot], barrier)
    if not kernel_bias:
      plgpu.copy_gmem_to_smem(source(key_bias_gmem).at[groups_of], key_bias_smem.at[slot], barrier)
    plgpu.copy_gmem_to_smem(source(v_words_gmem).at[tokens_of], v_words_smem.at[slot], barrier)
    for k, statistic in enumerate((v_scale_gmem, v_min_gmem)):
      plgpu.copy_gmem_to_smem(source(statistic).at[:, tokens_of], statistic_ring(slot, k), barrier)

  def issues_copies(warp, slot):
    """Whether `warp` issues ring slot `slot`'s copies: always the same warp for a slot, so
    that with per-warp release one warp waits on each slot's arrivals, every phase in turn."""
    return warp == (0 if copy_issuer == "first_warp" else lax.rem(slot, 4))

  def fetch_by_issuing_warp(i):
    # one warp issues a block's six copies; every warp waits once per block
    slot = lax.rem(i, num_stages)
    plgpu.warp_map(lambda warp: pl.when(issues_copies(warp, slot))(functools.partial(fetch, i)))

  def release_and_refill(i, slot):
    """The end of block i's reads of ring slot `slot`: the slot refilled for block i + stages
    once every warp is done with it."""
    refill = i + num_stages < blocks
    if ring_release == "barrier":  # every warp waits for every other, once a block
      plgpu.commit_smem()
      pl.when(refill)(functools.partial(fetch_by_issuing_warp, i + num_stages))
      return

    def warp_release(warp):
      # No warp waits for the others here: only the issuing warp waits, for their arrivals on
      # this slot, so a warp may run up to num_stages blocks ahead of the slowest.
      plgpu.barrier_arrive(consumed_barriers.at[slot])

      # Every phase waited for, the last blocks' too (no refill after them): a barrier left
      # with a completed phase nobody observed fails jax 0.11.2's interpret mode.
      @pl.when(issues_copies(warp, slot))
      def _():
        plgpu.barrier_wait(consumed_barriers.at[slot])

        @pl.when(refill)
        def _():
          # The refill is a TMA write (the async proxy) after the warps' reads of the slot (the
          # generic proxy): a proxy fence between, just before the copies, where compilers'
          # fence passes put it. In the issuing warp only: each warp fencing its own reads
          # before its arrival took 124 -> 129 registers, three programs an SM (KERNEL_NOTES
          # v61); this, none more, and one or two instructions a block in that warp.
          fence_shared_reads_before_async_writes(emulate)
          fetch(i + num_stages)

    plgpu.warp_map(warp_release)

  for i in range(num_stages):
    pl.when(i < blocks)(functools.partial(fetch_by_issuing_warp, i))
  if kernel_bias:
    # After the ring's first copies are issued, so that they land while the split's bias and
    # references are computed (one copy of k_min and one of k_scale, and a warpgroup product of
    # each, per chunk of key groups).
    split_key_statistics(
      k_min_gmem,
      k_scale_gmem,
      halves_smem,
      tile_smem,
      split_bias_smem,
      reference_smem,
      chunk_barriers,
      row=row,
      head=head,
      first_group=start // KEY_GROUP,
      groups_used=(end - start + KEY_GROUP - 1) // KEY_GROUP,
      split_groups=split_key_groups(plan.split_tokens, KEY_GROUP),
      bits=bits,
    )
    exchange = any_row_exchanges(reference_smem)  # per row: any row's EXCHANGE
    query_view = queries_smem.T  # [positions, columns]
  else:
    exchange = reference_smem[0] == EXCHANGE  # XLA's: EXCHANGE in every row or none
    query_view = queries_smem

  def load_queries():
    if emulate:
      return query_view[...]
    return plgpu.load(query_view, layout=plgpu.Layout.MMA_RHS(jnp.bfloat16))  # B-fragment pairs

  program_queries = load_queries() if query_loads == "once" else None
  reference = plgpu.layout_cast(reference_smem[...], wgmma.reduce(0))

  def block_bias(i, slot):
    """The block's q . k_min [4 groups, 8]: its ring slot's, or the split's buffer's rows."""
    if kernel_bias:
      groups = BLOCK_TOKENS // KEY_GROUP
      return split_bias_smem.at[pl.ds(i * groups, groups)]
    return key_bias_smem.at[slot]

  per_column = functools.partial(
    lax.broadcast_in_dim, shape=(TILE_ROWS, COLUMNS), broadcast_dimensions=[1]
  )
  row_index = plgpu.broadcasted_iota(jnp.int32, (TILE_ROWS, COLUMNS), 0, layout=wgmma)
  warp_first_token = (row_index // 16) * (16 * TILES) + row_index % 16

  def tile_scores(i, slot):
    bias_ref = block_bias(i, slot)
    queries = program_queries if query_loads == "once" else load_queries()
    if emulate:
      return key_scores_per_warp_emulated(
        k_words_smem[slot], queries, k_scale_smem[slot], bias_ref[...], TILES, bits
      )
    keys = [
      own_token_key_operand(k_words_smem.at[slot], t, TILES, bits, head_dim) for t in range(TILES)
    ]
    return key_product_per_warp(
      keys, queries, k_scale_smem.at[slot], bias_ref, TILES, bits, head_dim
    )

  def slot_statistics(slot, t):
    """[(scale, minimum) of each P' operand] of tile t's tokens."""
    if emulate:
      return [
        tuple(
          statistics_by_slot_emulated(statistic_ring(slot, k)[...], b, t, TILES, rows)
          for k in range(2)
        )
        for b in range(operands)
      ]
    if statistic_loads == "matrix_loads":
      return statistics_by_matrix_loads(v_stats_smem.at[slot], t, TILES, rows, head_dim)
    return [
      tuple(
        statistics_by_slot(statistic_ring(slot, k), b, t, TILES, rows, head_dim) for k in range(2)
      )
      for b in range(operands)
    ]

  def value_product(probs, slot, acc, t):
    if emulate:
      return value_product_per_warp_emulated(
        probs, v_words_smem[slot], acc, t, TILES, bits, head_dim
      )
    return value_product_per_warp(
      probs, v_words_smem.at[slot], acc, t, TILES, bits, head_dim, swizzled=swizzled_values
    )

  swizzled_values = value_ring_layout == "swizzled"
  operands = value_operands(rows, head_dim)
  accumulator_rows = partial_rows(head_dim)

  def step(i, state, *, exact: bool, masked: bool):
    acc, row_max, sums, minimums = state
    slot = lax.rem(i, num_stages)
    plgpu.barrier_wait(ring_barriers.at[slot])
    first_token = start + i * BLOCK_TOKENS
    logits = [scores * SCORE_SCALE for scores in tile_scores(i, slot)]
    # which tokens are below the split's end: only the masked (last) block asks
    valid = (
      [warp_first_token + (first_token + 16 * t) < end for t in range(TILES)] if masked else []
    )
    if exact:  # the running max, across the warps
      block_max = None
      for t in range(TILES):
        tile_max = (jnp.where(valid[t], logits[t], -jnp.inf) if masked else logits[t]).max(axis=0)
        block_max = tile_max if block_max is None else jnp.maximum(block_max, tile_max)
      new_max = jnp.maximum(row_max, block_max)  # a split's first block holds a valid token
      correction = jnp.exp2(row_max - new_max)
      acc = acc * lax.broadcast_in_dim(correction, (accumulator_rows, COLUMNS), [1])
      sums = sums * per_column(correction)
      minimums = tuple(x * per_column(correction) for x in minimums)
      row_max = new_max
    for t in range(TILES):
      # past the length the scores and statistics may be NaN: p is 0 there, so are they (only a
      # split's last block reaches past it)
      def select(x, t=t):
        return jnp.where(valid[t], x, 0.0) if masked else x

      probs = select(jnp.exp2(logits[t] - per_column(row_max)))
      scaled_probs, new_minimums = [], []
      statistics = slot_statistics(slot, t)
      # 4 rows: slot s of the columns holds value group 2 s + b; 8 rows: every column group b
      for b in range(operands):
        scale, minimum = (select(x) for x in statistics[b])
        scaled_probs.append((probs * scale * PROBS_SCALE).astype(jnp.bfloat16))
        new_minimums.append(minimums[b] + probs * minimum)
      acc = value_product(scaled_probs, slot, acc, t)
      sums, minimums = sums + probs, tuple(new_minimums)
    release_and_refill(i, slot)
    return acc, row_max, sums, minimums

  minus_inf = plgpu.layout_cast(jnp.full((COLUMNS,), -jnp.inf, jnp.float32), wgmma.reduce(0))
  zero = plgpu.layout_cast(jnp.zeros((TILE_ROWS, COLUMNS), jnp.float32), wgmma)
  init = (
    plgpu.layout_cast(jnp.zeros((accumulator_rows, COLUMNS), jnp.float32), wgmma),
    lax.cond(exchange, lambda: minus_inf, lambda: reference),
    zero,
    (zero,) * operands,
  )

  # A loop per path, chosen once per program (every thread reads the same reference, so all
  # take the same one): one loop with a branch per block took 178 registers (two programs per
  # SM), the two loops 127 (four), sm_90a static count (KERNEL_NOTES v45; the folded kernel's
  # count went the other way, v33).
  def loop(exact):
    def run(state):
      # every block but the last is whole (the split's blocks end at its end)
      state = lax.fori_loop(
        0, blocks - 1, functools.partial(step, exact=exact, masked=False), state
      )
      last = functools.partial(step, blocks - 1, exact=exact, masked=True)
      return lax.cond(blocks > 0, last, lambda state: state, state)

    return run

  acc, row_max, sums, minimums = lax.cond(exchange, loop(True), loop(False), init)
  # Once per split: the sums over tokens, the four warps' partial outputs added (through shared
  # memory: with XLA's bias in the value ring's bytes, every copy into it waited for and read;
  # with the kernel's in the prologue's, read for the last time before its `commit_smem`) and
  # finished: each channel's own slot, normalised, and the split's log-sum-exp (natural), as
  # the folded kernel's partial_slots="own" writes them.
  totals = [x.sum(axis=0) for x in (sums, *minimums)]
  for k, total in enumerate(totals):
    statistics_smem[k, :] = total
  nonempty = totals[0] != 0  # a NaN sum is not empty: its NaN reaches out and lse
  safe_sums = jnp.where(nonempty, totals[0], 1.0)
  lse_smem[...] = jnp.where(nonempty, natural_log_sum_exp(row_max, safe_sums), -jnp.inf)
  if ring_release == "per_warp" and not kernel_bias:  # every warp done with the value ring
    plgpu.commit_smem()
  partial_smem[...] = acc
  plgpu.commit_smem()
  if emulate:
    out_smem[...] = finished_own_slot_outputs_emulated(
      partial_smem[...], statistics_smem[...], bits, rows, head_dim
    )
  else:
    out_smem[...] = finished_own_slot_outputs(partial_smem, statistics_smem, bits, rows, head_dim)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[row, head, split])
  plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[row, head, split])
  plgpu.wait_smem_to_gmem(0)


def _code_queries(queries, sm_scale, bits):
  """(the queries scaled to base 2, padded to `query_rows` rows and, at 4, repeated to the 8
  columns (column j is row j % 4), f32 [B, H, 8, D]; the same moved to the word order and scaled
  by each position's 2^(69 - bit) (`subnormal_codes`), f32 [B, H, D, 8])."""
  rows, head_dim = query_rows(queries.shape[2]), queries.shape[3]
  scaled = pad_query_group(base_two_queries(queries, sm_scale), rows, jnp.float32)
  scaled = jnp.tile(scaled, (1, 1, COLUMNS // rows, 1))
  channel_scale = power_of_two(
    QUERY_EXPONENT - code_exponent(jnp.arange(head_dim, dtype=jnp.int32), head_dim, bits)
  )
  code_queries = jnp.swapaxes(scaled, 2, 3) * channel_scale[:, None]
  return scaled, channels_in_word_order(code_queries, 2, bits)


def kernel_inputs(
  queries, k_scale, k_min, v_scale, v_min, lengths, *, sm_scale, plan, key_products, bits=2
):
  """With XLA's bias, the kernel's inputs besides the codes: (lengths, code queries bf16
  [B, H, D, 8], key bias, v_scale and v_min group-major, references), the bias and the bounds
  from the same 8 query columns as the code queries."""
  scaled, code_queries = _code_queries(queries, sm_scale, bits)
  bias = key_bias(scaled, k_min, key_products=key_products)  # [B, H, T / 32, 8]
  references = split_softmax_references(
    *key_score_bounds(scaled, k_scale, bias, bits=bits, key_products=key_products),
    lengths,
    group_size=KEY_GROUP,
    split_tokens=plan.split_tokens,
    num_splits=plan.num_splits,
  )
  return (
    padded_lengths(lengths),
    code_queries.astype(jnp.bfloat16),
    bias,
    jnp.swapaxes(v_scale, 2, 3),
    jnp.swapaxes(v_min, 2, 3),
    references,
  )


def _kernel_arrays(
  queries, k_codes, k_scale, k_min, v_codes, v_scale, v_min, lengths, *, sm_scale, plan,
  key_products, key_bias_source, bits,
):  # fmt: skip
  """The kernel's inputs, by XLA, in its order (`_warp_kernel`)."""
  if key_bias_source == "kernel":
    scaled, code_queries = _code_queries(queries, sm_scale, bits)
    short = key_bias_in_kernel.statistics_padding(
      plan.split_tokens, KEY_GROUP, PROLOGUE_CHUNK_GROUPS, k_min.shape[2]
    )
    padding = ((0, 0), (0, 0), (0, short), (0, 0))
    return (
      padded_lengths(lengths),
      queries_with_halves(code_queries, scaled, bounds=True),
      k_codes,
      jnp.pad(k_scale, padding),
      jnp.pad(k_min, padding),
      v_codes,
      jnp.swapaxes(v_scale, 2, 3),
      jnp.swapaxes(v_min, 2, 3),
    )
  lengths, code_queries, bias, v_scale_t, v_min_t, references = kernel_inputs(
    queries, k_scale, k_min, v_scale, v_min, lengths,
    sm_scale=sm_scale, plan=plan, key_products=key_products, bits=bits,
  )  # fmt: skip
  return (lengths, code_queries, k_codes, k_scale, bias, v_codes, v_scale_t, v_min_t, references)


def _scratch_types(
  lengths_words: int,
  plan: SplitPlan,
  num_stages: int,
  bits: int,
  head_dim: int,
  kernel_bias: bool,
  rows: int,
  ring_release: str,
  value_ring_layout: str,
  statistic_loads: str,
):
  """The kernel's scratch, in its order (`_warp_kernel`)."""
  statistics = (value_groups(head_dim), BLOCK_TOKENS)
  consumed = (
    [plgpu.Barrier(num_arrivals=4, num_barriers=num_stages)] if ring_release == "per_warp" else []
  )
  groups = BLOCK_TOKENS // KEY_GROUP
  words = packed_width(head_dim, bits)
  ring = lambda shape, dtype: plgpu.SMEM((num_stages, *shape), dtype)
  operand = functools.partial(swizzled_operand_transforms, head_dim, dtype=jnp.bfloat16)
  queries = (COLUMNS, head_dim) if kernel_bias else (head_dim, COLUMNS)
  value_transforms = (
    value_operand_matrix_loads.ring_transforms(head_dim, bits)
    if value_ring_layout == "swizzled"
    else ()
  )
  v_words = plgpu.SMEM((num_stages, BLOCK_TOKENS, words), jnp.uint32, transforms=value_transforms)
  partial = plgpu.SMEM((partial_rows(head_dim), COLUMNS), jnp.float32)
  out = plgpu.SMEM((rows, head_dim), jnp.float32)
  scratch = [
    plgpu.SMEM((lengths_words,), jnp.int32),
    plgpu.SMEM(queries, jnp.bfloat16),
    plgpu.SMEM((COLUMNS,), jnp.float32),
    ring((BLOCK_TOKENS, words), jnp.uint32),  # key words
    ring((groups, head_dim), jnp.bfloat16),
    *([] if kernel_bias else [ring((groups, COLUMNS), jnp.float32)]),
    # with XLA's bias the partials reuse the value ring's bytes (free after the loop); with the
    # kernel's, the prologue's (below)
    v_words if kernel_bias else plgpu.RefUnion(v_words, partial),
    # the value statistics (`_warp_kernel`'s `statistic_ring`): with matrix loads in one ring, so
    # that a lane's address serves both (two rings took four more registers, 132 against 128:
    # three programs an SM); one ring cost the 16-bit loads 3 instructions a block (v62)
    (
      ring((2, value_groups(head_dim), BLOCK_TOKENS), jnp.bfloat16)
      if statistic_loads == "matrix_loads"
      else (ring(statistics, jnp.bfloat16), ring(statistics, jnp.bfloat16))
    ),
    *([] if kernel_bias else [out]),
    plgpu.SMEM((statistics_rows(rows, head_dim), COLUMNS), jnp.float32),
    plgpu.SMEM((COLUMNS,), jnp.float32),
  ]
  barriers = [
    plgpu.Barrier(num_arrivals=3),
    plgpu.Barrier(num_arrivals=5 if kernel_bias else 6, num_barriers=num_stages),
  ]
  if not kernel_bias:
    return scratch + barriers + consumed
  # a split shorter than a chunk copies its own groups into the tile: the rest is never picked
  chunk = PROLOGUE_CHUNK_GROUPS
  chunks = bias_chunks(split_key_groups(plan.split_tokens, KEY_GROUP), chunk)
  # The prologue's query halves and k_min / k_scale tile (read for the last time before the
  # prologue's closing `commit_smem`) and the epilogue's partials and outputs (written after the
  # loop) in the same bytes: at 2 stages, 2-bit codes and head_dim 128 the program's shared
  # memory goes from 65 KB to under the 56 KB that four programs an SM leave each (KERNEL_NOTES
  # v60), where the value ring is too small to hold the partials.
  prologue = (
    plgpu.SMEM((4 * COLUMNS, head_dim), jnp.bfloat16, transforms=operand()),
    plgpu.SMEM((chunk, head_dim), jnp.bfloat16, transforms=operand()),
  )
  return scratch + [
    plgpu.RefUnion(prologue, (partial, out)),
    plgpu.SMEM((chunks * chunk, COLUMNS), jnp.float32),
    *barriers,
    plgpu.Barrier(num_barriers=chunks * copies_per_chunk(True)),
    *consumed,
  ]


@functools.partial(
  jax.jit,
  static_argnames=(
    "sm_scale",
    "plan",
    "num_stages",
    "bits",
    "key_products",
    "key_bias_source",
    "copy_issuer",
    "ring_release",
    "query_loads",
    "value_ring_layout",
    "statistic_loads",
    "interpret",
  ),
)
def _jitted_kernel_outputs(
  *arrays,
  sm_scale,
  plan: SplitPlan,
  num_stages: int,
  bits: int,
  key_products: str,
  key_bias_source: str,
  copy_issuer: str,
  ring_release: str,
  query_loads: str,
  value_ring_layout: str,
  statistic_loads: str,
  interpret: bool,
):
  queries, k_codes = arrays[:2]
  batch, kv_heads, _, head_dim = queries.shape
  kernel_bias = key_bias_source == "kernel"
  rows = query_rows(queries.shape[2])
  inputs = _kernel_arrays(
    *arrays, sm_scale=sm_scale, plan=plan, key_products=key_products,
    key_bias_source=key_bias_source, bits=bits,
  )  # fmt: skip
  kernel = plgpu.kernel(
    functools.partial(
      _warp_kernel,
      plan=plan,
      tokens=k_codes.shape[2],
      num_stages=num_stages,
      bits=bits,
      head_dim=head_dim,
      kernel_bias=kernel_bias,
      rows=rows,
      copy_issuer=copy_issuer,
      ring_release=ring_release,
      query_loads=query_loads,
      value_ring_layout=value_ring_layout,
      statistic_loads=statistic_loads,
      emulate=interpret,
    ),
    out_type=(
      jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, COLUMNS), jnp.float32),
    ),
    grid=(batch, kv_heads, plan.num_splits),
    grid_names=("row", "head", "split"),
    scratch_types=_scratch_types(
      inputs[0].shape[0],
      plan,
      num_stages,
      bits,
      head_dim,
      kernel_bias,
      rows,
      ring_release,
      value_ring_layout,
      statistic_loads,
    ),
    # Every thread's stores into shared memory (the epilogue's, the prologue's) are published by
    # `commit_smem` before anyone reads them; the loop stores none. TMA refills a slot only after
    # the `commit_smem` that ends the block reading it.
    compiler_params=_compat.mosaic_gpu_compiler_params(
      unsafe_no_auto_barriers=True, reduction_scratch_bytes=REDUCTION_SCRATCH_BYTES
    ),
    interpret=_compat.mosaic_gpu_interpret_params() if interpret else None,
  )
  return kernel(*inputs)


def warp_kernel_outputs(
  queries: jax.Array,  # [B, H, G, D]
  k_codes: jax.Array,  # uint32 [B, H, T, 8]
  k_scale: jax.Array,  # bf16 [B, H, T / 32, D]
  k_min: jax.Array,
  v_codes: jax.Array,  # uint32 [B, H, T, 8]
  v_scale: jax.Array,  # bf16 [B, H, T, D / 32]
  v_min: jax.Array,
  lengths: jax.Array,  # int32 [B]
  *,
  bits: int,
  group_size: int,
  sm_scale: float,
  block_tokens: int | None = None,
  num_splits: int | None = None,
  num_stages: int | None = None,
  key_products: str = DEFAULT_KEY_PRODUCT,
  key_bias_source: str = DEFAULT_KEY_BIAS_SOURCE,
  copy_issuer: str = DEFAULT_COPY_ISSUER,
  ring_release: str = DEFAULT_RING_RELEASE,
  query_loads: str = DEFAULT_QUERY_LOADS,
  value_ring_layout: str = DEFAULT_VALUE_RING_LAYOUT,
  statistic_loads: str = DEFAULT_STATISTIC_LOADS,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """The kernel's own outputs: out f32 [B, H, S, rows, D] (each split's normalised output, each
  channel from its own value slot; rows = `query_rows(G)`, 4 or 8) and lse f32 [B, H, S, 8]
  (natural; column j is row j % rows).
  Settings and shapes are checked (ValueError) before anything is traced."""
  check_settings(
    block_tokens=block_tokens,
    num_splits=num_splits,
    num_stages=num_stages,
    key_products=key_products,
    key_bias_source=key_bias_source,
    copy_issuer=copy_issuer,
    ring_release=ring_release,
    query_loads=query_loads,
    value_ring_layout=value_ring_layout,
    statistic_loads=statistic_loads,
  )
  reason = unsupported_reason(
    queries,
    k_codes,
    k_scale,
    v_scale,
    bits=bits,
    group_size=group_size,
    key_bias_source=key_bias_source,
    num_splits=num_splits,
  )
  if reason is not None:
    raise ValueError(
      f"the warp Mosaic GPU quantized decode-attention kernel does not support {reason}"
    )
  plan = folded.folded_split_plan(
    queries,
    k_codes,
    BLOCK_TOKENS,
    num_splits,
    group_size=group_size,
    key_bias_source=key_bias_source,
  )
  outputs = _jitted_kernel_outputs(
    queries,
    k_codes,
    k_scale,
    k_min,
    v_codes,
    v_scale,
    v_min,
    lengths,
    sm_scale=sm_scale,
    plan=plan,
    num_stages=num_stages or DEFAULT_NUM_STAGES[bits],
    bits=bits,
    key_products=key_products,
    key_bias_source=key_bias_source,
    copy_issuer=copy_issuer,
    ring_release=ring_release,
    query_loads=query_loads,
    value_ring_layout=value_ring_layout,
    statistic_loads=statistic_loads,
    interpret=interpret,
  )
  return _compat.finished_if_interpreted(outputs, interpret)


def warp_partials_mosaic_gpu(*arrays, bits, group_size, **settings):
  """Per-split partials (out f32 [B, H, S, G, D] normalised, lse f32 [B, H, S, G] natural);
  `warp_kernel_outputs`' arguments (and `split_merge`, which unmerged partials do not use)."""
  pop_split_merge(settings)
  group = arrays[0].shape[2]
  out, lse = warp_kernel_outputs(*arrays, bits=bits, group_size=group_size, **settings)
  return out[:, :, :, :group], lse[..., :group]


def warp_decode_attention_mosaic_gpu(*arrays, bits, group_size, **settings):
  """(out f32 [B, H, G, D], lse f32 [B, H, G]); same contract as the jnp reference (KIVI
  segments); `warp_kernel_outputs`' arguments, and `split_merge`: who merges the splits'
  partials, XLA ("xla", `merge_split_partials`) or one Triton kernel ("triton",
  `split_merge_triton`, which takes them as the folded kernel's own-slot partials)."""
  split_merge = pop_split_merge(settings)
  group = arrays[0].shape[2]
  out, lse = warp_kernel_outputs(*arrays, bits=bits, group_size=group_size, **settings)
  if split_merge == "triton":
    return merge_value_slot_partials_triton(
      out,
      lse,
      group=group,
      group_size=KEY_GROUP,
      real_rows=query_rows(group),
      own_slot=True,
      interpret=settings.get("interpret", False),
    )
  return merge_split_partials(out, lse, group, head_dim_last=True)
