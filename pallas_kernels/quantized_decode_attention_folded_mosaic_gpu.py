"""GPU decode attention over a quantized (KIVI) K/V segment: Mosaic GPU, scales folded into the
small operands, codes as subnormal bf16 operands (`kernel_config={"lowering": "mosaic_gpu",
"variant": "folded"}`).

The ring, the TMA copies and the two warpgroup products of `quantized_decode_attention_mosaic_gpu`
(v12), without its per-element dequantization, which its profile on an H100 showed it spends ~10
instructions per cached element on (KERNEL_NOTES v13). As in the Triton "folded" variant
(`folded_scales_kernel_triton`), the scales move to the small operand of each product, one copy
per quantization group, stacked along the product's N side:

  keys:   scores^T [block, KG * rows] = codes [block, D] . Q'^T, Q'[k, r, c] = q[r, c] k_scale[k, c]
          (KG key groups per block; q rounded to bf16, the product in bf16); each token keeps
          the columns of its own group k and adds the bias q . k_min[k], computed by XLA
          before the kernel (`key_bias`).
  values: acc^T [D, tiles * rows] += codes^T [D, block] . P'^T, P'[k, r, t] = p[r, t] v_scale[t, k]
          (VG value groups per head); after the last block each channel c keeps the columns of
          its group c // group_size and adds sum_t p v_min[t, k], accumulated beside.

Tokens are the products' M side, spread over the four warps, so a sum over tokens crosses the
warps through shared memory and two barriers. The loop has one such reduction per block, the row
max: the softmax denominator and the value-minimum terms are kept per token ([block, rows] and
[block, tiles * rows] in registers, rescaled like the accumulator) and summed once after the
loop (KERNEL_NOTES v19: 11 -> 5 barriers per 128-token block).

The N side of a product is a multiple of 8 (`tile_rows`), so a query group of 4 fills half of
each key group's columns. On the key side that cannot be helped: a token picks its group's
columns, and a column's thread must hold the same query row for every token. On the value side
it can: the padding query rows repeat the real ones (row j is row j % real_rows), so every
column of p is a real row's probabilities, and `value_slots` value groups share one tile of
`tile_rows` columns, each in its own slot of real_rows columns (P' picks each column's group
with a select). For the shapes of record (group 4, 4 value groups) the value accumulator is
[D, 16] instead of [D, 32]: 16 registers fewer, half the P' stores and accumulator rescaling;
at block 64 the kernel then fitted three programs per SM (KERNEL_NOTES v16; since v19 three at
block 128 and four at block 64). After the kernel,
`pick_value_slots` takes each channel's rows from its group's slot.

A product runs on the tensor core until its accumulator is read, so each block's work that does
not need a product's result is placed between the product and that read: the key bias's load
in the key product's shadow, the per-token denominator and value-minimum terms in the value
product's (KERNEL_NOTES v17).

Two settings change where the codes go (KERNEL_NOTES v30; both on in the Hopper default):
`key_operand="registers"` hands the key codes to wgmma from the registers the unpacking leaves
them in (the key product's codes are its A operand untransposed; the value product's are not),
one product per 64-token row tile against the key groups that tile holds; and
`operand_order="word"` makes each masked code word one operand register as it is, in the
column order `word_operand_order` derives, with the queries, key scales and output permuted to
match. `folded_decode_attention_mosaic_gpu` merges the splits before it picks each channel's
value slot (and position), so no gather runs over the per-split partials.

Two settings of v31: `copy_issuer="first_warp"` leaves each block's five
TMA copies to the first warp alone, in warp semantics (`plgpu.warp_map`), all arriving on one
barrier per ring slot: the other three warps skip the copies' address arithmetic and wait once
per block instead of five times (interpret mode runs the same warp map and checks the barrier's
arrival count). `value_accumulator="carried"` rescales the running accumulator and hands it to
the value product, which adds into it, instead of adding a zeroed accumulator's product after
(interpret mode, which has no wgmma into an accumulator made from registers, adds the product
as a dot to the same rescaled accumulator).

A setting of v32: `value_stats="separate"` hands the kernel the value
statistics as the cache's bf16 scales and minimums, each transposed group-major (two TMA copies
and two 16-bit loads per group and token), instead of "pairs", one uint32 (scale, minimum) word
per group and token packed by the wrapper. In a loop XLA carries the statistics group-major, so
the transposes become layout, but the packing is computed at every call: 67 MB of the 291.6 MB
one iteration of the benchmark's timed loop moves at 32k (`VALUE_STATS`).

Timed on the H200 in KERNEL_NOTES v34 (KIVI-2, 32k, batch 8, 8 KV heads, 4 heads each, us per
call): v30's settings 222.8; with "first_warp" 192.8, "carried" 214.8, both 191.9, both and
"separate" 183.6, the Hopper default since (`FOLDED_MOSAIC_GPU_V34` in
`quantized_decode_attention_gpu`).

A setting of v33: `row_max="bound"` runs the softmax against a fixed
reference per split, from the bounds the key statistics put on the scores (computed by XLA
before the kernel, `softmax_reference_bounds`), instead of the running max: no reduction over
tokens, no rescaling of the accumulator and the per-token sums, 2 of the 5 barriers per block
gone (the reference's p are at most 2^32, so value scales must stay below 2^31). A split the
bounds cannot serve gets the reference +inf and its program takes the running max's branch at
every block (`ROW_MAXES`). Timed in v34: the kernel alone 165.5 -> 143.7 us under Nsight Compute
(at its 1.36 GHz clock), but the call 183.6 -> 192.1 us: XLA's product for the bounds (a second
GEMM fusion, 45 us under Nsight Compute) costs more than the kernel saves.

A setting of v34, not yet timed on a GPU: `key_products="reduction"` has XLA compute q . k_min
per key group (and with "bound" the bounds' product over the key scales) as a broadcast product
summed over the channels, a reduction fusion, instead of an einsum, which XLA made a GEMM fusion
that took 41 us under Nsight Compute for 17 MB (`key_bias.KEY_PRODUCTS`).

A second setting of v34, not yet timed on a GPU: `value_operand="registers"` hands the value
codes to wgmma from registers, built from two tokens' words by one byte permute and one AND per
register, instead of staging a [block, D] bf16 tile in shared memory for the tensor core to read
back (`value_operand_registers`): v34's profile found shared memory the kernel's busiest unit.
The accumulator's rows are then channels in order whatever `operand_order` says.

A setting of v35, not yet timed on a GPU: `key_bias_source="kernel"` has each program compute
q . k_min for its split's key groups itself, before its loop: one TMA copy of the split's
minimums into the code tile and one wgmma against the queries split into two bf16 halves per
64 key groups, into a [split groups, rows] f32 buffer the loop reads instead of a key-bias ring
slot (`key_bias_in_kernel`). XLA's GEMM fusion and the 2 MB of bias it wrote go; the kernel
reads k_min's 17 MB instead. With row_max="bound" the program computes its split's softmax
references too (a second copy, of k_scale, and product per chunk, and the bounds' maxima across
the warps), so that XLA computes no product for the kernel at all. The planner makes each split
a multiple of 8 key groups for it (the copy into the swizzled tile starts on a whole tile).

A setting of v36, not yet timed on a GPU: `split_merge="triton"` merges the splits' partials,
picks each channel's value slot and position and writes the rows in channel order in one Triton
kernel (`split_merge_triton`) instead of XLA's four (the log-sum-exp, the weights, the weighted
sum and the pick with its transpose). Two more of v36, also untimed:
`value_stat_loads="own_slot"` has each lane load only its own value slot's scales and minimums
(`value_stats_own_slot`: half the 16-bit loads and conversions, no select between slots; the
loop's slowest warp 459 -> 413 instructions per 64 tokens at v34's default by the sm_90a static
count), and `copy_issuer="spread"` has each warp issue a share of the block's copies (459 -> 435
there, for a longer mean).

A setting of v37, not yet timed on a GPU: `blocks_per_copy=2` (or 4) makes each ring slot hold
that many blocks: the first warp issues a slot's TMA copies, and every warp waits for its
barrier, once per slot, and the loop's body computes the slot's blocks one after another, each
from its offset in the slot (`BLOCKS_PER_COPY`). The planner gives each split whole slots; a
row's last slot may hold blocks past its length, which run with every token masked.

A second setting of v37, not yet timed on a GPU: `token_order="spread"` (with register value
codes) puts the value product's tokens in an order where the upper two token pairs of each 8
swap (`spread_token_order`): the register value operand's 32-bit loads then hit every bank once
instead of two token rows per bank (a 2-way conflict on each of them at head_dim 128 and 2
bits, `benchmarks/shared_bank_conflicts.py`), and P' takes the same order by a butterfly
shuffle of its rows before it is stored. Scores, masks and statistics keep the ring's order.

A setting of v40, not yet timed on a GPU: `key_stack_timing="block_ahead"` (with row_max="bound"
and both code operands from registers) stages the next block's Q' together with this block's P',
before the one barrier that publishes both, so that a block of "bound"'s fixed arm has one
barrier instead of two; Q' and P' then take two buffers each, by block parity
(`KEY_STACK_TIMINGS`: why two make the one barrier enough). The fixed arm by the sm_90a static
count: 368 -> 370 instructions per 64 tokens, 112 -> 109 registers, the same 55 KB of shared
memory (the doubled buffers sit in the union with the kernel's bias prologue). A second one:
`copy_issue_point="value_product"` refills each ring slot right after its last block's value
product is issued, so that the copying warp's instructions run in that product's shadow rather
than ahead of every block's barrier (`COPY_ISSUE_POINTS`): 368 -> 361, 114 registers; both
settings 383, 111 registers.

A setting of v41, not yet timed on a GPU: `value_product_columns="own_tiles"` (with the value
product's rows in channel order) multiplies each 64-channel row tile of the value product by the
P' tiles of its own channels' value groups only (`value_product_tiles`): at 4 query heads per KV
head one tile of the two, N 16 -> 8 per product and a carried accumulator [D, 8]; the fixed arm
368 -> 358 instructions per 64 tokens, 116 registers, four programs per SM.

A setting of v43, not yet timed on a GPU: `value_operand="matrix_loads"` builds the register
value operand by `ldmatrix.trans` (`value_operand_matrix_loads`): each lane receives the same
half-word of two consecutive tokens in one register, so a shift and an AND per operand register
replace v34's two 32-bit loads and byte permute. The rows of the value product then come in the
loads' own order (`value_row_order`: the epilogue takes each row's channel from it, the merges
read each channel at its row), and the value ring is TMA-swizzled a token row wide, so that the
matrices' rows fall on distinct banks. The slowest warp by the sm_90a static count: C 368 -> 339
instructions per 64 tokens, C at two blocks per slot 324.5 -> 299.5 (127 registers).

The codes are staged for the tensor core by masking alone (`subnormal_codes`): a code c masked in
place at bit q of a 16-bit half is the bf16 number c * 2^(q - 133), and the powers of two go to
the queries, the probabilities and the output scale. A word's two 16-bit halves hold channels
c and c + D/2 (fields j and j + n/2 of the planar packing), so the low halves of the n/2 pairs,
side by side, are channels [0, D/2) in order and the high halves [D/2, D): the staged tiles are in
channel order, the order the statistics arrive in, and nothing is permuted.

In interpret mode (CPU, where XLA flushes subnormals to zero) each masked pattern m is staged as
the bf16 number m instead and the powers of two change to match (`_Exponents`): the same products
within f32 rounding, without a subnormal anywhere. That the tensor cores take subnormal bf16
operands exactly is checked only natively (it is for the Triton kernels, v9).

Slots past a row's length may hold anything, NaN included: scores past it are masked to -inf
before the softmax, a key group starting past it is picked by no valid token (selects, not
products, keep its NaN statistics out), and P' and the value-minimum terms are zeroed past it
(codes are integers; statistics are not). Statistics must be bfloat16 (the folded operands are
bf16 products); 2- and 4-bit codes; whole key groups per block.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import (
  _compat,
  key_bias_in_kernel,
  value_operand_matrix_loads,
  value_operand_registers,
  value_row_order,
  warpgroup_reductions,
)
from pallas_kernels import quantized_decode_attention_mosaic_gpu as dequantizing
from pallas_kernels.base_two_softmax import base_two_queries
from pallas_kernels.decode_attention_mosaic_gpu import (
  LENGTH_WORDS,
  SHARED_MEMORY_BYTES,
  initial_softmax_state,
  normalised_partials,
  padded_lengths,
  softmax_step_numerators,
  split_bounds,
  swizzled_operand_transforms,
  tile_rows,
  write_partials,
)
from pallas_kernels.float_unpacking import bf16_halves
from pallas_kernels.key_bias import (
  DEFAULT_KEY_PRODUCT,
  check_key_product,
  key_bias,
)
from pallas_kernels.key_bias_in_kernel import (
  DEFAULT_KEY_BIAS_SOURCE,
  any_row_exchanges,
  bias_chunks,
  check_key_bias_source,
  copies_per_chunk,
  queries_with_halves,
  split_blocks_multiple,
  split_key_groups,
  split_key_statistics,
)
from pallas_kernels.own_slot_partials import (
  DEFAULT_PARTIAL_SLOTS,
  check_partial_slots,
  slot_first_column,
  write_own_slot_partials,
)
from pallas_kernels.quantized_decode_attention_mosaic_gpu import (
  CHUNK_TOKENS,
  fetch_block,
  wgmma_layout,
)
from pallas_kernels.softmax_reference_bounds import (
  EXCHANGE,
  key_score_bounds,
  split_softmax_references,
)
from pallas_kernels.split_merge_triton import (
  DEFAULT_SPLIT_MERGE,
  check_split_merge,
  merge_value_slot_partials_reference,
  merge_value_slot_partials_triton,
  pick_value_slots,
  pop_split_merge,
)
from pallas_kernels.splits import (
  SplitPlan,
  cdiv,
  gpu_target_programs,
  next_power_of_two,
  pad_query_group,
  plan_splits,
)
from pallas_kernels.spread_token_order import (
  DEFAULT_TOKEN_ORDER,
  check_token_order,
  spread_rows,
  spread_rows_emulated,
  token_order_unsupported_reason,
)
from pallas_kernels.subnormal_codes import (
  PROBS_EXPONENT,
  QUERY_EXPONENT,
  code_exponent,
  masked_code_pairs,
  power_of_two,
)
from pallas_kernels.value_operand_matrix_loads import (
  MATRIX_LOADS,
  value_operand_from_matrix_loads,
)
from pallas_kernels.value_operand_registers import (
  DEFAULT_VALUE_OPERAND,
  value_operand_from_registers,
  value_operand_unsupported_reason,
)
from pallas_kernels.value_product_tiles import (
  DEFAULT_VALUE_PRODUCT_COLUMNS,
  ROW_TILE,
  accumulator_tiles,
  check_value_order,
  check_value_product_columns,
  first_tile_of_channel,
  row_tile_value_tiles,
  uneven_row_tiles_reason,
)
from pallas_kernels.value_stats_own_slot import (
  DEFAULT_VALUE_STAT_LOADS,
  check_value_stat_loads,
  own_slot_statistics,
  own_slot_unsupported_reason,
)
from pallas_kernels.word_operand_order import (
  OPERAND_ORDERS,
  channels_in_word_order,
  load_channels_in_word_order,
  stage_words_in_word_order,
  word_order_unsupported_reason,
)

SUPPORTED_BITS = (2, 4)  # two fields of a word per pair of bf16 operands, each below bit 8
MAX_STACK = 256  # wgmma's largest N
DEFAULT_BLOCK_TOKENS = 128
# The one reduction over tokens left in the loop is the row max: 2 registers per thread (up to 8
# rows) cross the four warps in one round. The sums over tokens run once, after the loop.
REDUCTION_SCRATCH_BYTES = 1024
_SHARED_MEMORY_ALIGNMENT = 1024  # Pallas Mosaic GPU's, per scratch buffer
# A TMA copy's shared-memory destination must start on a 128-byte boundary (cp.async.bulk.tensor).
# Every ring slot after the first starts at slot x its bytes, so each slot's bytes must be a
# multiple of it: a 64-byte key-bias slot (block 64, 8 rows) faulted with
# CUDA_ERROR_MISALIGNED_ADDRESS on an H200 (KERNEL_NOTES v29).
TMA_SLOT_ALIGNMENT = 128
# Where the key product's code operand comes from: staged through the code tile in shared memory
# (v14 on), or handed to wgmma from the registers the unpacking leaves it in (v30: the key codes
# then never touch shared memory as bf16, 32 KB of stores and the tensor core's reads of them per
# 128-token block; the value codes cannot, wgmma takes a register operand untransposed only).
KEY_OPERANDS = ("shared_memory", "registers")
DEFAULT_KEY_OPERAND = "shared_memory"
# Where the value product's code operand comes from: staged, from registers built by 32-bit
# loads and byte permutes (v34, channel order), or by transposing matrix loads (v43, its own
# row order: `value_operand_matrix_loads`).
VALUE_OPERANDS = (*value_operand_registers.VALUE_OPERANDS, MATRIX_LOADS)
REGISTER_VALUE_OPERANDS = ("registers", MATRIX_LOADS)
# Column order of the staged code operands (`word_operand_order`): "channel" joins the halves of
# two words into each operand register (a byte permute each), "word" takes each masked word as a
# register and permutes the queries, key scales and output instead (v30).
DEFAULT_OPERAND_ORDER = "channel"
# Who issues each block's TMA copies. One thread does either way; with "warpgroup" (v14 on) all
# four warps compute the copies' addresses and barrier arrivals, one barrier per copy; with
# "first_warp" (v31) only the first warp does, in warp semantics (`plgpu.warp_map`), and the
# block's copies arrive on one barrier per ring slot, so each warp waits once per block instead
# of five times. sm_90a static count at block 64 with the v30 default's settings: 535 -> 399
# instructions per 64 tokens in three of the four warps (461 in the first), 128 -> 109 registers.
# "spread" (v36): each warp issues a share of the copies (stream s by warp s % 4), in warp
# semantics, on the same barrier per ring slot as "first_warp": the barriers at each block wait
# for the slowest warp, which with "first_warp" is the first one, 69 instructions per 64 tokens
# longer than the others at v34's default (sm_90a static count, KERNEL_NOTES v36).
COPY_ISSUERS = ("warpgroup", "first_warp", "spread")
WARPS = 4  # of the one warpgroup a program runs
DEFAULT_COPY_ISSUER = "warpgroup"
# Where each block's value product goes: into a zeroed accumulator, added to the running one
# after it (v14 on: 16 registers zeroed and 16 fused multiply-adds per thread and block at the
# shapes of record), or into the running accumulator itself, rescaled before the product (v31:
# 16 multiplies; static count at the v30 default's settings with the first warp issuing: 461 ->
# 444 instructions per 64 tokens, registers unchanged).
VALUE_ACCUMULATORS = ("fresh", "carried")
DEFAULT_VALUE_ACCUMULATOR = "fresh"
# How the value statistics reach the kernel. The caches hold them token-major, [B, H, T, D / g]
# bf16 scales and minimums; TMA needs them group-major. "pairs" (v19 on): the wrapper packs each
# token's (scale, minimum) into one uint32, [B, H, D / g, T], one 32-bit load per group and token
# in the kernel. "separate" (v32): the two bf16 arrays group-major, two copies and two 16-bit
# loads. In a loop XLA carries the cache's statistics in the group-major layout (the transposes
# become layout, run once before the loop), but the packing is a computation on them: at 32k,
# batch 8, one 67 MB pass per call inside the loop, beside the kernel's 195 MB (the benchmark's
# timed loop compiled for an H100; `benchmarks/xla_kernel_bytes.py`). "separate" has no pass.
VALUE_STATS = ("pairs", "separate")
DEFAULT_VALUE_STATS = "pairs"
# The softmax's reference per row. "exchange": the online softmax's running max, whose reduction
# over tokens crosses the four warps through shared memory at every block (the largest single
# stall in v30's profile). "bound" (v33): a fixed reference per split from the key statistics'
# bounds on the scores, computed by XLA before the kernel (`softmax_reference_bounds`): no max,
# no rescaling in the loop; a split the bounds cannot serve (1.5-2% of SmolLM2's) takes the
# "exchange" branch of the loop's body at every block, chosen per program.
ROW_MAXES = ("exchange", "bound")
DEFAULT_ROW_MAX = "exchange"
# Where q . k_min per key group is computed (`key_bias_in_kernel`): by XLA before the kernel, the
# bias read per block through the ring ("xla", v19 on), or by each program before its loop on the
# tensor core ("kernel", v35; with row_max="bound" the softmax references too).
# Which value statistics each lane loads (`value_stats_own_slot`): every value group's, each
# tile's columns picking their group by a select ("all_groups", v32 on), or per value tile only
# the group of the lane's own columns ("own_slot", v36; natively only, interpret mode selects).
# How many compute blocks each ring slot holds (v37): one (v14 on), or two or four, the block's
# TMA copies then issued, and their barrier waited for, once per slot instead of once per block,
# with the slot's blocks computed one after another from it. The first warp's copies were 65 of
# its 368 instructions per 64 tokens in v36's candidate (sm_90a static count), the others' 303:
# the block's barriers wait for the slowest warp. Each copy is also that many times larger (2 KB
# of codes per 64 tokens at the shapes of record). The ring's tokens in flight are
# num_stages * blocks_per_copy blocks: two stages of two blocks take the shared memory of four
# of one.
BLOCKS_PER_COPY = (1, 2, 4)
DEFAULT_BLOCKS_PER_COPY = 1
# The order of the tokens on the value product's K side (`spread_token_order`, v37): the ring's
# ("natural"), or with the upper token pairs of each 8 swapped ("spread"), so that the register
# value operand's 32-bit loads hit every bank once instead of two rows per bank.
# Which value slots' columns of its output the kernel writes (`own_slot_partials`, v38): every
# slot's, f32 [B, H, S, D, rows] ("every"), or each channel's own, picked in the epilogue, f32
# [B, H, S, real_rows, D] ("own": half the bytes at 3-4 query heads per KV head).
# When each block's Q' is staged (v40). "own_block": at the block's start, then a barrier before
# the key product and another before the value product: two per block in "bound"'s fixed arm.
# "block_ahead": the next block's Q' is staged with this block's P', before the one barrier that
# publishes both, so a block has one barrier. Q' and P' then take two buffers each, by block
# parity: a warp's wgmma wait covers only its own share of a product, so a buffer is rewritten
# only after a barrier that every warp reached after its wait for the last product reading it
# (Q' of block i + 1 was last read by block i - 1's key product, P' of block i by block i - 2's
# value product). It needs what makes the single barrier enough: both code operands from
# registers (no code tile) and row_max="bound" (Q' and P' in buffers of their own); and a ring
# of at least two slots (every Mosaic GPU kernel's `NUM_STAGES`), so that the next slot's copies
# are in flight while a slot's last block stages the next Q' from it.
KEY_STACK_TIMINGS = ("own_block", "block_ahead")
DEFAULT_KEY_STACK_TIMING = "own_block"
# Where in a ring slot's steps its refill is issued (v40). "slot_start": the copies of the slot
# num_stages - 1 ahead, into the slot the previous step freed, at the step's start, before its
# first block's key product: with copy_issuer="first_warp" that warp reaches each block's
# barrier ~64 instructions per 64 tokens after the others (sm_90a static count), and they wait
# for it. "value_product": the freed slot refilled right after the last block's value product is
# issued, so that the copies' instructions run while the tensor core computes it (its shadow
# was empty in "block_ahead"'s SASS); the slot is free there (every warp's reads of it precede
# that block's last barrier), and the loop starts with every slot's copies issued.
COPY_ISSUE_POINTS = ("slot_start", "value_product")
DEFAULT_COPY_ISSUE_POINT = "slot_start"
# Warpgroups per program (v42), each on a split of its own with buffers and barriers of its own.
# The point is the launch: a program of K warpgroups has K x 128 threads, and ptxas fits a
# kernel launched that wide into 65536 / (K x 128) registers per thread (granted in units of
# 8): at K = 5, 96, the most with which an SM holds 20 warps, five per scheduler, where one
# warpgroup per program compiles to 103 registers and four programs (KERNEL_NOTES v41, v42).
# Mosaic GPU sets nothing else that bounds the registers (`.minnctapersm 1`). Each warpgroup
# runs its own copy of the code (`_warpgroup_program`); their reductions over rows use scratch
# of their own (`warpgroup_reductions`).
WARPGROUPS_PER_PROGRAM = tuple(range(1, 9))  # up to 1024 threads
DEFAULT_WARPGROUPS_PER_PROGRAM = 1
# The kernel's own settings (`check_folded_settings`), beside the launch settings it shares.
KERNEL_SETTINGS = (
  "key_operand",
  "operand_order",
  "approx_math",
  "copy_issuer",
  "value_accumulator",
  "value_stats",
  "row_max",
  "key_products",
  "value_operand",
  "key_bias_source",
  "value_stat_loads",
  "blocks_per_copy",
  "token_order",
  "partial_slots",
  "key_stack_timing",
  "copy_issue_point",
  "value_product_columns",
  "warpgroups_per_program",
)
# What the entry points take besides: who merges the splits' partials after the kernel
# (`split_merge_triton`), XLA's fusions ("xla": four kernels of the decode loop) or one Triton
# kernel ("triton", v36).
FOLDED_SETTINGS = (*KERNEL_SETTINGS, "split_merge")
_SUBNORMAL_UNIT_EXPONENT = 133  # bf16 pattern m < 0x100 is m * 2^-133


@dataclasses.dataclass(frozen=True)
class _Exponents:
  """Powers of two that keep the products exact: a staged code c at bit q is c * 2^(q - code)."""

  code: int  # 133 natively (subnormal patterns), 0 emulated (the pattern read as an integer)
  query: int  # Q' carries 2^(query - q) per channel
  probs: int  # P' carries 2^probs

  @classmethod
  def for_run(cls, emulate: bool) -> "_Exponents":
    if emulate:
      return cls(code=0, query=0, probs=0)
    return cls(code=_SUBNORMAL_UNIT_EXPONENT, query=QUERY_EXPONENT, probs=PROBS_EXPONENT)


def value_slots(group: int) -> tuple[int, int]:
  """(real rows, slots): the query group padded to a power of two, and how many value groups
  share one `tile_rows(group)`-column tile of the value product, side by side."""
  real_rows = next_power_of_two(group)
  return real_rows, tile_rows(group) // real_rows


def stacks(block_tokens: int, head_dim: int, group_size: int, group: int) -> tuple[int, int]:
  """(N of the key product, N of the value product): `tile_rows` columns per key group of a
  block; per value tile, `value_slots` value groups of the head side by side."""
  rows = tile_rows(group)
  _, slots = value_slots(group)
  value_tiles = -(-(head_dim // group_size) // slots)
  return block_tokens // group_size * rows, value_tiles * rows


def unsupported_reason(
  queries,
  k_codes,
  k_scale,
  v_scale,
  *,
  bits,
  group_size,
  block_tokens=None,
  operand_order=None,
  value_operand=None,
  key_bias_source=None,
  num_splits=None,
  blocks_per_copy=None,
  value_stat_loads=None,
  **segment,
) -> str | None:
  """Why this kernel cannot take this segment with these settings (None if it can); the
  dequantizing Mosaic GPU kernel's limits, and its own. (A setting that needs another, such as
  "own_slot" statistics loads without value_stats="separate", is refused by the kernel.)"""
  reason = dequantizing.unsupported_reason(
    queries, k_codes, k_scale, v_scale, bits=bits, group_size=group_size, **segment
  )
  if reason is not None:
    return reason
  if bits not in SUPPORTED_BITS:
    return f"bits={bits} (the folded variant takes {SUPPORTED_BITS})"
  if jnp.dtype(k_scale.dtype) != jnp.bfloat16:
    return f"statistics dtype {k_scale.dtype} (the folded variant takes bfloat16)"
  head_dim = queries.shape[3]
  if head_dim % group_size:
    return f"group_size={group_size} does not divide head_dim={head_dim}"
  block = block_tokens or DEFAULT_BLOCK_TOKENS
  if block % group_size:
    return f"group_size={group_size} with block_tokens={block} (whole key groups per block)"
  if max(stacks(block, head_dim, group_size, queries.shape[2])) > MAX_STACK:
    return (
      f"query group {queries.shape[2]} with group_size={group_size}: a stacked operand would "
      f"have more than {MAX_STACK} rows"
    )
  if operand_order == "word" and (reason := word_order_unsupported_reason(head_dim, bits)):
    return reason
  if value_operand == "registers" and (reason := value_operand_unsupported_reason(head_dim, block)):
    return reason
  if value_operand == MATRIX_LOADS and (
    reason := value_operand_matrix_loads.unsupported_reason(head_dim, bits, block)
  ):
    return reason
  if value_stat_loads == "own_slot":
    group = queries.shape[2]
    reason = own_slot_unsupported_reason(tile_rows(group), value_slots(group)[0], "separate")
    if reason is not None:
      return reason
  if key_bias_source == "kernel":
    plan = folded_split_plan(
      queries,
      k_codes,
      block,
      num_splits,
      group_size=group_size,
      key_bias_source=key_bias_source,
      blocks_per_copy=blocks_per_copy,
    )
    return key_bias_in_kernel.unsupported_reason(plan.split_tokens, group_size)
  return None


def folded_split_plan(
  queries,
  k_codes,
  block_tokens,
  num_splits,
  *,
  group_size,
  key_bias_source,
  blocks_per_copy=DEFAULT_BLOCKS_PER_COPY,
) -> SplitPlan:
  """The split plan of a segment (`plan_splits`): each split a whole number of ring slots of
  `blocks_per_copy` blocks (so that no copy reaches into the next split, and only a row's last
  slot may hold a block past its length); with key_bias_source="kernel" also a multiple of 8
  key groups (`key_bias_in_kernel.split_blocks_multiple`)."""
  multiple = blocks_per_copy or DEFAULT_BLOCKS_PER_COPY
  if key_bias_source == "kernel":
    multiple = math.lcm(multiple, split_blocks_multiple(block_tokens, group_size))
  return plan_splits(
    k_codes.shape[2],
    block_tokens,
    queries.shape[0] * queries.shape[1],
    num_splits,
    gpu_target_programs(),
    blocks_multiple=multiple,
  )


def key_bias_slot_groups(key_groups: int, rows: int) -> int:
  """Key groups one key-bias ring slot holds: a block's, padded so that the slot's f32 [groups,
  rows] is a whole number of `TMA_SLOT_ALIGNMENT` bytes. The copy fills the first `key_groups`."""
  step = TMA_SLOT_ALIGNMENT // math.gcd(TMA_SLOT_ALIGNMENT, rows * 4)
  return -(-key_groups // step) * step


def ring_slot_shapes(
  group,
  head_dim,
  bits,
  group_size,
  slot_tokens,
  value_stats=DEFAULT_VALUE_STATS,
  key_bias_source=DEFAULT_KEY_BIAS_SOURCE,
) -> dict:
  """{ring buffer: (shape of one slot, dtype)}: what TMA writes per slot of `slot_tokens` tokens
  (a block, or `blocks_per_copy` of them) and stage, in the order the copies are issued. No
  key-bias slots when the kernel computes the bias itself."""
  words = head_dim * bits // 32
  rows = tile_rows(group)
  key_groups = slot_tokens // group_size
  value_groups = head_dim // group_size
  if value_stats == "pairs":  # (scale, minimum) bf16 pairs, group-major
    value_statistics = dict(v_stats_smem=((value_groups, slot_tokens), jnp.uint32))
  else:  # scales and minimums, each group-major
    value_statistics = dict(
      v_scale_smem=((value_groups, slot_tokens), jnp.bfloat16),
      v_min_smem=((value_groups, slot_tokens), jnp.bfloat16),
    )
  key_bias_ring = {}
  if key_bias_source == "xla":
    key_bias_ring = dict(
      key_bias_smem=((key_bias_slot_groups(key_groups, rows), rows), jnp.float32)
    )
  return dict(
    k_words_smem=((slot_tokens, words), jnp.uint32),
    k_scale_smem=((key_groups, head_dim), jnp.bfloat16),
    **key_bias_ring,
    v_words_smem=((slot_tokens, words), jnp.uint32),
    **value_statistics,
  )


def shared_memory_bytes(
  group,
  head_dim,
  bits,
  group_size,
  block_tokens,
  num_stages,
  value_stats=DEFAULT_VALUE_STATS,
  row_max=DEFAULT_ROW_MAX,
  code_tile=True,
  key_bias_source=DEFAULT_KEY_BIAS_SOURCE,
  split_groups=0,
  blocks_per_copy=DEFAULT_BLOCKS_PER_COPY,
  partial_slots=DEFAULT_PARTIAL_SLOTS,
  key_stack_timing=DEFAULT_KEY_STACK_TIMING,
  warpgroups_per_program=DEFAULT_WARPGROUPS_PER_PROGRAM,
):
  """Bytes of shared memory one program allocates, each buffer rounded up to the 1024-byte
  alignment Pallas gives it (an upper bound: 72704 for the shapes of record, which compile to
  71680). Q' and P' share one buffer unless row_max="bound" (`_folded_kernel`'s scratch); the
  code tile only where codes are staged (`needs_code_tile`). With key_bias_source="kernel"
  (`key_bias_in_kernel`; `split_groups` key groups per split) the bias buffer, and the query
  halves and k_min tile (the code tile, if there is one) in the union with Q' and P'. Ring slots
  hold `blocks_per_copy` blocks each. The queries' buffer is the larger of the queries (f32
  [D, rows], or bf16 [rows, D] with the kernel's bias) and the output (f32 [D, rows], or
  [real_rows, D] with partial_slots="own"), which share it. With key_stack_timing="block_ahead"
  Q' and P' take two buffers each. With `warpgroups_per_program` K above 1 all of it K times
  over, each warpgroup's reduction scratch its own (`warpgroup_reductions`) instead of the
  program's one."""
  rows = tile_rows(group)
  key_rows, value_rows = stacks(block_tokens, head_dim, group_size, group)
  slot_tokens = block_tokens * blocks_per_copy
  ring_slots = ring_slot_shapes(
    group, head_dim, bits, group_size, slot_tokens, value_stats, key_bias_source
  )
  ring = [math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype in ring_slots.values()]
  query_bytes = head_dim * rows * (2 if key_bias_source == "kernel" else 4)
  output_rows = value_slots(group)[0] if partial_slots == "own" else rows
  buffers = [num_stages * size for size in ring] + [
    LENGTH_WORDS * 4,
    max(query_bytes, head_dim * output_rows * 4),  # the queries, then the output
  ]
  if code_tile:
    buffers.append(block_tokens * head_dim * 2)  # one bf16 code tile: K, then V
  stack_buffers = stack_buffer_count(key_stack_timing)
  stack_bytes = (  # Q', P'
    stack_buffers * key_rows * head_dim * 2,
    stack_buffers * value_rows * block_tokens * 2,
  )
  barriers = 2 + len(ring) * num_stages  # one per ring buffer and stage, at most
  if key_bias_source == "kernel":
    bound = row_max == "bound"
    prologue = _aligned((4 if bound else 2) * rows * head_dim * 2)  # the query halves
    if not code_tile:  # the statistics' tile
      prologue += block_tokens * head_dim * 2
    chunks = bias_chunks(split_groups, block_tokens)
    buffers.append(chunks * block_tokens * rows * 4)  # the split's bias
    barriers += chunks * copies_per_chunk(bound)
    # Q' and P' (side by side with "bound") in a union with the prologue's buffers
    buffers.append(max(sum(map(_aligned, stack_bytes)) if bound else max(stack_bytes), prologue))
  elif row_max == "bound":
    buffers += list(stack_bytes)
  else:
    buffers.append(max(stack_bytes))
  buffers += [rows * 4]  # lse
  buffers.append(8 * barriers)
  if warpgroups_per_program == 1:
    return sum(map(_aligned, [*buffers, REDUCTION_SCRATCH_BYTES]))
  own = sum(map(_aligned, [*buffers, 4 * warpgroup_reductions.SCRATCH_WORDS]))
  return warpgroups_per_program * own


def stack_buffer_count(key_stack_timing: str) -> int:
  """Buffers of Q' and of P' each: two, by block parity, with "block_ahead"
  (`KEY_STACK_TIMINGS`)."""
  return 2 if key_stack_timing == "block_ahead" else 1


def _aligned(size: int) -> int:
  """`size` rounded up to the alignment Pallas gives each shared-memory buffer."""
  return cdiv(size, _SHARED_MEMORY_ALIGNMENT) * _SHARED_MEMORY_ALIGNMENT


def needs_code_tile(key_operand: str, value_operand: str, emulate: bool) -> bool:
  """Whether a program stages codes in its shared-memory code tile: natively not when both
  products take their codes from registers (16 KB less at head_dim 128 and block 64);
  interpret mode stages every operand."""
  return emulate or "shared_memory" in (key_operand, value_operand)


def needs_block_start_barrier(
  key_operand: str, value_operand: str, row_max: str, emulate: bool
) -> bool:
  """Whether each block starts with a barrier (`commit_smem`) before it writes shared memory.

  It guards what the previous block's value product read: the code tile, and P' where Q' and P'
  share a buffer (row_max="exchange"), since the next block's staged codes and Q' overwrite
  them and each warp has waited only for its own share of the product. With no code tile (both
  code operands from registers) and Q' and P' in buffers of their own ("bound"), nothing needs
  it: Q' was last read by the previous block's key product, which every warp waited for before
  that block's barrier after P' (v35: the fixed arm's barriers per block 3 -> 2). The ring needs
  none either way: a slot's last reads (codes and statistics) come before that barrier too."""
  return needs_code_tile(key_operand, value_operand, emulate) or row_max == "exchange"


def check_folded_settings(
  *,
  key_operand=DEFAULT_KEY_OPERAND,
  operand_order=DEFAULT_OPERAND_ORDER,
  approx_math=False,
  copy_issuer=DEFAULT_COPY_ISSUER,
  value_accumulator=DEFAULT_VALUE_ACCUMULATOR,
  value_stats=DEFAULT_VALUE_STATS,
  row_max=DEFAULT_ROW_MAX,
  key_products=DEFAULT_KEY_PRODUCT,
  value_operand=DEFAULT_VALUE_OPERAND,
  key_bias_source=DEFAULT_KEY_BIAS_SOURCE,
  value_stat_loads=DEFAULT_VALUE_STAT_LOADS,
  blocks_per_copy=DEFAULT_BLOCKS_PER_COPY,
  token_order=DEFAULT_TOKEN_ORDER,
  partial_slots=DEFAULT_PARTIAL_SLOTS,
  key_stack_timing=DEFAULT_KEY_STACK_TIMING,
  copy_issue_point=DEFAULT_COPY_ISSUE_POINT,
  value_product_columns=DEFAULT_VALUE_PRODUCT_COLUMNS,
  warpgroups_per_program=DEFAULT_WARPGROUPS_PER_PROGRAM,
  split_merge=DEFAULT_SPLIT_MERGE,
) -> None:
  """ValueError naming the first of this kernel's own settings outside its allowed values, or a
  pair of them that does not go together (the checks that need no shapes; the dispatch runs them
  on a kernel_config too)."""
  if key_operand not in KEY_OPERANDS:
    raise ValueError(f"key_operand={key_operand!r} is not supported; allowed: {KEY_OPERANDS}")
  if operand_order not in OPERAND_ORDERS:
    raise ValueError(f"operand_order={operand_order!r} is not supported; allowed: {OPERAND_ORDERS}")
  if not isinstance(approx_math, bool):
    raise ValueError(f"approx_math={approx_math!r} is not supported; allowed: (False, True)")
  if copy_issuer not in COPY_ISSUERS:
    raise ValueError(f"copy_issuer={copy_issuer!r} is not supported; allowed: {COPY_ISSUERS}")
  if value_accumulator not in VALUE_ACCUMULATORS:
    raise ValueError(
      f"value_accumulator={value_accumulator!r} is not supported; allowed: {VALUE_ACCUMULATORS}"
    )
  if value_stats not in VALUE_STATS:
    raise ValueError(f"value_stats={value_stats!r} is not supported; allowed: {VALUE_STATS}")
  if row_max not in ROW_MAXES:
    raise ValueError(f"row_max={row_max!r} is not supported; allowed: {ROW_MAXES}")
  check_key_product(key_products)
  if value_operand not in VALUE_OPERANDS:
    raise ValueError(f"value_operand={value_operand!r} is not supported; allowed: {VALUE_OPERANDS}")
  check_key_bias_source(key_bias_source)
  check_split_merge(split_merge)
  check_value_stat_loads(value_stat_loads)
  check_blocks_per_copy(blocks_per_copy)
  check_token_order(token_order)
  if reason := token_order_unsupported_reason(token_order, value_operand):
    raise ValueError(reason)
  check_partial_slots(partial_slots)
  check_key_stack_timing(key_stack_timing, row_max, key_operand, value_operand)
  if copy_issue_point not in COPY_ISSUE_POINTS:
    raise ValueError(
      f"copy_issue_point={copy_issue_point!r} is not supported; allowed: {COPY_ISSUE_POINTS}"
    )
  check_value_product_columns(value_product_columns)
  check_value_order(value_product_columns, value_output_order(operand_order, value_operand))
  check_warpgroups_per_program(warpgroups_per_program)
  if key_bias_source == "kernel" and key_products != DEFAULT_KEY_PRODUCT:
    raise ValueError(
      f"key_products={key_products!r} sets how XLA computes the key products; with "
      f"key_bias_source='kernel' the kernel computes them (the bias, and with row_max='bound' "
      f"the bounds) and XLA none: leave it at {DEFAULT_KEY_PRODUCT!r}"
    )


def check_key_stack_timing(key_stack_timing, row_max, key_operand, value_operand) -> None:
  """ValueError unless `key_stack_timing` is one of KEY_STACK_TIMINGS, and for "block_ahead"
  unless the settings its single barrier per block relies on are set (`KEY_STACK_TIMINGS`)."""
  if key_stack_timing not in KEY_STACK_TIMINGS:
    raise ValueError(
      f"key_stack_timing={key_stack_timing!r} is not supported; allowed: {KEY_STACK_TIMINGS}"
    )
  if key_stack_timing != "block_ahead":
    return
  needed = dict(row_max="bound", key_operand="registers", value_operand="registers")
  given = dict(row_max=row_max, key_operand=key_operand, value_operand=value_operand)
  if value_operand in REGISTER_VALUE_OPERANDS:  # either register operand: no code tile
    given["value_operand"] = "registers"
  for name, value in needed.items():
    if given[name] != value:
      raise ValueError(
        f"key_stack_timing='block_ahead' needs {name}={value!r} (got {given[name]!r}): its one "
        f"barrier per block relies on Q' and P' in buffers of their own and no staged code tile"
      )


def check_warpgroups_per_program(warpgroups_per_program) -> None:
  """ValueError unless `warpgroups_per_program` is one of WARPGROUPS_PER_PROGRAM (an int, not a
  bool)."""
  if (
    isinstance(warpgroups_per_program, bool)
    or not isinstance(warpgroups_per_program, (int, np.integer))
    or warpgroups_per_program not in WARPGROUPS_PER_PROGRAM
  ):
    raise ValueError(
      f"warpgroups_per_program={warpgroups_per_program!r} is not supported; allowed: "
      f"{WARPGROUPS_PER_PROGRAM}"
    )


def check_blocks_per_copy(blocks_per_copy) -> None:
  """ValueError unless `blocks_per_copy` is one of BLOCKS_PER_COPY (an int, not a bool)."""
  if isinstance(blocks_per_copy, bool) or blocks_per_copy not in BLOCKS_PER_COPY:
    raise ValueError(
      f"blocks_per_copy={blocks_per_copy!r} is not supported; allowed: {BLOCKS_PER_COPY}"
    )


def check_config(
  group,
  head_dim,
  bits,
  group_size,
  *,
  block_tokens,
  num_stages,
  num_splits,
  split_groups=0,
  **folded_settings,
):
  """ValueError naming the setting and its allowed values; raised before anything is traced.
  `folded_settings`: this kernel's own (`KERNEL_SETTINGS`, `check_folded_settings`);
  `split_groups`: key groups per split (for key_bias_source="kernel")."""
  dequantizing.check_settings(
    block_tokens=block_tokens, num_splits=num_splits, num_stages=num_stages
  )
  check_folded_settings(**folded_settings)
  if folded_settings.get("value_stat_loads", DEFAULT_VALUE_STAT_LOADS) == "own_slot":
    reason = own_slot_unsupported_reason(
      tile_rows(group),
      value_slots(group)[0],
      folded_settings.get("value_stats", DEFAULT_VALUE_STATS),
    )
    if reason is not None:
      raise ValueError(f"{reason}; use value_stat_loads={DEFAULT_VALUE_STAT_LOADS!r}")
  _, value_rows = stacks(block_tokens, head_dim, group_size, group)
  reason = uneven_row_tiles_reason(
    folded_settings.get("value_product_columns", DEFAULT_VALUE_PRODUCT_COLUMNS),
    head_dim=head_dim,
    group_size=group_size,
    slots=value_slots(group)[1],
    value_tiles=value_rows // tile_rows(group),
  )
  if reason is not None:
    raise ValueError(reason)
  blocks_per_copy = folded_settings.get("blocks_per_copy", DEFAULT_BLOCKS_PER_COPY)
  warpgroups = folded_settings.get("warpgroups_per_program", DEFAULT_WARPGROUPS_PER_PROGRAM)
  needed = shared_memory_bytes(
    group,
    head_dim,
    bits,
    group_size,
    block_tokens,
    num_stages,
    folded_settings.get("value_stats", DEFAULT_VALUE_STATS),
    folded_settings.get("row_max", DEFAULT_ROW_MAX),
    needs_code_tile(
      folded_settings.get("key_operand", DEFAULT_KEY_OPERAND),
      folded_settings.get("value_operand", DEFAULT_VALUE_OPERAND),
      emulate=False,
    ),
    folded_settings.get("key_bias_source", DEFAULT_KEY_BIAS_SOURCE),
    split_groups,
    blocks_per_copy,
    folded_settings.get("partial_slots", DEFAULT_PARTIAL_SLOTS),
    folded_settings.get("key_stack_timing", DEFAULT_KEY_STACK_TIMING),
    warpgroups,
  )
  if needed > SHARED_MEMORY_BYTES:
    shorter_splits = ""
    if folded_settings.get("key_bias_source", DEFAULT_KEY_BIAS_SOURCE) == "kernel":
      shorter_splits = (
        f", or raise num_splits (key_bias_source='kernel' holds the bias of a split's "
        f"{split_groups} key groups)"
      )
    raise ValueError(
      f"block_tokens={block_tokens} with num_stages={num_stages}, "
      f"blocks_per_copy={blocks_per_copy} and warpgroups_per_program={warpgroups} needs "
      f"{needed} bytes of shared memory; at most {SHARED_MEMORY_BYTES} fit: lower one of "
      f"them{shorter_splits}"
    )


def _emulated_halves(masked):
  """uint32 words holding one masked code per 16-bit half -> (low, high) bf16: each pattern
  m < 0x100 as the number m (exact in bf16), for interpret mode."""
  halves = (masked & jnp.uint32(0xFFFF), lax.shift_right_logical(masked, jnp.uint32(16)))
  return tuple(half.astype(jnp.float32).astype(jnp.bfloat16) for half in halves)


def stage_codes(words, bits: int, emulate: bool):
  """uint32 [chunk, W] planar words -> bf16 [chunk, D] operands in channel order: field k of
  word w holds channel k W + w, and pair j = fields (j, j + n/2) sits in the word's two halves."""
  lows, highs = [], []
  for masked in masked_code_pairs(words, bits):
    low, high = _emulated_halves(masked) if emulate else bf16_halves(masked)
    lows.append(low)
    highs.append(high)
  return jnp.concatenate(lows + highs, axis=1)


def _staged_chunks(
  words_smem,
  *,
  slot,
  bits,
  emulate,
  operand_order,
  first_token=0,
  tokens=None,
  token_order=DEFAULT_TOKEN_ORDER,
) -> list:
  """Tokens [first_token, first_token + tokens) (default: all) of ring slot `slot` of
  `words_smem` ([stages, slot tokens, W] code words) as bf16 [64, D] register arrays in the wgmma
  layout, one per 64-token wgmma row tile, columns in `operand_order`, rows in `token_order`
  (spread: interpret mode's gather only)."""
  tokens = words_smem.shape[1] - first_token if tokens is None else tokens

  def stage(words):
    if operand_order == "channel":
      return stage_codes(words, bits, emulate)
    if emulate:  # the same operand, from the emulated channel-order staging
      head_dim = words.shape[1] * 32 // bits
      # built in the kernel: a Pallas kernel cannot close over an array constant
      rows = lax.iota(jnp.int32, head_dim)
      order = value_row_order.channel_of_row(rows, operand_order, head_dim, bits)
      return jnp.take(stage_codes(words, bits, emulate), order, axis=1)
    if operand_order == "matrix":  # natively the matrix loads build it in registers
      raise ValueError("the matrix-load row order is staged in interpret mode only")
    return stage_words_in_word_order(words, bits)

  def chunk_words(c):
    words = words_smem[slot, pl.ds(first_token + c * CHUNK_TOKENS, CHUNK_TOKENS), :]
    if token_order == "spread":  # staged only in interpret mode (`check_folded_settings`)
      words = spread_rows_emulated(words)
    return wgmma_layout(words)

  return [wgmma_layout(stage(chunk_words(c))) for c in range(tokens // CHUNK_TOKENS)]


def _stage_block(codes_smem, words_smem, **staging):
  """Stages a block of `words_smem`'s ring slot (`_staged_chunks`' keyword arguments: the slot,
  the block's first token, ...) into `codes_smem` ([block, D] bf16), one 64-token wgmma row
  tile at a time."""
  chunks = _staged_chunks(words_smem, tokens=codes_smem.shape[0], **staging)
  for c, chunk in enumerate(chunks):
    codes_smem[pl.ds(c * CHUNK_TOKENS, CHUNK_TOKENS), :] = chunk


def _folded_kernel(
  lengths_gmem,  # int32 [>= B]
  # f32 [B, H, D, rows]: q^T x sm_scale log2(e) x 2^(query - q), padding rows repeating; with
  # key_bias_source="kernel" bf16 [B, H, 2 or 4 * rows + rows, D]: the query halves, then these
  # queries as [rows, D], rounded to bf16 (`key_bias_in_kernel.queries_with_halves`)
  queries_gmem,
  k_codes_gmem,  # uint32 [B, H, T, W]
  k_scale_gmem,  # bf16 [B, H, T / group_size, D]
  # f32 [B, H, T / group_size, rows]: q . k_min per key group (`key_bias`); with
  # key_bias_source="kernel" the minimums themselves, bf16 [B, H, T / group_size, D]
  key_bias_gmem,
  v_codes_gmem,
  # The value statistics, group-major (`value_stats`): uint32 [B, H, D / group_size, T] (scale,
  # minimum) bf16 pairs, or the bf16 scales and minimums, each [B, H, D / group_size, T]; then
  # with row_max="bound" each split's softmax reference f32 [B, H, S, rows]
  # (`softmax_reference_bounds`; not with key_bias_source="kernel", which computes them); then
  # out f32 [B, H, S, D, rows] (channel c's rows in the slot of its value group), or with
  # partial_slots="own" [B, H, S, real_rows, D] (those rows alone), and lse f32 [B, H, S, rows].
  *value_stats_and_outputs,
  lengths_smem,
  # f32 [D, rows]: the queries, then the output (see `scratch_types`); with partial_slots="own"
  # or key_bias_source="kernel" a union of the queries (bf16 [rows, D] with the kernel's bias)
  # and the output (the own-slot rows f32 [real_rows, D] with "own")
  queries_smem,
  k_words_smem,  # [stages, block, W]
  k_scale_smem,  # [stages, KG, D]
  v_words_smem,
  # bf16 Q' [KG * rows, D] and P' [VG * rows, block] in one buffer; with key_bias_source="kernel"
  # the query halves [2 or 4 * rows, D] (and the k_min tile [block, D] without a code tile) too
  stacks_smem,
  lse_smem,
  barriers,
  key_bias_smem=None,  # [stages, >= KG, rows] (`key_bias_slot_groups`; "xla")
  split_bias_smem=None,  # f32 [chunks * block, rows]: the split's bias ("kernel")
  codes_smem=None,  # bf16 [block, D]: the staged key codes, then the value codes (if staged)
  v_stats_smem=None,  # uint32 [stages, VG, block] ("pairs")
  v_scale_smem=None,  # bf16 [stages, VG, block] ("separate")
  v_min_smem=None,
  # With several warpgroups per program (`_warpgroup_program`): this warpgroup's split and its
  # own reduction scratch, f32 [256] (`warpgroup_reductions`).
  split=None,
  reduction_smem=None,
  plan,
  tokens: int,
  num_stages: int,
  bits: int,
  group_size: int,
  real_rows: int,
  emulate: bool,
  key_operand: str,
  operand_order: str,
  copy_issuer: str,
  value_accumulator: str,
  value_stats: str,
  row_max: str,
  value_operand: str,
  key_bias_source: str,
  value_stat_loads: str,
  blocks_per_copy: int,
  token_order: str,
  partial_slots: str,
  key_stack_timing: str,
  copy_issue_point: str,
  value_product_columns: str,
):
  row, head = lax.axis_index("row"), lax.axis_index("head")
  if split is None:
    split = lax.axis_index("split")
  if reduction_smem is None:
    reduce_rows = warpgroup_reductions.shared_reduce_rows
  else:
    reduce_rows = functools.partial(
      warpgroup_reductions.reduce_rows, scratch_ref=reduction_smem, emulate=emulate
    )
  max_over_rows = functools.partial(reduce_rows, op="max")
  *value_stats_gmem, out_gmem, lse_gmem = value_stats_and_outputs
  # The queries' buffer, then the output's (`scratch_types`): one buffer, or a union of the two
  output_smem = queries_smem
  if partial_slots == "own" or key_bias_source == "kernel":
    queries_smem, output_smem = queries_smem
  if row_max == "bound" and key_bias_source == "xla":
    *value_stats_gmem, references_gmem = value_stats_gmem
  if value_stats == "pairs":
    value_stats_rings = (v_stats_smem,)
  else:
    value_stats_rings = (v_scale_smem, v_min_smem)
  lengths_barrier, queries_barrier, ring_barriers, *chunk_barriers = barriers
  block = plan.block_tokens
  if key_bias_source == "kernel":  # bf16 [rows, D]: read transposed
    rows, head_dim = queries_smem.shape
  else:
    head_dim, rows = queries_smem.shape
  if key_bias_source == "kernel" and row_max == "bound":
    (key_stack_smem, value_stack_smem), *prologue_smem = stacks_smem
  else:
    key_stack_smem, value_stack_smem, *prologue_smem = stacks_smem
  key_groups = block // group_size  # per block; a ring slot holds blocks_per_copy blocks' worth
  value_groups = value_stats_rings[0].shape[1]
  slots = rows // real_rows  # value groups per value tile (`value_slots`)
  # With "block_ahead" Q' and P' are [2, ...]: one buffer per block parity (`KEY_STACK_TIMINGS`).
  ahead = key_stack_timing == "block_ahead"
  value_tiles = value_stack_smem.shape[-2] // rows
  exponents = _Exponents.for_run(emulate)
  score_scale = 2.0 ** (exponents.code - exponents.query)
  probs_scale = 2.0**exponents.probs
  # The order of the value product's rows, the accumulator's: register value codes are built in
  # channel order whatever order the key side takes (`value_operand_registers`), matrix loads
  # in theirs (`value_operand_matrix_loads`).
  value_order = value_output_order(operand_order, value_operand)
  # Each 64-channel row tile's P' tiles (`value_product_tiles`): all of them, or its own.
  own_tiles = value_product_columns == "own_tiles"
  row_tiles = row_tile_value_tiles(head_dim, group_size, slots, value_tiles)
  acc_tiles = accumulator_tiles(value_product_columns, head_dim, group_size, slots, value_tiles)
  block_start_barrier = needs_block_start_barrier(key_operand, value_operand, row_max, emulate)

  plgpu.copy_gmem_to_smem(lengths_gmem, lengths_smem, lengths_barrier)
  if key_bias_source == "kernel":
    # One array, [2 or 4 * rows + rows, D] (`queries_with_halves`): the query halves, then the
    # key product's queries transposed, copied apart.
    ((query_halves_smem, *k_min_tile),) = prologue_smem
    # The k_min tile: the code tile where there is one (free until the loop's first staging).
    (k_min_tile_smem,) = k_min_tile if k_min_tile else (codes_smem,)
    key_bias_in_kernel.copy_queries_with_halves(
      queries_gmem.at[row, head], query_halves_smem, queries_smem, queries_barrier
    )
  else:
    plgpu.copy_gmem_to_smem(queries_gmem.at[row, head], queries_smem, queries_barrier)
  if row_max == "bound" and key_bias_source == "xla":
    # lse_smem holds them until the loop; the output's lse comes after it
    plgpu.copy_gmem_to_smem(references_gmem.at[row, head, split], lse_smem, queries_barrier)
  plgpu.barrier_wait(lengths_barrier)
  start, end, num_blocks = split_bounds(lengths_smem, row, split, plan, tokens)
  # Copies of blocks_per_copy blocks each: the split's last may hold blocks past the row's
  # length, which the loop computes with every token masked (the plan gives each split whole
  # copies, so they are the row's last split's only).
  num_copies = (num_blocks + blocks_per_copy - 1) // blocks_per_copy
  if key_bias_source == "kernel":
    key_bias_rings, key_bias_sources = (), ()
  else:
    key_bias_rings, key_bias_sources = (key_bias_smem,), (key_bias_gmem,)
  ring = (k_words_smem, k_scale_smem, *key_bias_rings, v_words_smem, *value_stats_rings)
  if copy_issuer in ("first_warp", "spread"):  # a barrier per ring slot, an arrival per copy
    waited_barriers = (ring_barriers,)
    copy_barriers = waited_barriers * len(ring)
  else:  # one barrier per ring buffer and slot
    waited_barriers = copy_barriers = ring_barriers
  fetch_copies = functools.partial(
    fetch_block,
    (k_codes_gmem, k_scale_gmem, *key_bias_sources, v_codes_gmem, *value_stats_gmem),
    ring,
    copy_barriers,
    row=row,
    head=head,
    start=start,
    block=block * blocks_per_copy,
    group_size=group_size,
    num_stages=num_stages,
    group_streams=1 + len(key_bias_rings),
  )

  def fetch(i):
    """Starts the copies of ring slot i (of the split's `num_copies`)."""
    if copy_issuer == "first_warp":
      plgpu.warp_map(lambda warp: pl.when(warp == 0)(functools.partial(fetch_copies, i)))
    elif copy_issuer == "spread":

      def issue_own_streams(warp):
        fetch_copies(i, issue=lambda stream, start: pl.when(warp == stream % WARPS)(start))

      plgpu.warp_map(issue_own_streams)
    else:
      fetch_copies(i)

  # Every slot but the last's copies (issued at the first step's start), or every slot's
  # (copy_issue_point="value_product": each step refills its own slot after its last barrier).
  for i in range(num_stages - (copy_issue_point == "slot_start")):
    pl.when(i < num_copies)(functools.partial(fetch, i))
  plgpu.barrier_wait(queries_barrier)
  if key_bias_source == "kernel":
    # After the ring's first copies are issued, so that they land while the bias (and with
    # "bound" the split's references, into lse_smem until the loop) is computed.
    split_key_statistics(
      key_bias_gmem,
      k_scale_gmem,
      query_halves_smem,
      k_min_tile_smem,
      split_bias_smem,
      lse_smem if row_max == "bound" else None,
      chunk_barriers[0],
      row=row,
      head=head,
      first_group=start // group_size,
      groups_used=(end - start + group_size - 1) // group_size,
      split_groups=split_key_groups(plan.split_tokens, group_size),
      bits=bits,
      max_over_groups=max_over_rows,
    )
  # Rounded to bf16 once, as the folded Triton kernel takes them: each Q' element is then one
  # packed bf16 product (HMUL2, the exact product rounded once), not an f32 product and a
  # conversion (KERNEL_NOTES v20: 1057 -> 1009 instructions per block, 4 registers fewer).
  # [D, rows]; with the kernel's bias already bf16, [rows, D] in shared memory
  queries_view = queries_smem.T if key_bias_source == "kernel" else queries_smem
  code_queries = wgmma_layout(queries_view[...]).astype(jnp.bfloat16)
  # A [n] per-row vector over the columns: per channel of [D, rows], per token of [block, rows].
  per_channel = functools.partial(
    lax.broadcast_in_dim, shape=(head_dim, rows), broadcast_dimensions=[0]
  )
  per_token = functools.partial(lax.broadcast_in_dim, shape=(block, rows), broadcast_dimensions=[0])
  token_in_block = plgpu.broadcasted_iota(
    jnp.int32, (block,), 0, layout=plgpu.Layout.WGMMA.reduce(1)
  )
  # Column j of value tile i holds query row j % real_rows of value group i * slots + j //
  # real_rows: the padding query rows repeat the real ones, so probs[:, j] is that row's.
  value_slot = plgpu.broadcasted_iota(jnp.int32, (block, rows), 1, layout=plgpu.Layout.WGMMA) // (
    real_rows
  )

  def value_tile(per_group, i):
    """[block, rows]: each column's value group's per-token vector. Slots past the last group
    keep the tile's first group: no channel reads their columns."""
    tile = per_token(per_group[i * slots])
    for s in range(1, min(slots, value_groups - i * slots)):
      tile = jnp.where(value_slot == s, per_token(per_group[i * slots + s]), tile)
    return tile

  def stage_key_stack(stack_smem, slot, slot_group):
    """Q' of the block whose key groups start at group `slot_group` of ring slot `slot`, into
    `stack_smem` ([KG * rows, D]): each key group's queries times its key scales."""
    for k in range(key_groups):
      if operand_order == "word":
        k_scale = per_channel(
          load_channels_in_word_order(
            k_scale_smem.at[slot, slot_group + k], head_dim, bits, emulate
          )
        )
      else:
        k_scale = per_channel(
          plgpu.layout_cast(k_scale_smem[slot, slot_group + k, :], plgpu.Layout.WGMMA.reduce(1))
        )
      stack_smem.at[pl.ds(k * rows, rows)].T[...] = code_queries * k_scale

  def body(i, slot, token_offset, state, reference=None, next_block=None, refill=None):
    """Block i of the split, tokens [token_offset, token_offset + block) of ring slot `slot`,
    whose copies have landed. `reference` [rows]: the split's fixed softmax reference
    (row_max="bound"), so nothing is rescaled; None: the online softmax's running max.
    `next_block` ("block_ahead" only): (ring slot, token offset in it, a function that waits for
    that slot's copies if the block starts a slot) of the block whose Q' this one stages; its own
    Q' was staged by the block before (or before the loop) and published by that block's
    barrier. `refill` (copy_issue_point="value_product", a slot's last block): issues the copies
    that refill the slot, called once the value product is issued."""
    refill = refill or (lambda: None)
    acc, running_max, sum_partials, value_bias_partials = state
    first = start + i * block
    slot_group = token_offset // group_size  # the block's first key group in the slot
    if ahead:
      parity = lax.rem(i, 2)
      key_stack_smem_i, value_stack_smem_i = key_stack_smem.at[parity], value_stack_smem.at[parity]
    else:
      key_stack_smem_i, value_stack_smem_i = key_stack_smem, value_stack_smem

    stage = functools.partial(
      _stage_block,
      codes_smem,
      slot=slot,
      bits=bits,
      emulate=emulate,
      operand_order=operand_order,
      first_token=token_offset,
    )
    if block_start_barrier and not ahead:
      # The code tile (and, with Q' and P' in one buffer, P') was last read by the previous
      # block's value product: each warp has waited for it, but the tile is overwritten only
      # once all four have. ("block_ahead" has no code tile natively; interpret mode's, which
      # stages the value codes, runs without concurrent warps.)
      plgpu.commit_smem()
    if key_operand == "registers":
      key_chunks = _staged_chunks(
        k_words_smem,
        slot=slot,
        bits=bits,
        emulate=emulate,
        operand_order=operand_order,
        first_token=token_offset,
        tokens=block,
      )
    else:
      stage(k_words_smem)
    if not ahead:
      stage_key_stack(key_stack_smem_i, slot, slot_group)
      plgpu.commit_smem()  # staged codes and Q' visible to the tensor core

    def group_bias(groups):
      """The bias of key groups `groups` of this block, [len(groups) * rows]."""
      if key_bias_source == "kernel":
        biases = [split_bias_smem[i * key_groups + k, :] for k in groups]
      else:
        biases = [key_bias_smem[slot, slot_group + k, :] for k in groups]
      return jnp.concatenate(
        [plgpu.layout_cast(bias, plgpu.Layout.WGMMA.reduce(0)) for bias in biases]
      )

    def pick_group_scores(stacked, bias, first_group, num_groups, token_offset):
      """[tokens, num_groups * rows] stacked products and the groups' `group_bias` -> [tokens,
      rows]: each token's own key group's columns, scaled back and with that group's bias."""
      stacked = stacked * score_scale + lax.broadcast_in_dim(bias, stacked.shape, [1])
      token = token_offset + plgpu.broadcasted_iota(
        jnp.int32, (stacked.shape[0], rows), 0, layout=plgpu.Layout.WGMMA
      )
      picked = stacked[:, :rows]
      for k in range(1, num_groups):
        group_scores = stacked[:, k * rows : (k + 1) * rows]
        picked = jnp.where(token // group_size == first_group + k, group_scores, picked)
      return picked

    if key_operand == "registers":
      # One product per 64-token row tile against the stacked queries of the key groups that
      # tile holds only (2 of 4 at block 128 and group 32): half the columns, accumulator
      # registers and selects of one product over the whole block.
      chunk_groups = [
        (c * CHUNK_TOKENS // group_size, max(1, CHUNK_TOKENS // group_size))
        for c in range(len(key_chunks))
      ]

      def key_products(*acc_refs):
        for acc_ref, chunk, (first_group, num_groups) in zip(acc_refs, key_chunks, chunk_groups):
          stack = key_stack_smem_i.at[pl.ds(first_group * rows, num_groups * rows)]
          plgpu.wgmma(acc_ref, chunk, stack.T)
        # Read while the tensor core computes the scores (reading an accumulator is what waits).
        biases = [group_bias(range(g, g + n)) for g, n in chunk_groups]
        return [acc_ref[...] for acc_ref in acc_refs], biases

      if emulate:
        # Mosaic GPU's interpreter takes wgmma operands from shared memory only: the same
        # products of the same registers, as dots.
        stacked_chunks = [
          chunk.astype(jnp.float32)
          @ key_stack_smem_i[pl.ds(first_group * rows, num_groups * rows), :].astype(jnp.float32).T
          for chunk, (first_group, num_groups) in zip(key_chunks, chunk_groups)
        ]
        biases = [group_bias(range(g, g + n)) for g, n in chunk_groups]
      else:
        stacked_chunks, biases = pl.run_scoped(
          key_products,
          *[
            plgpu.ACC((CHUNK_TOKENS, num_groups * rows), jnp.float32)
            for _, num_groups in chunk_groups
          ],
        )
      scores = jnp.concatenate(
        [
          pick_group_scores(stacked, bias, first_group, num_groups, c * CHUNK_TOKENS)
          for c, (stacked, bias, (first_group, num_groups)) in enumerate(
            zip(stacked_chunks, biases, chunk_groups)
          )
        ]
      )
    else:

      def key_product(acc_ref):
        plgpu.wgmma(acc_ref, codes_smem, key_stack_smem_i.T)
        # Read while the tensor core computes the scores (reading the accumulator is what
        # waits).
        bias = group_bias(range(key_groups))
        return acc_ref[...], bias

      stacked_scores, bias = pl.run_scoped(
        key_product, plgpu.ACC((block, key_groups * rows), jnp.float32)
      )
      scores = pick_group_scores(stacked_scores, bias, 0, key_groups, 0)
    token = plgpu.broadcasted_iota(jnp.int32, (block, rows), 0, layout=plgpu.Layout.WGMMA)

    if reference is None:
      new_max, correction, probs = softmax_step_numerators(
        scores, token + first < end, running_max, max_over_tokens=max_over_rows
      )
    else:
      new_max, correction = running_max, None
      probs = jnp.exp2(
        jnp.where(token + first < end, scores, -jnp.inf)
        - lax.broadcast_in_dim(reference, scores.shape, [1])
      )

    # The key product has completed (its result was read): the tile takes the value codes.
    # One tile instead of two keeps three programs per SM (`shared_memory_bytes`).
    value_codes = None
    if value_operand == "registers" and not emulate:
      # Read here, before the commit below: TMA refills this ring slot only after it.
      value_codes = value_operand_from_registers(
        v_words_smem.at[slot],
        head_dim,
        bits,
        first_token=token_offset,
        tokens=block,
        token_order=token_order,
      )
    elif value_operand == MATRIX_LOADS and not emulate:
      # Read here, before the commit below, as above.
      value_codes = value_operand_from_matrix_loads(
        v_words_smem.at[slot], head_dim, bits, first_token=token_offset, tokens=block
      )
    else:
      if reference is not None and key_operand == "shared_memory":
        # Without the row max's cross-warp reduction nothing says the other warps' key
        # products (their tensor cores read this tile) are done: a barrier does.
        plgpu.commit_smem()
      # Interpret mode stages even register operands, in the order their rows take.
      stage(v_words_smem, operand_order=value_order, token_order=token_order)
    value_operand_a = codes_smem.T if value_codes is None else value_codes
    # Past the length p is 0 but the statistics may be NaN: they are zeroed there (a select per
    # token, before the broadcast over rows), and then products may be taken.
    valid_token = token_in_block + first < end

    def per_token_stats(ring, k):
      return plgpu.layout_cast(
        ring[slot, k, pl.ds(token_offset, block)], plgpu.Layout.WGMMA.reduce(1)
      )

    # Per value group ("all_groups", each picked per slot by `value_tile`), or per value tile,
    # each lane holding its own slot's group ("own_slot", natively only).
    own_slot_loads = value_stat_loads == "own_slot" and not emulate

    def stat_tile(statistics, t):
      """Value tile t's [block, rows] statistic from the per-group or per-tile vectors."""
      return per_token(statistics[t]) if own_slot_loads else value_tile(statistics, t)

    if own_slot_loads:
      v_scales, v_mins = (
        [
          statistic.astype(jnp.float32)
          for statistic in own_slot_statistics(
            ring.at[slot],
            tiles=value_tiles,
            rows=rows,
            real_rows=real_rows,
            first_token=token_offset,
            tokens=block,
          )
        ]
        for ring in (v_scale_smem, v_min_smem)
      )
    elif value_stats == "pairs":
      v_pairs = [per_token_stats(v_stats_smem, k) for k in range(value_groups)]
      v_scales = [value_scale_of_pair(pair) for pair in v_pairs]
      v_mins = [value_minimum_of_pair(pair) for pair in v_pairs]
    else:
      v_scales, v_mins = (
        [per_token_stats(ring, k).astype(jnp.float32) for k in range(value_groups)]
        for ring in (v_scale_smem, v_min_smem)
      )
    v_scales = [jnp.where(valid_token, scale, 0.0) * probs_scale for scale in v_scales]
    v_mins = [jnp.where(valid_token, minimum, 0.0) for minimum in v_mins]
    for t in range(value_tiles):
      stacked = (probs * stat_tile(v_scales, t)).astype(jnp.bfloat16)
      if token_order == "spread":  # P' rows in the value codes' token order
        stacked = spread_rows_emulated(stacked) if emulate else spread_rows(stacked)
      value_stack_smem_i.at[pl.ds(t * rows, rows)].T[...] = stacked
    if correction is not None:
      stacked_correction_row = jnp.concatenate([correction] * acc_tiles)
    if ahead:
      # The next block's Q', into the other buffer (last read by the block before this one,
      # whose key product every warp waited for before that block's barrier).
      next_slot, next_offset, wait_for_next_slot = next_block
      wait_for_next_slot()
      stage_key_stack(key_stack_smem.at[1 - parity], next_slot, next_offset // group_size)
    # The staged value codes and P' (with "block_ahead" the next block's Q') visible to the
    # tensor core
    plgpu.commit_smem()

    def rescale_accumulator(acc):
      if correction is None:  # a fixed reference: nothing to rescale
        return acc
      return acc * lax.broadcast_in_dim(stacked_correction_row, (head_dim, acc_tiles * rows), [1])

    def update_partials(sum_partials, value_bias_partials):
      """In the value product's shadow: the softmax denominator and sum_t p v_min[t] per value
      group, kept per token slot and rescaled like the accumulator. Summed over tokens once,
      after the loop: a sum over tokens crosses the four warps through shared memory
      (KERNEL_NOTES v18: those round trips are where the kernel stalls)."""
      if correction is not None:
        per_token_correction = lax.broadcast_in_dim(correction, (block, rows), [1])
        sum_partials = sum_partials * per_token_correction
        value_bias_partials = value_bias_partials * jnp.concatenate(
          [per_token_correction] * value_tiles, axis=1
        )
      return sum_partials + probs, value_bias_partials + jnp.concatenate(
        [probs * stat_tile(v_mins, t) for t in range(value_tiles)], axis=1
      )

    def value_products(acc_ref):
      """Issues the block's value product into `acc_ref` (f32 [D, acc_tiles * rows])."""
      if not own_tiles:
        plgpu.wgmma(acc_ref, value_operand_a, value_stack_smem_i.T)
        return
      for m, (first, count) in enumerate(row_tiles):
        channels = pl.ds(m * ROW_TILE, ROW_TILE)
        if value_codes is None:
          operand = codes_smem.at[:, channels].T
        else:
          operand = value_codes[m * ROW_TILE : (m + 1) * ROW_TILE]
        stack = value_stack_smem_i.at[pl.ds(first * rows, count * rows)]
        plgpu.wgmma(acc_ref.at[channels], operand, stack.T)

    if emulate and (value_operand in REGISTER_VALUE_OPERANDS or value_accumulator == "carried"):
      # Mosaic GPU's interpreter takes wgmma operands from shared memory only and has no wgmma
      # into an accumulator made from registers: the same sum, with the product of the same
      # (emulated, staged) codes as a dot, per row tile with "own_tiles". (Staged codes into a
      # fresh accumulator run `value_products` itself, wgmma slices and all.)
      codes = codes_smem[...].astype(jnp.float32).T
      stack = value_stack_smem_i[...].astype(jnp.float32)
      if own_tiles:
        product = jnp.concatenate(
          [
            codes[m * ROW_TILE : (m + 1) * ROW_TILE]
            @ stack[first * rows : (first + count) * rows].T
            for m, (first, count) in enumerate(row_tiles)
          ]
        )
      else:
        product = codes @ stack.T
      refill()
      sum_partials, value_bias_partials = update_partials(sum_partials, value_bias_partials)
      return rescale_accumulator(acc) + product, new_max, sum_partials, value_bias_partials

    if value_accumulator == "carried":
      rescaled = rescale_accumulator(acc)

      def value_product_into(refs):
        acc_ref, sum_ref, bias_ref = refs
        value_products(acc_ref)
        refill()
        sum_ref[...], bias_ref[...] = update_partials(sum_ref[...], bias_ref[...])

      acc, sum_partials, value_bias_partials = pl.run_state(value_product_into)(
        (plgpu.ACC.init(rescaled), sum_partials, value_bias_partials)
      )
      return acc, new_max, sum_partials, value_bias_partials

    def value_product(acc_ref):
      value_products(acc_ref)
      refill()
      return acc_ref[...], *update_partials(sum_partials, value_bias_partials)

    update, sum_partials, value_bias_partials = pl.run_scoped(
      value_product, plgpu.ACC((head_dim, acc_tiles * rows), jnp.float32)
    )
    return rescale_accumulator(acc) + update, new_max, sum_partials, value_bias_partials

  def wait_for_slot(slot):
    for barrier in waited_barriers:
      plgpu.barrier_wait(barrier.at[slot])

  def copy_step(c, state, reference=None):
    """Ring slot c of the split's copies: starts the copies of the slot `num_stages` - 1 ahead,
    waits for this one's (with "block_ahead", the slot's first Q' staged, it was waited for
    before), and computes its blocks one after another."""
    slot = lax.rem(c, num_stages)
    # With "block_ahead" too the slot refilled here, the previous one, was last read before the
    # previous step's last barrier: its value codes and statistics, and the Q' it staged was
    # this slot's.
    refill = None
    if copy_issue_point == "slot_start":
      pl.when(c + num_stages - 1 < num_copies)(functools.partial(fetch, c + num_stages - 1))
    else:  # this slot, refilled in its last block's value product (`COPY_ISSUE_POINTS`)
      refill = functools.partial(
        pl.when(c + num_stages < num_copies), functools.partial(fetch, c + num_stages)
      )
    if not ahead:
      wait_for_slot(slot)
    for position in range(blocks_per_copy):
      i = c * blocks_per_copy + position
      next_block = None
      if ahead and position + 1 < blocks_per_copy:
        next_block = (slot, (position + 1) * block, lambda: None)
      elif ahead:
        next_slot = lax.rem(c + 1, num_stages)
        # The split's last block stages a Q' no block reads, from a slot never waited for.
        wait = functools.partial(
          pl.when(c + 1 < num_copies), functools.partial(wait_for_slot, next_slot)
        )
        next_block = (next_slot, 0, wait)
      slot_refill = refill if position + 1 == blocks_per_copy else None
      state = body(i, slot, position * block, state, reference, next_block, slot_refill)
    return state

  if ahead:  # the first block's Q', which the loop's blocks each stage for the next
    pl.when(num_copies > 0)(lambda: wait_for_slot(0))
    stage_key_stack(key_stack_smem.at[0], 0, 0)
    plgpu.commit_smem()
  _, initial_max, _ = initial_softmax_state(rows, head_dim)
  start_max, step = initial_max, copy_step
  if row_max == "bound":
    # Read before the loop: lse_smem takes the output's lse after it. Every thread reads the
    # same first element, so the whole warpgroup takes the same branch at every block. One loop
    # with a branch per block, not a loop per branch: two loops in one kernel took 135
    # registers (three programs per SM) where either alone takes 127-128 (four), sm_90a static
    # count (KERNEL_NOTES v33).
    reference = plgpu.layout_cast(lse_smem[...], plgpu.Layout.WGMMA.reduce(0))
    if key_bias_source == "kernel":  # the kernel's references are per row (`any_row_exchanges`)
      exchange = any_row_exchanges(lse_smem)
    else:  # XLA's are EXCHANGE in every row or none
      exchange = lse_smem[0] == EXCHANGE
    start_max = lax.cond(exchange, lambda: initial_max, lambda: reference)
    step = lambda c, state: lax.cond(
      exchange, copy_step, functools.partial(copy_step, reference=reference), c, state
    )
  init = (
    wgmma_layout(jnp.zeros((head_dim, acc_tiles * rows), jnp.float32)),
    start_max,  # the running max, or the fixed reference it stays at
    wgmma_layout(jnp.zeros((block, rows), jnp.float32)),
    wgmma_layout(jnp.zeros((block, value_tiles * rows), jnp.float32)),
  )
  acc, running_max, sum_partials, value_bias_partials = lax.fori_loop(0, num_copies, step, init)
  running_sum = reduce_rows(sum_partials, "add")
  value_bias = reduce_rows(value_bias_partials, "add")

  channel = plgpu.broadcasted_iota(jnp.int32, (head_dim, rows), 0, layout=plgpu.Layout.WGMMA)
  channel = value_row_order.channel_of_row(channel, value_order, head_dim, bits)
  output_scale = power_of_two(
    exponents.code - exponents.probs - code_exponent(channel, head_dim, bits)
  )
  out = jnp.zeros((head_dim, rows), jnp.float32)
  bias = lax.broadcast_in_dim(value_bias, (head_dim, value_tiles * rows), [1])
  tile = channel // group_size // slots
  acc_block = tile  # the accumulator's column block each row takes
  if own_tiles:
    # Accumulator block k of a row holds tile first + k of its row tile: that tile's bias.
    first = first_tile_of_channel(channel, group_size, slots)
    acc_block = tile - first

    def block_bias(k):
      picked = bias[:, :rows]
      for t in range(1, value_tiles):
        picked = jnp.where(first + k == t, bias[:, t * rows : (t + 1) * rows], picked)
      return picked

    bias = jnp.concatenate([block_bias(k) for k in range(acc_tiles)], axis=1)
  stacked_out = acc * jnp.concatenate([output_scale] * acc_tiles, axis=1) + bias
  # Each channel takes its value group's tile; only the columns of the group's slot are its
  # rows (`pick_value_slots` takes them after the kernel, or the kernel with "own").
  for k in range(acc_tiles):
    out = jnp.where(acc_block == k, stacked_out[:, k * rows : (k + 1) * rows], out)
  state = (out, running_max, running_sum)
  partials_gmem = (out_gmem.at[row, head, split], lse_gmem.at[row, head, split])
  if partial_slots == "own":
    normalised, lse = normalised_partials(state)
    first_column = slot_first_column(channel, group_size, real_rows, slots)
    write_own_slot_partials(normalised, lse, first_column, output_smem, lse_smem, *partials_gmem)
  else:
    write_partials(state, output_smem, lse_smem, *partials_gmem)


def _warpgroup_program(*refs, folded_kernel, warpgroups: int, plan, warpgroups_scratch, **settings):
  """A program of `warpgroups` warpgroups (`WARPGROUPS_PER_PROGRAM`): warpgroup w runs
  `folded_kernel` on split `program split x warpgroups + w` with the w-th of
  `warpgroups_scratch` (buffers, barriers and reduction scratch of its own). Where the splits do
  not fill the last program, its spare warpgroups do nothing.

  Each warpgroup runs a copy of the kernel's code of its own, in which its buffers' addresses
  are constants, as with one warpgroup a program. Indexing buffers of [warpgroups, ...] by the
  warpgroup's index instead (one copy of the code) cost 490 instructions per 64 tokens against
  399, 14 of them spill loads, at 96 registers (sm_90a static count, KERNEL_NOTES v42)."""
  program_split = lax.axis_index("split")
  warpgroup = lax.axis_index("warpgroup")
  for w in range(warpgroups):
    split = program_split * warpgroups + w
    run = functools.partial(
      folded_kernel, *refs, plan=plan, split=split, **settings, **warpgroups_scratch[w]
    )
    mine = warpgroup == w
    if plan.num_splits % warpgroups:
      mine = mine & (split < plan.num_splits)
    pl.when(mine)(run)


@functools.partial(
  jax.jit,
  static_argnames=(
    "bits",
    "group_size",
    "sm_scale",
    "block_tokens",
    "plan",
    "num_stages",
    *KERNEL_SETTINGS,
    "interpret",
  ),
)
def _jitted_kernel_outputs(
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
  block_tokens,
  plan: SplitPlan,
  num_stages,
  key_operand,
  operand_order,
  approx_math,
  copy_issuer,
  value_accumulator,
  value_stats,
  row_max,
  key_products,
  value_operand,
  key_bias_source,
  value_stat_loads,
  blocks_per_copy,
  token_order,
  partial_slots,
  key_stack_timing,
  copy_issue_point,
  value_product_columns,
  warpgroups_per_program,
  interpret,
):
  batch, kv_heads, group, head_dim = queries.shape
  tokens = k_codes.shape[2]
  rows = tile_rows(group)
  real_rows, _ = value_slots(group)
  exponents = _Exponents.for_run(interpret)
  # Padding rows repeat the real rows (row j is row j % real_rows), so every value slot's columns
  # hold real probabilities. A tile, not a gather: XLA fuses it into q . k_min's product, one
  # kernel fewer per call (v34, `benchmarks/xla_kernel_bytes.py`).
  scaled = pad_query_group(base_two_queries(queries, sm_scale), real_rows, jnp.float32)
  scaled = jnp.tile(scaled, (1, 1, rows // real_rows, 1))
  channel_scale = power_of_two(
    exponents.query - code_exponent(jnp.arange(head_dim, dtype=jnp.int32), head_dim, bits)
  )
  code_queries = jnp.swapaxes(scaled, 2, 3) * channel_scale[:, None]  # [B, H, D, rows]
  if operand_order == "word":  # a transpose, not a gather
    code_queries = channels_in_word_order(code_queries, 2, bits)
  if value_stats == "pairs":
    value_statistics = (group_major_value_stat_pairs(v_scale, v_min),)
  else:  # in a loop XLA makes these transposes layout (`VALUE_STATS`)
    value_statistics = (jnp.swapaxes(v_scale, 2, 3), jnp.swapaxes(v_min, 2, 3))
  lengths = padded_lengths(lengths)
  key_rows, value_rows = stacks(block_tokens, head_dim, group_size, group)
  slot_tokens = block_tokens * blocks_per_copy
  ring_slots = ring_slot_shapes(
    group, head_dim, bits, group_size, slot_tokens, value_stats, key_bias_source
  )
  operand = functools.partial(swizzled_operand_transforms, dtype=jnp.bfloat16)
  code_tile = needs_code_tile(key_operand, value_operand, interpret)
  ring_transforms = {}
  if value_operand == MATRIX_LOADS:
    ring_transforms["v_words_smem"] = value_operand_matrix_loads.ring_transforms(head_dim, bits)
  warpgroups = warpgroups_per_program
  # The queries are read into registers before the loop, the output written after it: one
  # buffer, or a union of the two where they differ (bf16 queries with the kernel's bias,
  # `queries_with_halves`; each channel's own slot, head dim last, `own_slot_partials`).
  partial_shape = (real_rows, head_dim) if partial_slots == "own" else (head_dim, rows)
  queries_buffer = plgpu.SMEM((head_dim, rows), jnp.float32)
  if key_bias_source == "kernel":  # `queries_with_halves`' queries, bf16 [rows, D]
    queries_buffer = plgpu.SMEM((rows, head_dim), jnp.bfloat16)
  if partial_slots == "own" or key_bias_source == "kernel":
    queries_buffer = plgpu.RefUnion(queries_buffer, plgpu.SMEM(partial_shape, jnp.float32))
  # Q', P'; with "block_ahead" two of each, by block parity
  buffers_each = stack_buffer_count(key_stack_timing)
  parities = (buffers_each,) if buffers_each > 1 else ()
  stack_buffers = (
    plgpu.SMEM((*parities, key_rows, head_dim), jnp.bfloat16, transforms=operand(head_dim)),
    plgpu.SMEM(
      (*parities, value_rows, block_tokens), jnp.bfloat16, transforms=operand(block_tokens)
    ),
  )
  kernel_bias_scratch, chunk_barriers = {}, ()
  if key_bias_source == "kernel":
    split_groups = split_key_groups(plan.split_tokens, group_size)
    chunks = bias_chunks(split_groups, block_tokens)
    # Read only before the loop: in the union with Q' and P', which the loop alone uses.
    halves_rows = (4 if row_max == "bound" else 2) * rows
    prologue = (plgpu.SMEM((halves_rows, head_dim), jnp.bfloat16, transforms=operand(head_dim)),)
    if not code_tile:
      prologue += (
        plgpu.SMEM((block_tokens, head_dim), jnp.bfloat16, transforms=operand(head_dim)),
      )
    # With "bound" Q' and P' take a buffer each, the prologue's buffers both their bytes.
    stack_buffers = (stack_buffers, prologue) if row_max == "bound" else (*stack_buffers, prologue)
    kernel_bias_scratch = dict(
      split_bias_smem=plgpu.SMEM((chunks * block_tokens, rows), jnp.float32)
    )
    chunk_barriers = (plgpu.Barrier(num_barriers=chunks * copies_per_chunk(row_max == "bound")),)
  # Buffers whose lifetimes do not overlap share memory, which brings a program of the shapes
  # of record to 70 KB, so that an SM holds three (`shared_memory_bytes`):
  # - the queries are read into registers before the loop, the output written after it;
  # - Q' is read by the key product, P' written after every warp has read the scores (the
  #   row max's cross-warp reduction is a barrier) and read by the value product, the next Q'
  #   written after the next block's first `commit_smem`: the code tile's cycle. With
  #   row_max="bound" no barrier follows the key product in the fixed reference's branch, so
  #   Q' and P' take a buffer each (+2 KB at the v30 default's shapes: still four per SM).
  scratch = dict(
    lengths_smem=plgpu.SMEM(lengths.shape, jnp.int32),
    queries_smem=queries_buffer,
    **{
      name: plgpu.SMEM((num_stages, *shape), dtype, transforms=ring_transforms.get(name, ()))
      for name, (shape, dtype) in ring_slots.items()
    },
    **(
      dict(
        codes_smem=plgpu.SMEM((block_tokens, head_dim), jnp.bfloat16, transforms=operand(head_dim))
      )
      if code_tile
      else {}
    ),
    **kernel_bias_scratch,
    stacks_smem=(
      plgpu.RefUnion(*stack_buffers)
      if row_max == "exchange" or key_bias_source == "kernel"
      else stack_buffers
    ),
    lse_smem=plgpu.SMEM((rows,), jnp.float32),
    barriers=(
      plgpu.Barrier(),
      # the queries; with row_max="bound" the split's softmax references, with
      # key_bias_source="kernel" the query halves (the queries' array copied in two)
      plgpu.Barrier(
        num_arrivals=1
        + (row_max == "bound" and key_bias_source == "xla")
        + (key_bias_source == "kernel")
      ),
      (
        plgpu.Barrier(num_arrivals=len(ring_slots), num_barriers=num_stages)
        if copy_issuer in ("first_warp", "spread")
        else tuple(plgpu.Barrier(num_barriers=num_stages) for _ in ring_slots)
      ),
      *chunk_barriers,
    ),
  )
  folded_kernel, scratch_types, warpgroup_options = _folded_kernel, scratch, {}
  if warpgroups > 1:
    # Each warpgroup its own buffers and barriers, and its own reduction scratch
    # (`_warpgroup_program`, `warpgroup_reductions`).
    own = dict(
      scratch, reduction_smem=plgpu.SMEM((warpgroup_reductions.SCRATCH_WORDS,), jnp.float32)
    )
    scratch_types = dict(warpgroups_scratch=(own,) * warpgroups)
    folded_kernel = functools.partial(
      _warpgroup_program, folded_kernel=_folded_kernel, warpgroups=warpgroups, plan=plan
    )
    warpgroup_options = dict(num_threads=warpgroups, thread_name="warpgroup")
  kernel = plgpu.kernel(
    functools.partial(
      folded_kernel,
      plan=plan,
      tokens=tokens,
      num_stages=num_stages,
      bits=bits,
      group_size=group_size,
      real_rows=real_rows,
      emulate=interpret,
      key_operand=key_operand,
      operand_order=operand_order,
      copy_issuer=copy_issuer,
      value_accumulator=value_accumulator,
      value_stats=value_stats,
      row_max=row_max,
      value_operand=value_operand,
      key_bias_source=key_bias_source,
      value_stat_loads=value_stat_loads,
      blocks_per_copy=blocks_per_copy,
      token_order=token_order,
      partial_slots=partial_slots,
      key_stack_timing=key_stack_timing,
      copy_issue_point=copy_issue_point,
      value_product_columns=value_product_columns,
    ),
    out_type=(
      jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, *partial_shape), jnp.float32),
      jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows), jnp.float32),
    ),
    grid=(batch, kv_heads, cdiv(plan.num_splits, warpgroups)),
    grid_names=("row", "head", "split"),
    **warpgroup_options,
    scratch_types=scratch_types,
    # The stores need none of the barriers Pallas would put around each of them: every tile a
    # thread writes (the staged codes, Q', P') is read only by the tensor core after
    # `commit_smem` (a fence and a barrier), and is next written only after a later barrier (a
    # `commit_smem`, or the row max's cross-warp reduction), by which every warp has waited for
    # the product that read it; TMA refills a ring slot only after the last `commit_smem` of the
    # step that read it. 5 barriers per 128-token block, down from 51 (sm_90a SASS,
    # `benchmarks/mosaic_static_cost.py`; KERNEL_NOTES v15, v19).
    compiler_params=_compat.mosaic_gpu_compiler_params(
      unsafe_no_auto_barriers=True,
      # None with several warpgroups, so that a reduction left on this program-wide buffer
      # fails to lower instead of racing (`warpgroup_reductions`).
      reduction_scratch_bytes=REDUCTION_SCRATCH_BYTES if warpgroups == 1 else 0,
      # exp2 and the reciprocal as single approximate instructions (ex2.approx, rcp.approx:
      # ~2^-22 relative error, far below the bf16 operands'): 535 -> 513 instructions per
      # 64-token block in the word order (static count), yet timed no faster (v30): off unless
      # asked for.
      approx_math=approx_math,
    ),
    interpret=_compat.mosaic_gpu_interpret_params() if interpret else None,
  )
  if key_bias_source == "kernel":
    # A copy of a split's statistics takes up to a block's worth of key groups, which may be
    # more than a short cache holds (a split of 8 groups over a 7-group cache): such a cache's
    # statistics are padded (by less than a block's worth of groups), and every cache's to whole
    # tiles of the swizzled layout the copies land in (`key_bias_in_kernel.padded_key_groups`).
    short = key_bias_in_kernel.statistics_padding(
      plan.split_tokens, group_size, plan.block_tokens, k_min.shape[2]
    )
    padding = ((0, 0), (0, 0), (0, short), (0, 0))
    bias = jnp.pad(k_min, padding)
    if short and row_max == "bound":
      k_scale = jnp.pad(k_scale, padding)
    code_queries = queries_with_halves(code_queries, scaled, bounds=row_max == "bound")
  else:
    bias = key_bias(scaled, k_min, key_products=key_products)  # [B, H, T / group_size, rows]
  references = ()
  if row_max == "bound" and key_bias_source == "xla":
    references = (
      split_softmax_references(
        *key_score_bounds(scaled, k_scale, bias, bits=bits, key_products=key_products),
        lengths[:batch],
        group_size=group_size,
        split_tokens=plan.split_tokens,
        num_splits=plan.num_splits,
      ),
    )
  return kernel(
    lengths,
    code_queries,
    k_codes,
    k_scale,
    bias,
    v_codes,
    *value_statistics,
    *references,
  )


def group_major_value_stat_pairs(v_scale: jax.Array, v_min: jax.Array) -> jax.Array:
  """bf16 [B, H, T, D/g] scale and minimum -> uint32 [B, H, D/g, T]: each token's scale in the
  low half of a word and its minimum in the high half, so that the kernel reads both with one
  32-bit load instead of two 16-bit ones (KERNEL_NOTES v18: 16-bit loads of the key statistics
  were among its most stalled-on instructions; the value statistics were loaded the same way).
  The same bytes as the two bf16 arrays, made in the pass that turns them group-major for TMA
  (as `group_major_value_stats` does for the dequantizing kernel)."""
  scale, minimum = (
    lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) for x in (v_scale, v_min)
  )
  return jnp.swapaxes(scale | lax.shift_left(minimum, jnp.uint32(16)), 2, 3)


def value_scale_of_pair(pair: jax.Array) -> jax.Array:
  """uint32 (scale, minimum) pairs -> the scales as f32 (a bf16 is the top half of its f32)."""
  return lax.bitcast_convert_type(lax.shift_left(pair, jnp.uint32(16)), jnp.float32)


def value_minimum_of_pair(pair: jax.Array) -> jax.Array:
  """uint32 (scale, minimum) pairs -> the minimums as f32."""
  return lax.bitcast_convert_type(pair & jnp.uint32(0xFFFF0000), jnp.float32)


def value_output_order(operand_order: str, value_operand: str) -> str:
  """The order of the kernel's output rows: the staged value codes' column order, channel
  order for register value codes (`value_operand_registers`), or "matrix" for matrix loads
  (`value_operand_matrix_loads.channel_of_row`)."""
  if value_operand == MATRIX_LOADS:
    return "matrix"
  return "channel" if value_operand == "registers" else operand_order


def _settings_value_order(settings: dict) -> str:
  """`value_output_order` of an entry point's settings (their defaults where not given)."""
  return value_output_order(
    settings.get("operand_order", DEFAULT_OPERAND_ORDER),
    settings.get("value_operand", DEFAULT_VALUE_OPERAND),
  )


def _channel_positions(settings: dict, head_dim: int, bits: int) -> np.ndarray | None:
  """The kernel's output row holding each channel (None: channel order)."""
  return value_row_order.channel_rows(_settings_value_order(settings), head_dim, bits)


def folded_kernel_outputs(
  queries: jax.Array,  # [B, H, G, D]
  k_codes: jax.Array,  # uint32 [B, H, T, D * bits / 32]
  k_scale: jax.Array,  # bf16 [B, H, T / group_size, D]
  k_min: jax.Array,
  v_codes: jax.Array,  # uint32 [B, H, T, D * bits / 32]
  v_scale: jax.Array,  # bf16 [B, H, T, D / group_size]
  v_min: jax.Array,
  lengths: jax.Array,  # int32 [B]
  *,
  bits: int,
  group_size: int,
  sm_scale: float,
  block_tokens: int = DEFAULT_BLOCK_TOKENS,
  num_splits: int | None = None,
  num_stages: int = 2,
  key_operand: str = DEFAULT_KEY_OPERAND,
  operand_order: str = DEFAULT_OPERAND_ORDER,
  approx_math: bool = False,
  copy_issuer: str = DEFAULT_COPY_ISSUER,
  value_accumulator: str = DEFAULT_VALUE_ACCUMULATOR,
  value_stats: str = DEFAULT_VALUE_STATS,
  row_max: str = DEFAULT_ROW_MAX,
  key_products: str = DEFAULT_KEY_PRODUCT,
  value_operand: str = DEFAULT_VALUE_OPERAND,
  key_bias_source: str = DEFAULT_KEY_BIAS_SOURCE,
  value_stat_loads: str = DEFAULT_VALUE_STAT_LOADS,
  blocks_per_copy: int = DEFAULT_BLOCKS_PER_COPY,
  token_order: str = DEFAULT_TOKEN_ORDER,
  partial_slots: str = DEFAULT_PARTIAL_SLOTS,
  key_stack_timing: str = DEFAULT_KEY_STACK_TIMING,
  copy_issue_point: str = DEFAULT_COPY_ISSUE_POINT,
  value_product_columns: str = DEFAULT_VALUE_PRODUCT_COLUMNS,
  warpgroups_per_program: int = DEFAULT_WARPGROUPS_PER_PROGRAM,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """The kernel's own outputs: out f32 [B,H,S,D,rows] (D in operand positions, every value
  slot's columns), or with partial_slots="own" [B,H,S,real_rows,D] (each channel's own slot),
  and lse f32 [B,H,S,rows]. Settings and shapes are checked (ValueError) before
  anything is traced. The entry points below take the same arguments."""
  dequantizing.check_settings(
    block_tokens=block_tokens, num_splits=num_splits, num_stages=num_stages
  )
  check_blocks_per_copy(blocks_per_copy)  # before the split plan, which takes it as a multiple
  reason = unsupported_reason(
    queries,
    k_codes,
    k_scale,
    v_scale,
    bits=bits,
    group_size=group_size,
    block_tokens=block_tokens,
    operand_order=operand_order,
    value_operand=value_operand,
    key_bias_source=key_bias_source,
    num_splits=num_splits,
    blocks_per_copy=blocks_per_copy,
  )
  if reason is not None:
    raise ValueError(
      f"the folded Mosaic GPU quantized decode-attention kernel does not support {reason}"
    )
  folded_settings = dict(
    key_operand=key_operand,
    operand_order=operand_order,
    approx_math=approx_math,
    copy_issuer=copy_issuer,
    value_accumulator=value_accumulator,
    value_stats=value_stats,
    row_max=row_max,
    key_products=key_products,
    value_operand=value_operand,
    key_bias_source=key_bias_source,
    value_stat_loads=value_stat_loads,
    blocks_per_copy=blocks_per_copy,
    token_order=token_order,
    partial_slots=partial_slots,
    key_stack_timing=key_stack_timing,
    copy_issue_point=copy_issue_point,
    value_product_columns=value_product_columns,
    warpgroups_per_program=warpgroups_per_program,
  )
  plan = folded_split_plan(
    queries,
    k_codes,
    block_tokens,
    num_splits,
    group_size=group_size,
    key_bias_source=key_bias_source,
    blocks_per_copy=blocks_per_copy,
  )
  check_config(
    queries.shape[2],
    queries.shape[3],
    bits,
    group_size,
    block_tokens=block_tokens,
    num_stages=num_stages,
    num_splits=num_splits,
    split_groups=split_key_groups(plan.split_tokens, group_size),
    **folded_settings,
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
    bits=bits,
    group_size=group_size,
    sm_scale=sm_scale,
    block_tokens=block_tokens,
    plan=plan,
    num_stages=num_stages,
    **folded_settings,
    interpret=interpret,
  )
  return _compat.finished_if_interpreted(outputs, interpret)


def folded_partials_mosaic_gpu(*arrays, bits, group_size, **settings):
  """Per-split partials (out^T f32 [B,H,S,D,R], lse f32 [B,H,S,R]; R: the query group padded to
  a power of two), channels in order; `folded_kernel_outputs`'s arguments (and `split_merge`,
  which unmerged partials do not use)."""
  pop_split_merge(settings)
  out, lse = folded_kernel_outputs(*arrays, bits=bits, group_size=group_size, **settings)
  queries = arrays[0]
  real_rows, _ = value_slots(queries.shape[2])
  positions = _channel_positions(settings, queries.shape[3], bits)
  if settings.get("partial_slots", DEFAULT_PARTIAL_SLOTS) == "own":
    own = out if positions is None else out[..., positions]
    return jnp.swapaxes(own, -1, -2), lse[..., :real_rows]
  return pick_value_slots(out, group_size, real_rows, positions), lse[..., :real_rows]


def folded_decode_attention_mosaic_gpu(*arrays, bits, group_size, **settings):
  """(out f32 [B,H,G,D], lse f32 [B,H,G]); same contract as the jnp reference (KIVI segments);
  `folded_kernel_outputs`'s arguments, and `split_merge`: who merges the splits' partials, XLA
  (`merge_value_slot_partials_reference`: the splits merged before each channel's value slot and
  position are picked, so no gather runs over the partials) or one Triton kernel
  (`merge_value_slot_partials_triton`)."""
  split_merge = pop_split_merge(settings)
  queries = arrays[0]
  group, head_dim = queries.shape[2:]
  out, lse = folded_kernel_outputs(*arrays, bits=bits, group_size=group_size, **settings)
  real_rows, _ = value_slots(group)
  positions = _channel_positions(settings, head_dim, bits)
  own_slot = settings.get("partial_slots", DEFAULT_PARTIAL_SLOTS) == "own"
  if split_merge == "triton":
    return merge_value_slot_partials_triton(
      out,
      lse,
      group=group,
      group_size=group_size,
      real_rows=real_rows,
      value_order=_settings_value_order(settings),
      bits=bits,
      own_slot=own_slot,
      interpret=settings.get("interpret", False),
    )
  return merge_value_slot_partials_reference(
    out,
    lse,
    group=group,
    group_size=group_size,
    real_rows=real_rows,
    positions=positions,
    own_slot=own_slot,
  )
