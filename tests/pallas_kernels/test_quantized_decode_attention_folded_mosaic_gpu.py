"""The folded Mosaic GPU quantized (KIVI) decode kernel against the jnp reference, its code
staging against the codes, and the GPU entry point that picks it.

Interpret mode on CPU (compiled with KVJAX_NATIVE_KERNELS=1 on a GPU machine). Interpret mode
stages each masked code pattern m as the number m (XLA on CPU flushes subnormals); the native
bit patterns are checked here outside a kernel (`test_staged_codes_*`), and the tensor cores'
handling of them only on a GPU. Inputs are poisoned as in the dequantizing kernel's tests: NaN in
every value statistic past a row's length and in every key group that starts past it, and every
buffer the kernel allocates starts as NaN.
"""

import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention_dispatch
from pallas_kernels import own_slot_partials, quantized_decode_attention_gpu, value_row_order
from pallas_kernels import quantized_decode_attention_folded_mosaic_gpu as folded
from pallas_kernels.base_two_softmax import base_two_queries
from pallas_kernels.bit_packing import pack_codes, unpack_codes
from pallas_kernels.key_bias import key_bias
from pallas_kernels.quantized_decode_attention_gpu import (
  FOLDED_MOSAIC_GPU_V30,
  FOLDED_MOSAIC_GPU_V34,
  mosaic_gpu_settings,
)
from pallas_kernels.quantized_decode_attention_mosaic_gpu import BLOCK_TOKENS
from pallas_kernels.quantized_decode_attention_reference import (
  quantized_decode_attention_reference,
)
from pallas_kernels.softmax_reference_bounds import (
  EXCHANGE,
  key_score_bounds,
  split_softmax_references,
)
from pallas_kernels.splits import (
  merge_split_partials,
  next_power_of_two,
)
from pallas_kernels.subnormal_codes import code_exponent
from pallas_kernels.word_operand_order import OPERAND_ORDERS
from tests.pallas_kernels.kernel_checks import (
  assert_all_written,
  assert_matches_reference,
  detect_mosaic_gpu_races,
  relative_tolerance,
  triton_interpret,
)
from tests.pallas_kernels.test_quantized_decode_attention_mosaic_gpu import _inputs, _zeros_segment

pytestmark = pytest.mark.filterwarnings(
  "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)

# v30's Hopper default, v34's (v31's two settings and v32's "separate" on top), and v31's two.
V30_SETTINGS = mosaic_gpu_settings(FOLDED_MOSAIC_GPU_V30)
V34_SETTINGS = mosaic_gpu_settings(FOLDED_MOSAIC_GPU_V34)
V31_CANDIDATE = dict(V30_SETTINGS, copy_issuer="first_warp", value_accumulator="carried")
# v36's candidate: both code operands from registers, the kernel's bias and references, each
# lane's own value statistics, on v34's settings.
V36_CANDIDATE = dict(
  V34_SETTINGS,
  row_max="bound",
  key_bias_source="kernel",
  value_operand="registers",
  value_stat_loads="own_slot",
)
# v40's two settings: the next block's Q' staged before each block's one barrier, each ring slot
# refilled in its last block's value product's shadow.
V40_BOTH = dict(key_stack_timing="block_ahead", copy_issue_point="value_product")
OWN_TILES = dict(value_product_columns="own_tiles")  # v41
# v41's nearest to five programs per SM: v36's candidate with v40's settings and own value tiles
# at two stages (v42 runs it as warpgroups of one program).
V41_NEAREST = dict(V36_CANDIDATE, num_stages=2, **V40_BOTH, **OWN_TILES)


def _check(*, head_dim, group, bits, group_size, seed, tokens=224, batch=3, **config):
  rng = np.random.default_rng(seed)
  arrays, clean = _inputs(
    rng,
    head_dim=head_dim,
    group=group,
    bits=bits,
    group_size=group_size,
    tokens=tokens,
    dtype=jnp.bfloat16,
    batch=batch,
  )
  quantization = dict(bits=bits, group_size=group_size)
  sm_scale = head_dim**-0.5
  interpret = triton_interpret()
  out_t, lse_p = folded.folded_partials_mosaic_gpu(
    *arrays, **quantization, sm_scale=sm_scale, interpret=interpret, **config
  )
  real_rows = next_power_of_two(group)
  assert out_t.shape[-2:] == (head_dim, real_rows) and lse_p.shape[-1] == real_rows
  assert_all_written(out_t, lse_p)
  out, lse = merge_split_partials(out_t, lse_p, group, head_dim_last=False)
  ref = quantized_decode_attention_reference(*clean, **quantization, sm_scale=sm_scale)
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.bfloat16, interpret))


# The settings of the Hopper default (v34's) and the kernel's own defaults (left unset): the
# default run checks them over the shape grid. The settings of v30-v43's experiments, which no
# default picks (each timed slower or no faster: KERNEL_NOTES), run under `-m slow` only, as do
# cases that repeat a setting at another shape (the interpreter takes 3-6 s a case on 2 cores).
TUNING_KEYS = ("block_tokens", "num_stages", "num_splits", "tokens")


def is_experiment(config: dict) -> bool:
  """Whether `config` sets a setting other than a tuning key to a value the Hopper default does
  not give it."""
  return any(
    key not in TUNING_KEYS and V34_SETTINGS.get(key) != value for key, value in config.items()
  )


def slow_if_experiment(cases):
  """The cases, those whose last value (the config) is an experiment marked slow."""
  marked = []
  for case in cases:
    values, marks = (case.values, list(case.marks)) if hasattr(case, "marks") else (case, [])
    if is_experiment(values[-1]) and pytest.mark.slow.mark not in marks:
      marks.append(pytest.mark.slow)
    marked.append(pytest.param(*values, marks=marks))
  return marked


@pytest.mark.parametrize(
  "bits,head_dim,group,group_size,tokens,config",
  slow_if_experiment(
    [
      (2, 128, 4, 32, 224, dict(block_tokens=128, num_stages=2, num_splits=1)),
      (4, 128, 8, 32, 192, dict(block_tokens=64, num_stages=4, num_splits=2)),
      (4, 64, 3, 64, 192, dict(block_tokens=128, num_stages=3)),
      pytest.param(
        2,
        128,
        2,
        16,
        256,
        dict(block_tokens=64, num_stages=2, num_splits=2),
        marks=pytest.mark.slow,
      ),
      (2, 128, 1, 128, 256, dict(block_tokens=128, num_splits=3)),
      # generate_kernels_check.py's shape (its tiny model, KIVI-4), default settings
      (4, 64, 4, 32, 224, dict()),
      # the key codes handed to wgmma from registers (v30): one and two 64-token row tiles per
      # block, 2- and 4-bit, several splits (two tiles in the channel order: slow, the word order
      # below has them by default)
      pytest.param(
        2,
        128,
        4,
        32,
        224,
        dict(block_tokens=128, num_splits=2, key_operand="registers"),
        marks=pytest.mark.slow,
      ),
      (4, 64, 8, 16, 192, dict(block_tokens=64, num_stages=3, key_operand="registers")),
      # each masked word one operand register, queries / key scales / output permuted (v30)
      (2, 128, 4, 32, 224, dict(block_tokens=64, num_stages=4, operand_order="word")),
      pytest.param(
        4,
        128,
        3,
        16,
        192,
        dict(block_tokens=128, num_splits=2, key_operand="registers", operand_order="word"),
        marks=pytest.mark.slow,
      ),
      (4, 64, 8, 64, 192, dict(block_tokens=64, key_operand="registers", operand_order="word")),
      # v31's candidates: the first warp alone issues the copies, one barrier per ring slot, and
      # the value product adds into the running accumulator (with the v30 default's settings);
      # one split of four 64-token blocks through two ring slots (each slot refilled); the
      # running accumulator carried in the channel order. One split each, so that the running
      # state crosses blocks (the planner gives these tokens one block per split)
      (2, 128, 4, 32, 224, dict(V31_CANDIDATE, num_splits=1)),
      pytest.param(
        4,
        64,
        2,
        16,
        256,
        dict(block_tokens=64, num_stages=2, num_splits=1, copy_issuer="first_warp"),
        marks=pytest.mark.slow,
      ),
      (4, 128, 3, 32, 224, dict(block_tokens=64, num_splits=1, value_accumulator="carried")),
      # the value statistics as two group-major bf16 arrays (v32): with v31's candidate (six
      # copies on one barrier per slot) over one split, and with a copy barrier per stream, two
      # value groups per head (two 256-byte slots per block) and two splits
      (2, 128, 4, 32, 224, dict(V31_CANDIDATE, num_splits=1, value_stats="separate")),
      pytest.param(
        4,
        64,
        4,
        32,
        192,
        dict(block_tokens=64, num_splits=2, value_stats="separate"),
        marks=pytest.mark.slow,
      ),
      # a fixed softmax reference per split from the key statistics' bounds (v33): with the v30
      # default's settings over one split of four blocks; in the channel order at block 128; with
      # v31's candidate, "separate" and two splits at head_dim 64
      pytest.param(
        2,
        128,
        4,
        32,
        224,
        dict(V30_SETTINGS, num_splits=1, row_max="bound"),
        marks=pytest.mark.slow,
      ),
      pytest.param(2, 128, 2, 32, 256, dict(num_splits=1, row_max="bound"), marks=pytest.mark.slow),
      pytest.param(
        4,
        64,
        3,
        16,
        192,
        dict(V31_CANDIDATE, num_splits=2, value_stats="separate", row_max="bound"),
        marks=pytest.mark.slow,
      ),
      # XLA's products before the kernel as reductions (v34): q . k_min alone with the Hopper
      # default's settings, and with the bounds' product too
      (2, 128, 4, 32, 224, dict(V34_SETTINGS, num_splits=1, key_products="reduction")),
      pytest.param(
        4,
        128,
        2,
        32,
        192,
        dict(V34_SETTINGS, num_splits=2, row_max="bound", key_products="reduction"),
        marks=pytest.mark.slow,
      ),
      # the value codes as wgmma's register operand (v34): rows in channel order under the Hopper
      # default's word order; with shared-memory key codes, 4-bit, head_dim 64, block 128
      (2, 128, 4, 32, 224, dict(V34_SETTINGS, num_splits=1, value_operand="registers")),
      pytest.param(
        4, 64, 3, 16, 256, dict(num_splits=2, value_operand="registers"), marks=pytest.mark.slow
      ),
      # each warp issuing a share of the copies (v36): six streams over the four warps (the first
      # two issue two each) across the ring's slots in one split; five with the kernel's bias
      (2, 128, 4, 32, 224, dict(V34_SETTINGS, num_splits=1, copy_issuer="spread")),
      pytest.param(
        4,
        64,
        3,
        16,
        192,
        dict(block_tokens=64, num_splits=2, key_bias_source="kernel", copy_issuer="spread"),
        marks=pytest.mark.slow,
      ),
      # each lane loading only its own value slot's statistics (v36): natively only, so here the
      # select path runs with the setting's plumbing (the inline code: test_value_stats_own_slot)
      (2, 128, 4, 32, 224, dict(V34_SETTINGS, num_splits=1, value_stat_loads="own_slot")),
      # q . k_min by the kernel before its loop (v35): with the Hopper default's settings over one
      # split; two chunks of 64 key groups (group size 8, 72 groups: the second chunk a partial
      # copy); 4-bit at head_dim 64 where the planner must lengthen the splits to whole 8-group
      # tiles (2 asked, 1 given); with register value codes (no code tile natively). Slow ones:
      # the prologue's two chunks run alone in test_key_bias_in_kernel.py.
      (2, 128, 4, 32, 224, dict(V34_SETTINGS, num_splits=1, key_bias_source="kernel")),
      pytest.param(
        2,
        128,
        4,
        8,
        576,
        dict(V34_SETTINGS, num_splits=1, key_bias_source="kernel"),
        marks=pytest.mark.slow,
      ),
      (4, 64, 3, 16, 192, dict(block_tokens=64, num_splits=2, key_bias_source="kernel")),
      pytest.param(
        2,
        128,
        4,
        32,
        224,
        dict(V34_SETTINGS, num_splits=1, key_bias_source="kernel", value_operand="registers"),
        marks=pytest.mark.slow,
      ),
      # and the fixed softmax references from the bounds, by the kernel too (v35): one split;
      # two chunks; at head_dim 64 with 4-bit codes and the channel order
      pytest.param(
        2,
        128,
        4,
        32,
        224,
        dict(V34_SETTINGS, num_splits=1, key_bias_source="kernel", row_max="bound"),
        marks=pytest.mark.slow,
      ),
      pytest.param(
        2,
        128,
        4,
        8,
        576,
        dict(V34_SETTINGS, key_bias_source="kernel", row_max="bound"),
        marks=pytest.mark.slow,
      ),
      pytest.param(
        4,
        64,
        3,
        16,
        192,
        dict(block_tokens=64, num_splits=2, key_bias_source="kernel", row_max="bound"),
        marks=pytest.mark.slow,
      ),
      # both code operands from registers with "bound": no barrier at a block's start natively
      # (v35), with XLA's references and with the kernel's
      pytest.param(
        2,
        128,
        4,
        32,
        224,
        dict(V34_SETTINGS, num_splits=1, row_max="bound", value_operand="registers"),
        marks=pytest.mark.slow,
      ),
      (
        2,
        128,
        4,
        32,
        224,
        dict(
          V34_SETTINGS,
          num_splits=1,
          row_max="bound",
          value_operand="registers",
          key_bias_source="kernel",
        ),
      ),
      # ring slots of several blocks, copied and waited for once per slot (v37): two blocks per
      # slot with the Hopper default's settings over a row of three blocks (its second slot's
      # second block past the capacity and the length); the candidate of v36 (both code operands
      # from registers, the kernel's bias and references, each lane's own statistics); four
      # blocks per slot with the dequantizing defaults' paths (staged keys, channel order, paired
      # statistics, every warp copying), a split ending one block into a slot
      (2, 128, 4, 32, 160, dict(V34_SETTINGS, num_stages=2, num_splits=1, blocks_per_copy=2)),
      pytest.param(
        2,
        128,
        4,
        32,
        224,
        dict(V36_CANDIDATE, num_stages=2, num_splits=1, blocks_per_copy=2),
        marks=pytest.mark.slow,
      ),
      (4, 64, 3, 16, 448, dict(block_tokens=64, num_stages=2, num_splits=2, blocks_per_copy=4)),
      # the value product's tokens in the spread order (v37: the register value codes and P' rows
      # with the upper token pairs of each 8 swapped): with the Hopper default's settings and
      # register values over rows of 1-4 blocks; with v36's candidate and two blocks per slot
      (
        2,
        128,
        4,
        32,
        224,
        dict(V34_SETTINGS, num_splits=1, value_operand="registers", token_order="spread"),
      ),
      pytest.param(
        4,
        64,
        3,
        16,
        256,
        dict(V36_CANDIDATE, num_stages=2, num_splits=2, blocks_per_copy=2, token_order="spread"),
        marks=pytest.mark.slow,
      ),
      # each channel's own value slot picked by the kernel (v38): two slots of 4 rows under the
      # Hopper default's word order; eight slots of 1 row; v36's candidate at 3 heads per KV head
      (2, 128, 4, 32, 224, dict(V34_SETTINGS, num_splits=2, partial_slots="own")),
      pytest.param(
        2,
        128,
        1,
        32,
        160,
        dict(block_tokens=64, num_splits=2, partial_slots="own"),
        marks=pytest.mark.slow,
      ),
      pytest.param(
        4,
        64,
        3,
        16,
        256,
        dict(V36_CANDIDATE, num_stages=2, num_splits=2, blocks_per_copy=2, partial_slots="own"),
        marks=pytest.mark.slow,
      ),
      # the next block's Q' staged before each block's one barrier (v40): v36's candidate over a
      # split of four blocks through the four slots; two blocks per slot (the next Q' from the
      # same slot, then from the next); KIVI-4 at head_dim 64 with two splits, each channel's own
      # slot
      pytest.param(
        2,
        128,
        4,
        32,
        224,
        dict(V36_CANDIDATE, num_splits=1, key_stack_timing="block_ahead"),
        marks=pytest.mark.slow,
      ),
      (
        2,
        128,
        4,
        32,
        224,
        dict(
          V36_CANDIDATE,
          num_stages=2,
          num_splits=1,
          blocks_per_copy=2,
          key_stack_timing="block_ahead",
        ),
      ),
      pytest.param(
        4,
        64,
        3,
        16,
        256,
        dict(
          V36_CANDIDATE,
          num_stages=2,
          num_splits=2,
          blocks_per_copy=2,
          partial_slots="own",
          key_stack_timing="block_ahead",
        ),
        marks=pytest.mark.slow,
      ),
      # each slot refilled in its last block's value product's shadow (v40), every slot copied
      # before the loop: two stages over six blocks (four refills), with one barrier per block
      # and with v34's settings; two stages of two blocks over seven blocks, staged operands
      (
        2,
        128,
        4,
        32,
        352,
        dict(
          V36_CANDIDATE,
          num_stages=2,
          num_splits=1,
          **V40_BOTH,
        ),
      ),
      pytest.param(
        2,
        128,
        4,
        32,
        352,
        dict(V34_SETTINGS, num_stages=2, num_splits=1, copy_issue_point="value_product"),
        marks=pytest.mark.slow,
      ),
      pytest.param(
        4,
        64,
        3,
        16,
        448,
        dict(
          block_tokens=64,
          num_stages=2,
          num_splits=1,
          blocks_per_copy=2,
          copy_issue_point="value_product",
        ),
        marks=pytest.mark.slow,
      ),
      # both at one query head per KV head (MHA: every lane's statistics, own-slot ones are
      # refused there), the form gpu_session.sh v40 times at that shape
      pytest.param(
        2,
        128,
        1,
        32,
        352,
        dict(
          V36_CANDIDATE,
          value_stat_loads="all_groups",
          num_stages=2,
          num_splits=1,
          **V40_BOTH,
        ),
        marks=pytest.mark.slow,
      ),
      # each 64-channel row tile's value product against its own P' tiles only (v41): one tile
      # each at 4 heads (with v40's settings, six blocks), two each at 8, the one tile both share
      # at 2; one row tile at head_dim 64 (all tiles, as before); staged channel-order codes in a
      # fresh accumulator
      pytest.param(2, 128, 4, 32, 352, dict(V41_NEAREST, num_splits=1), marks=pytest.mark.slow),
      (
        2,
        128,
        8,
        32,
        224,
        dict(
          V36_CANDIDATE,
          value_stat_loads="all_groups",
          num_splits=1,
          value_product_columns="own_tiles",
        ),
      ),
      pytest.param(
        4,
        128,
        2,
        32,
        192,
        dict(
          V36_CANDIDATE,
          value_stat_loads="all_groups",
          num_splits=2,
          value_product_columns="own_tiles",
        ),
        marks=pytest.mark.slow,
      ),
      pytest.param(
        4,
        64,
        4,
        32,
        224,
        dict(block_tokens=64, num_splits=2, value_product_columns="own_tiles"),
        marks=pytest.mark.slow,
      ),
      # staged codes into a fresh accumulator: the interpreter runs the row tiles' wgmmas into
      # their slices of the accumulator (register codes and the carried accumulator run as dots)
      (2, 128, 8, 16, 224, dict(block_tokens=64, num_splits=2, value_product_columns="own_tiles")),
      # the value codes by transposing matrix loads (v43), rows in their own order: v36's
      # candidate (2 bits, head_dim 128), with v40's settings at two stages, two blocks per ring
      # slot at 4 bits and 8 heads, and head_dim 64 at 4 bits (the kernel takes no 2-bit codes at
      # head_dim 64: 4 words per token)
      (2, 128, 4, 32, 352, dict(V36_CANDIDATE, value_operand="matrix_loads", num_splits=2)),
      pytest.param(
        2,
        128,
        4,
        32,
        352,
        dict(V36_CANDIDATE, value_operand="matrix_loads", num_stages=2, num_splits=1, **V40_BOTH),
        marks=pytest.mark.slow,
      ),
      pytest.param(
        4,
        128,
        8,
        32,
        320,
        dict(
          V36_CANDIDATE,
          value_operand="matrix_loads",
          value_stat_loads="all_groups",
          blocks_per_copy=2,
          num_stages=2,
          num_splits=1,
        ),
        marks=pytest.mark.slow,
      ),
      (
        4,
        64,
        4,
        16,
        224,
        dict(
          block_tokens=64,
          num_splits=2,
          key_operand="registers",
          operand_order="word",
          value_operand="matrix_loads",
        ),
      ),
      # approximate exp2 / reciprocal: timed no faster (v30), not a default
      (2, 128, 4, 32, 224, dict(block_tokens=64, operand_order="word", approx_math=True)),
      pytest.param(4, 128, 16, 32, 160, dict(num_splits=2), marks=pytest.mark.slow),
    ]
  ),
)
def test_folded_mosaic_gpu_kernel_matches_reference(
  bits, head_dim, group, group_size, tokens, config
):
  """Capacities that are not a multiple of the block, 1 to 8 key groups per block and 1 to 8
  value groups per head (stacks of 8 to 64 rows; value groups in 1, 2, 4 or 8 slots of a tile,
  a last tile with an unused slot), query groups 1 to 16, 1 to 3 splits."""
  _check(
    head_dim=head_dim,
    group=group,
    bits=bits,
    group_size=group_size,
    tokens=tokens,
    seed=bits * 7 + head_dim + group,
    **config,
  )


@pytest.mark.parametrize(
  "group,config",
  slow_if_experiment(
    [
      (4, dict(num_splits=3)),
      (3, dict(block_tokens=64, num_splits=2, key_operand="registers", operand_order="word")),
      # register value codes: the output rows in channel order under the word order (v34)
      (
        3,
        dict(
          block_tokens=64,
          num_splits=2,
          key_operand="registers",
          operand_order="word",
          value_operand="registers",
        ),
      ),
      # the merge, the picks and the word order's positions in one Triton kernel (v36)
      (
        3,
        dict(
          block_tokens=64,
          num_splits=2,
          key_operand="registers",
          operand_order="word",
          split_merge="triton",
        ),
      ),
      (4, dict(num_splits=3, split_merge="triton")),
      # each channel's own slot, picked by the kernel (v38), merged by XLA and by Triton, in the
      # word order (positions) and in channel order
      pytest.param(
        4, dict(V34_SETTINGS, num_splits=3, partial_slots="own"), marks=pytest.mark.slow
      ),
      (2, dict(V34_SETTINGS, num_splits=2, partial_slots="own", split_merge="triton")),
      (3, dict(block_tokens=64, num_splits=2, partial_slots="own", split_merge="triton")),
      # the matrix loads' row order (v43), merged by Triton and by XLA, own slots by Triton
      pytest.param(
        4,
        dict(V36_CANDIDATE, value_operand="matrix_loads", num_splits=3, split_merge="triton"),
        marks=pytest.mark.slow,
      ),
      (3, dict(V36_CANDIDATE, value_operand="matrix_loads", value_stat_loads="all_groups")),
      pytest.param(
        4,
        dict(
          V36_CANDIDATE,
          value_operand="matrix_loads",
          num_splits=2,
          partial_slots="own",
          split_merge="triton",
        ),
        marks=pytest.mark.slow,
      ),
    ]
  ),
)
def test_decode_entry_merges_before_picking_value_slots(group, config):
  """`folded_decode_attention_mosaic_gpu` merges the splits over every column and picks the
  value slots (and, in the word order, the channels) after: the reference's output and lse."""
  arrays, clean = _kivi2_inputs(seed=group, group=group)
  quantization = dict(bits=2, group_size=32)
  interpret = triton_interpret()
  out, lse = folded.folded_decode_attention_mosaic_gpu(
    *arrays, **quantization, sm_scale=0.125, interpret=interpret, **config
  )
  ref = quantized_decode_attention_reference(*clean, **quantization, sm_scale=0.125)
  assert out.shape == ref[0].shape and lse.shape == ref[1].shape
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.bfloat16, interpret))


# An experiment's own check (v35-v42: no default picks it), under -m slow.
@pytest.mark.slow
@pytest.mark.parametrize(
  "group,config",
  [
    (4, dict(V34_SETTINGS, num_splits=2)),  # two slots, word order
    (1, dict(block_tokens=64, num_splits=2)),  # eight slots, channel order
    pytest.param(
      8, dict(block_tokens=64, num_splits=2), marks=pytest.mark.slow
    ),  # one slot: the same columns
    (4, dict(V36_CANDIDATE, value_operand="matrix_loads", num_splits=2)),  # matrix-load rows
  ],
)
def test_own_slot_partials_are_the_every_slot_partials_picked_exactly(group, config):
  """The kernel's own-slot pick (a masked sum with one column kept per channel) gives exactly
  the every-slot kernel's columns of each channel's slot (`own_slot_columns`); half the bytes at
  4 heads per KV head. With two or more slots, value group 1's scale is NaN at one valid token
  of row 0, which makes the every-slot partials NaN in group 1's slot columns for every channel:
  group 0's channels must stay finite (a pick that lets the other columns' NaN through, as
  `where(kept, out, out * 0)` does, fails; XLA on CPU turns `out * mask` into a select, so
  interpret mode cannot tell that one apart)."""
  real_rows, slots = folded.value_slots(group)
  call = _kernel_outputs_call(group, group, config, nan_value_group=1 if slots > 1 else None)
  every, every_lse = call()
  own, own_lse = call(partial_slots="own")
  order = folded.value_output_order(
    config.get("operand_order", "channel"), config.get("value_operand", "shared_memory")
  )
  channels = value_row_order.channel_of_row(np.arange(128), order, 128, 2)  # each row's channel
  first_columns = own_slot_partials.slot_first_column(channels, 32, real_rows, slots)
  expected = own_slot_partials.own_slot_columns(every, first_columns, real_rows)
  assert own.shape == (*every.shape[:3], real_rows, 128)
  assert own.size * slots == every.size
  np.testing.assert_array_equal(np.asarray(own), np.asarray(expected))
  np.testing.assert_array_equal(np.asarray(own_lse), np.asarray(every_lse))
  group_zero = channels // 32 == 0  # the positions holding value group 0's channels
  if slots > 1:
    assert np.isnan(np.asarray(every)[0][..., group_zero, :]).any()
    assert np.isnan(np.asarray(own)[0][..., ~group_zero]).any()
  assert np.isfinite(np.asarray(own)[0][..., group_zero]).all()
  assert np.isfinite(np.asarray(own)[1:]).all()


# An experiment's own check (v35-v42: no default picks it), under -m slow.
@pytest.mark.slow
@pytest.mark.parametrize(
  "group,config",
  [
    (4, dict(V36_CANDIDATE, num_splits=2)),  # one tile per row tile, register value codes
    pytest.param(
      8, dict(V36_CANDIDATE, value_stat_loads="all_groups", num_splits=2), marks=pytest.mark.slow
    ),  # two per row tile
    # staged channel-order codes into a fresh accumulator: the interpreter runs the wgmmas
    (4, dict(block_tokens=64, num_splits=2)),
    pytest.param(8, dict(block_tokens=64, num_splits=2), marks=pytest.mark.slow),
  ],
)
def test_own_value_tiles_give_the_all_tiles_outputs(group, config):
  """value_product_columns="own_tiles" drops only columns no channel reads: the kernel's
  outputs (every value slot of each channel's tile) are the all-tiles kernel's. Value group 2's
  scale is NaN at one valid token of row 0: the all-tiles accumulator then holds NaN in its
  tile's columns for every channel, which the first row tile's channels (groups 0 and 1) never
  pick, and own tiles never compute; both keep those channels finite."""
  call = _kernel_outputs_call(group, group + 40, config, nan_value_group=2)
  every, every_lse = call()
  own, own_lse = call(value_product_columns="own_tiles")
  # Interpret mode takes each row tile's product as a dot of its own, which XLA on CPU may sum
  # in another order: float32 rounding apart, NaN where the other has NaN.
  scale = np.nanmax(np.abs(np.asarray(every)))
  np.testing.assert_allclose(np.asarray(own), np.asarray(every), rtol=1e-5, atol=1e-6 * scale)
  np.testing.assert_array_equal(np.asarray(own_lse), np.asarray(every_lse))
  tile_of_channel = np.arange(128) // 32 // folded.value_slots(group)[1]
  nan_tile = 2 // folded.value_slots(group)[1]  # value group 2's (channels 64-95)
  assert np.isnan(np.asarray(own)[0][..., tile_of_channel == nan_tile, :]).any()
  assert np.isfinite(np.asarray(own)[0][..., :64, :]).all()  # row tile 0 reads other tiles
  # The other rows hold no NaN statistic: NaN there would pass the comparison above unseen.
  assert np.isfinite(np.asarray(every)[1:]).all() and np.isfinite(np.asarray(own)[1:]).all()


# An experiment's own check (v35-v42: no default picks it), under -m slow.
@pytest.mark.slow
@pytest.mark.parametrize(
  "config,warpgroups,tokens",
  [
    # v41's nearest to five programs per SM, as warpgroups of one program (the reference arm
    # with the kernel's bias, whose splits are whole multiples of 8 key groups): 3 splits over
    # programs of 2 (a spare warpgroup in the last) and of 3 (one program; each warpgroup's
    # copy of the code compiles natively, so not the 5 of the static count)
    pytest.param(dict(V41_NEAREST, num_splits=3), 2, 704, marks=pytest.mark.slow),
    (dict(V41_NEAREST, num_splits=3), 3, 704),
    # v34's default (the online softmax's running max, its cross-warp max every block)
    (dict(V34_SETTINGS, num_splits=4), 2, 224),
  ],
)
def test_warpgroups_per_program_give_the_one_warpgroup_outputs(config, warpgroups, tokens):
  """Each warpgroup of a program computes its own split as a program of one warpgroup does:
  the same outputs, bit for bit, every split written (poisoned before the call)."""
  call = _kernel_outputs_call(4, 60, config, tokens=tokens)
  one, one_lse = call()
  assert one.shape[2] == config["num_splits"]  # the plan kept them
  several, several_lse = call(warpgroups_per_program=warpgroups)
  assert_all_written(several, several_lse)
  np.testing.assert_array_equal(np.asarray(several), np.asarray(one))
  np.testing.assert_array_equal(np.asarray(several_lse), np.asarray(one_lse))


@pytest.mark.parametrize("warpgroups_per_program", [0, 9, True, 2.0, "2"])
def test_bad_warpgroups_per_program_is_named(warpgroups_per_program):
  match = rf"warpgroups_per_program={re.escape(repr(warpgroups_per_program))} is not supported"
  _assert_refused_by_kernel_and_dispatch(dict(warpgroups_per_program=warpgroups_per_program), match)


@pytest.mark.parametrize(
  "config,tokens,match",
  [
    # eight warpgroups of v34's default (four 64-token stages each): about 8 x 52 KB
    (
      dict(V34_SETTINGS, warpgroups_per_program=8),
      256,
      r"warpgroups_per_program=8 needs \d+ bytes of shared memory; at most 232448 fit: lower",
    ),
    # five of the v42 candidate with one split of 136 key groups: three bias chunks each
    (
      dict(V41_NEAREST, num_splits=1, warpgroups_per_program=5),
      4352,
      r"raise num_splits \(key_bias_source='kernel' holds the bias of a split's 136 key groups\)",
    ),
  ],
)
def test_warpgroups_beyond_shared_memory_are_refused(config, tokens, match):
  arrays, quantization = _zeros_segment(tokens=tokens)
  with pytest.raises(ValueError, match=match):
    folded.folded_partials_mosaic_gpu(*arrays, **quantization, sm_scale=1.0, **config)


def _kernel_outputs_call(group, seed, config, nan_value_group=None, tokens=224):
  """`folded_kernel_outputs` on `_kivi2_inputs` with `config`, more settings to come; with
  `nan_value_group`, that value group's scale NaN at token 5 of row 0, a valid token."""
  arrays, _ = _kivi2_inputs(seed=seed, group=group, tokens=tokens)
  if nan_value_group is not None:  # v_scale [B, H, T, D / 32]
    arrays = (*arrays[:5], arrays[5].at[0, :, 5, nan_value_group].set(jnp.nan), *arrays[6:])
  return functools.partial(
    folded.folded_kernel_outputs,
    *arrays,
    bits=2,
    group_size=32,
    sm_scale=0.125,
    interpret=triton_interpret(),
    **config,
  )


def _kivi2_inputs(seed, group=4, tokens=224):
  """(poisoned, clean) inputs of head_dim 128, `group` heads per KV head, KIVI-2 with group 32,
  `tokens` tokens."""
  return _inputs(
    np.random.default_rng(seed),
    head_dim=128,
    group=group,
    bits=2,
    group_size=32,
    tokens=tokens,
    dtype=jnp.bfloat16,
  )


# An experiment's own check (v35-v42: no default picks it), under -m slow.
@pytest.mark.slow
@pytest.mark.parametrize(
  "key_bias_source,settings",
  [
    ("xla", {}),
    ("kernel", {}),
    # one barrier per block (v40) in both arms: the exact arm's Q' staged a block ahead too
    pytest.param(
      "kernel",
      dict(value_operand="registers", key_stack_timing="block_ahead"),
      marks=pytest.mark.slow,
    ),
    # the exact arm rescales a narrower accumulator (v41)
    ("kernel", dict(value_operand="registers", value_product_columns="own_tiles")),
  ],
)
def test_bound_row_max_runs_the_exact_softmax_where_the_bounds_are_loose(key_bias_source, settings):
  """row_max="bound": in one KV head of one row a key channel's scale is large while its codes
  are all 0, so its bounds are 150 (base 2) wider than its scores: a reference from them would
  sit far enough above the true max that every p underflows (the split would look empty). Those
  programs run the exact online softmax; the others keep their fixed reference; all match the
  jnp reference. With key_bias_source="kernel" each program computes its references itself
  (their agreement with XLA's: test_key_bias_in_kernel.py)."""
  head_dim, group, bits, group_size = 128, 4, 2, 32
  arrays, clean = _kivi2_inputs(33)
  queries, k_codes, k_scale = arrays[:3]
  channel = 5
  queries = queries.at[0, 1, :, channel].set(2.0)
  codes = unpack_codes(k_codes[0, 1], bits).at[:, channel].set(0)
  k_codes = k_codes.at[0, 1].set(pack_codes(codes, bits))
  loose = lambda scale: scale.at[0, 1, :, channel].set(200.0)
  arrays = (queries, k_codes, loose(k_scale), *arrays[3:])
  clean = (queries, k_codes, loose(clean[2]), *clean[3:])
  quantization = dict(bits=bits, group_size=group_size)
  sm_scale = head_dim**-0.5
  config = dict(
    V30_SETTINGS, num_splits=2, row_max="bound", key_bias_source=key_bias_source, **settings
  )

  scaled = base_two_queries(queries, sm_scale)
  plan = folded.folded_split_plan(
    queries, k_codes, config["block_tokens"], 2, group_size=32, key_bias_source=key_bias_source
  )
  references = split_softmax_references(
    *key_score_bounds(scaled, arrays[2], key_bias(scaled, arrays[3]), bits=bits),
    arrays[7],
    group_size=group_size,
    split_tokens=plan.split_tokens,
    num_splits=plan.num_splits,
  )
  exact = np.asarray(references == EXCHANGE).all(axis=-1)  # [B, H, S]
  assert exact[0, 1].all() and not exact[0, 0].any()  # both arms run in this call
  interpret = triton_interpret()
  out_t, lse_p = folded.folded_partials_mosaic_gpu(
    *arrays, **quantization, sm_scale=sm_scale, interpret=interpret, **config
  )
  assert_all_written(out_t, lse_p)
  out, lse = merge_split_partials(out_t, lse_p, group, head_dim_last=False)
  ref = quantized_decode_attention_reference(*clean, **quantization, sm_scale=sm_scale)
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.bfloat16, interpret))


# An experiment's own check (v35-v42: no default picks it), under -m slow.
@pytest.mark.slow
def test_bound_row_max_hands_on_nan_statistics_as_the_reference():
  """A NaN the cache holds for a valid token (its key group's scale or minimum, its value
  scale) makes the bounds NaN, so its split takes the exact branch, or (value scales, which no
  bound reads) reaches P': the row's output is NaN exactly where the reference's is; the split
  does not look empty."""
  arrays, clean = _kivi2_inputs(7)
  quantization = dict(bits=2, group_size=32)
  interpret = triton_interpret()
  for index in (2, 3, 5):  # k_scale, k_min, v_scale of row 1, KV head 0, its first token
    poison = lambda stats: stats.at[1, 0, 0, 3].set(jnp.nan)
    poisoned = tuple(poison(a) if i == index else a for i, a in enumerate(arrays))
    reference_inputs = tuple(poison(a) if i == index else a for i, a in enumerate(clean))
    out, lse = folded.folded_decode_attention_mosaic_gpu(
      *poisoned,
      **quantization,
      sm_scale=0.125,
      interpret=interpret,
      **dict(V30_SETTINGS, num_splits=2, row_max="bound"),
    )
    ref_out, ref_lse = quantized_decode_attention_reference(
      *reference_inputs, **quantization, sm_scale=0.125
    )
    assert np.isnan(np.asarray(ref_out)[1, 0]).any()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))


@pytest.mark.parametrize(
  "settings",
  [
    V34_SETTINGS,  # the Hopper default where the warp kernel does not run
    pytest.param(  # the kernel's bias, the bound, register values, own statistics and slots
      dict(
        V34_SETTINGS,
        key_bias_source="kernel",
        row_max="bound",
        value_operand="registers",
        value_stat_loads="own_slot",
        partial_slots="own",
        num_stages=2,
      ),
      marks=pytest.mark.slow,
    ),
  ],
)
def test_folded_mosaic_gpu_kernel_runs_without_races(monkeypatch, settings):
  """Under the interpreter's race detector: 10 blocks of 64 tokens through the ring, every slot
  refilled after the block's plain reads of it (its bias and statistics) and the staged tiles
  rewritten every block. Without the `commit_smem` after the value codes and P' are staged it
  reports the refill against the block's bias read, which no other default test catches."""
  detect_mosaic_gpu_races(monkeypatch)
  _check(
    head_dim=128, group=4, bits=2, group_size=32, tokens=640, seed=61, num_splits=1, **settings
  )


def test_folded_mosaic_gpu_kernel_batch_of_unequal_rows():
  """Five rows of different lengths, one of them empty, on the default settings."""
  _check(head_dim=128, group=4, bits=2, group_size=32, tokens=160, batch=5, seed=5, num_splits=2)


@pytest.mark.parametrize(
  "block_tokens,head_dim,group_size,group,expected",
  [
    (128, 128, 32, 4, (32, 16)),  # the shapes of record: two value groups per tile
    (64, 128, 16, 2, (32, 16)),  # eight value groups, four per tile
    (128, 128, 32, 8, (32, 32)),  # a full query group: one per tile
    (128, 64, 64, 3, (16, 8)),  # one value group, in the first of two slots
    (128, 128, 128, 1, (8, 8)),
  ],
)
def test_value_groups_share_a_tile_in_slots(block_tokens, head_dim, group_size, group, expected):
  """(N of the key product, N of the value product): 8 columns per key group, and on the value
  side 8 // R value groups per 8-column tile (R: the group padded to a power of two)."""
  assert folded.stacks(block_tokens, head_dim, group_size, group) == expected


def test_every_ring_slot_starts_where_tma_can_write():
  """Ring slot s of a buffer starts s x (one slot's bytes) past the buffer's start, and a TMA
  copy's shared-memory destination must sit on a 128-byte boundary. Over every shape the kernel
  takes, each slot's bytes are a multiple of 128; the key bias is padded to get there (an
  unpadded 64-byte slot faulted natively, KERNEL_NOTES v29), by no more than one step."""
  padded = 0
  for bits, head_dim, group_size, block_tokens, group in itertools.product(
    (2, 4), (64, 128), (16, 32, 64, 128), BLOCK_TOKENS, range(1, 17)
  ):
    if block_tokens % group_size or head_dim % group_size:
      continue
    if max(folded.stacks(block_tokens, head_dim, group_size, group)) > folded.MAX_STACK:
      continue
    for value_stats in folded.VALUE_STATS:
      slots = folded.ring_slot_shapes(group, head_dim, bits, group_size, block_tokens, value_stats)
      for name, (shape, dtype) in slots.items():
        slot_bytes = math.prod(shape) * jnp.dtype(dtype).itemsize
        assert slot_bytes % folded.TMA_SLOT_ALIGNMENT == 0, (name, shape, block_tokens, group)
    key_groups = block_tokens // group_size
    (bias_groups, rows), _ = slots["key_bias_smem"]
    # the fewest groups from a block's up that fill whole 128-byte lines
    assert bias_groups == next(g for g in itertools.count(key_groups) if g * rows * 4 % 128 == 0)
    padded += bias_groups > key_groups
  assert padded  # the shapes that faulted (block 64, group size 32: 2 groups x 8 rows) are here
  assert folded.ring_slot_shapes(4, 128, 2, 32, 64)["key_bias_smem"][0] == (4, 8)


@pytest.mark.parametrize("block_tokens,num_stages,extra", [(64, 4, 2048), (128, 2, 4096)])
def test_bound_row_max_gives_q_and_p_a_buffer_each(block_tokens, num_stages, extra):
  """Without the row max's barrier after the key product, P' may not overwrite Q': with
  row_max="bound" each has its own buffer (the smaller one, 1024-byte aligned, comes on top),
  and the v30 default's shapes of record still leave room for four programs per SM."""
  shapes = (4, 128, 2, 32, block_tokens, num_stages)
  shared = folded.shared_memory_bytes(*shapes)
  bound = folded.shared_memory_bytes(*shapes, row_max="bound")
  assert bound - shared == extra
  if block_tokens == 64:
    assert 4 * bound <= 227 * 1024 - 4 * 1024  # what an SM gives, less 1 KB per program


@pytest.mark.parametrize(
  "row_max,code_tile,extra",
  [("exchange", True, 1024), ("exchange", False, 1024), ("bound", True, 3072)],
)
def test_kernel_key_bias_memory_keeps_four_programs_per_sm(row_max, code_tile, extra):
  """key_bias_source="kernel" at the v34 default's shapes of record (KIVI-2, a 32-group split
  at 32k): no key-bias ring slot (1 KB aligned), the split's bias (2 KB: one 64-group chunk x
  8 rows), and the query halves (4 or, with "bound", 8 KB) and, without a code tile, the k_min
  tile (16 KB) in the union with Q' and P'. Four programs per SM every way: an SM's 228 KB
  less 1 KB per program (this count is an upper bound; "bound" compiles to 55 KB, sm_90a
  static count, `results/mosaic_static_cost_v35.json`)."""
  ring = folded.ring_slot_shapes(4, 128, 2, 32, 64, "separate", key_bias_source="kernel")
  assert "key_bias_smem" not in ring and len(ring) == 5
  shapes = (4, 128, 2, 32, 64, 4, "separate", row_max, code_tile)
  xla = folded.shared_memory_bytes(*shapes)
  kernel = folded.shared_memory_bytes(*shapes, key_bias_source="kernel", split_groups=32)
  assert kernel - xla == extra + (0 if code_tile else 16384)
  assert 4 * (kernel + 1024) <= 228 * 1024


def test_the_queries_buffer_holds_the_larger_of_queries_and_output():
  """The queries' buffer is shared with the output: f32 [D, rows] queries with XLA's bias, so
  "own" partials add and save nothing there; bf16 [rows, D] with the kernel's bias, where "own"
  partials (f32 [real_rows, D] at 4 of 8 rows) take 2 KB less than every slot's [D, rows]."""
  shapes = (4, 128, 2, 32, 64, 4, "separate", "bound", False)
  for source, saved in (("xla", 0), ("kernel", 2048)):
    settings = dict(key_bias_source=source, split_groups=32)
    every = folded.shared_memory_bytes(*shapes, **settings)
    own = folded.shared_memory_bytes(*shapes, **settings, partial_slots="own")
    assert every - own == saved


def test_only_register_operands_with_separate_stacks_skip_the_block_start_barrier():
  """The barrier at a block's start guards the code tile and a P' that shares Q''s buffer: it
  goes only natively, with both code operands from registers and row_max="bound"."""
  skipped = [
    settings
    for settings in itertools.product(
      folded.KEY_OPERANDS, folded.VALUE_OPERANDS, folded.ROW_MAXES, (False, True)
    )
    if not folded.needs_block_start_barrier(*settings)
  ]
  assert skipped == [
    ("registers", "registers", "bound", False),
    ("registers", "matrix_loads", "bound", False),
  ]


@pytest.mark.parametrize("operand_order", OPERAND_ORDERS)
def test_register_value_codes_put_the_output_rows_in_channel_order(operand_order):
  """`value_operand_registers` builds the value product's rows in channel order whatever the
  key side's order (checked there against the cache's codes, thread by thread): the kernel's
  output rows and the picks after it must say the same. Interpret mode stages the values in
  whichever order this names, so only this pins it."""
  assert folded.value_output_order(operand_order, "registers") == "channel"
  assert folded.value_output_order(operand_order, "shared_memory") == operand_order
  # matrix loads build them in their own row order (`value_operand_matrix_loads`)
  assert folded.value_output_order(operand_order, "matrix_loads") == "matrix"


def test_a_program_without_staged_codes_has_no_code_tile():
  """Key and value codes both from registers: natively no code tile (16 KB at head_dim 128,
  block 64), which brings KIVI-4 at the v34 default's shapes from three programs per SM to
  four; interpret mode stages every operand and keeps it."""
  assert not folded.needs_code_tile("registers", "registers", emulate=False)
  assert not folded.needs_code_tile("registers", "matrix_loads", emulate=False)
  assert folded.needs_code_tile("registers", "registers", emulate=True)
  assert folded.needs_code_tile("registers", "shared_memory", emulate=False)
  assert folded.needs_code_tile("shared_memory", "registers", emulate=False)
  shapes = (4, 128, 4, 32, 64, 4)
  staged = folded.shared_memory_bytes(*shapes, value_stats="separate")
  unstaged = folded.shared_memory_bytes(*shapes, value_stats="separate", code_tile=False)
  assert staged - unstaged == 64 * 128 * 2
  programs = lambda size: (227 * 1024) // (size + 1024)  # an SM's, 1 KB reserved per program
  assert (programs(staged), programs(unstaged)) == (3, 4)


@pytest.mark.parametrize("permuted", [False, True])
def test_pick_value_slots_takes_each_channels_rows_from_its_groups_slot(permuted):
  """...at the channel's own row, or at its operand position when the rows are permuted."""
  head_dim, rows, real_rows, group_size = 64, 8, 2, 8  # 8 value groups in 4 slots of 2 columns
  out = np.arange(3 * head_dim * rows, dtype=np.float32).reshape(3, head_dim, rows)
  positions = np.random.default_rng(0).permutation(head_dim) if permuted else None
  picked = np.asarray(folded.pick_value_slots(jnp.asarray(out), group_size, real_rows, positions))
  for channel in range(head_dim):
    slot = channel // group_size % (rows // real_rows)
    row = channel if positions is None else positions[channel]
    np.testing.assert_array_equal(
      picked[:, channel], out[:, row, slot * real_rows : (slot + 1) * real_rows]
    )


def test_value_stat_pairs_give_back_every_bf16_exactly():
  """Each (scale, minimum) word gives back both bf16 values bit for bit: signs, subnormals,
  infinities and NaN (the statistics past a row's length) included; group-major."""
  special = np.array([0.0, -0.0, 1e-40, -3.5, np.inf, -np.inf, np.nan, 65504.0], np.float32)
  rng = np.random.default_rng(0)
  values = np.concatenate([special, rng.standard_normal(56).astype(np.float32) * 100])
  scale = jnp.asarray(values.reshape(1, 1, 16, 4), jnp.bfloat16)  # [B, H, T, D / g]
  minimum = jnp.asarray(rng.permutation(values).reshape(1, 1, 16, 4), jnp.bfloat16)
  pairs = folded.group_major_value_stat_pairs(scale, minimum)
  assert pairs.dtype == jnp.uint32 and pairs.shape == (1, 1, 4, 16)

  def bits_of(x):
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32))

  for unpack, expected in (
    (folded.value_scale_of_pair, scale),
    (folded.value_minimum_of_pair, minimum),
  ):
    np.testing.assert_array_equal(bits_of(unpack(pairs)), bits_of(jnp.swapaxes(expected, 2, 3)))


def _planar_words(rng, bits, head_dim, rows=64):
  codes = rng.integers(0, 1 << bits, size=(rows, head_dim)).astype(np.uint32)
  return codes, pack_codes(jnp.asarray(codes), bits)


@pytest.mark.parametrize("bits,head_dim", [(2, 128), (4, 128), (4, 64)])
def test_staged_codes_are_subnormal_patterns_in_channel_order(bits, head_dim):
  """Natively each channel's operand is the bf16 bit pattern code << q (the number
  code * 2^(q - 133)), q = the channel's bit in its byte, in channel order."""
  codes, words = _planar_words(np.random.default_rng(bits), bits, head_dim)
  staged = folded.stage_codes(words, bits, emulate=False)
  assert staged.dtype == jnp.bfloat16 and staged.shape == codes.shape
  patterns = np.asarray(jax.lax.bitcast_convert_type(staged, jnp.uint16)).astype(np.uint32)
  bit = code_exponent(np.arange(head_dim), head_dim, bits)[None, :]
  np.testing.assert_array_equal(patterns, codes << bit)
  assert patterns.max() < 0x100  # the first two binades: linear in the pattern


@pytest.mark.parametrize("bits,head_dim", [(2, 128), (4, 64)])
def test_emulated_staged_codes_are_the_patterns_as_numbers(bits, head_dim):
  codes, words = _planar_words(np.random.default_rng(bits + 1), bits, head_dim)
  staged = np.asarray(folded.stage_codes(words, bits, emulate=True), np.float64)
  bit = code_exponent(np.arange(head_dim), head_dim, bits)[None, :]
  np.testing.assert_array_equal(staged, codes * 2.0**bit)


@pytest.mark.parametrize(
  "segment,config,match",
  [
    (dict(bits=8, head_dim=64, group_size=16), {}, r"bits=8 \(the folded variant takes \(2, 4\)"),
    (dict(group_size=128), dict(block_tokens=64), "whole key groups per block"),
    (dict(group=64, group_size=16), {}, "more than 256 rows"),
    (dict(head_dim=64, bits=2), {}, "4 code words per token"),
  ],
)
def test_folded_unsupported_segments_are_refused(segment, config, match):
  arrays, quantization = _zeros_segment(**segment)
  reason = folded.unsupported_reason(
    arrays[0], arrays[1], arrays[2], arrays[5], **quantization, **config
  )
  assert reason is not None and re.search(match, reason), reason
  with pytest.raises(ValueError, match=match):
    folded.folded_partials_mosaic_gpu(*arrays, **quantization, sm_scale=1.0, **config)


def _assert_refused_by_kernel_and_dispatch(settings: dict, match: str):
  """Both the kernel's entry point and the dispatch's config check raise ValueError(match)."""
  arrays, quantization = _zeros_segment()
  with pytest.raises(ValueError, match=match):
    folded.folded_partials_mosaic_gpu(*arrays, **quantization, sm_scale=1.0, **settings)
  with pytest.raises(ValueError, match=match):
    quantized_decode_attention_gpu.check_config(
      {"lowering": "mosaic_gpu", "variant": "folded", **settings}
    )


@pytest.mark.parametrize("row_max", ["exchange", "bound"])
def test_kernel_key_bias_refuses_a_setting_for_xlas_products(row_max):
  config = dict(key_bias_source="kernel", key_products="reduction", row_max=row_max)
  match = r"key_products='reduction' sets how XLA computes the key products; with key_bias_sou"
  _assert_refused_by_kernel_and_dispatch(config, match)


@pytest.mark.parametrize(
  "group,config,match",
  [
    (1, dict(value_stats="separate"), "1 query rows per value slot of a 8-column tile"),
    (4, dict(value_stats="pairs"), "value_stats='pairs'"),
  ],
)
def test_own_slot_statistics_are_refused_where_a_lane_spans_slots(group, config, match):
  """One query head: a lane's two columns are two slots, so no lane has one group to load."""
  arrays, quantization = _zeros_segment(group=group)
  with pytest.raises(ValueError, match=rf"{match}.*use value_stat_loads='all_groups'"):
    folded.folded_partials_mosaic_gpu(
      *arrays, **quantization, sm_scale=1.0, value_stat_loads="own_slot", **config
    )


def test_kernel_key_bias_refuses_splits_longer_than_its_buffer():
  """264 key groups in one split (132 blocks of 64 tokens), more than the 256 the bias buffer
  holds: refused with the reason (the dispatch then falls back), and two splits take it."""
  arrays, quantization = _zeros_segment(tokens=132 * 64, group_size=32)
  config = dict(key_bias_source="kernel", block_tokens=64, num_splits=1)
  match = r"key_bias_source='kernel' with 8448-token splits: 264 key groups per split, more than"
  reason = folded.unsupported_reason(
    arrays[0], arrays[1], arrays[2], arrays[5], **quantization, **config
  )
  assert reason is not None and re.search(match, reason), reason
  with pytest.raises(ValueError, match=match):
    folded.folded_partials_mosaic_gpu(*arrays, **quantization, sm_scale=1.0, **config)
  two_splits = dict(config, num_splits=2)
  assert (
    folded.unsupported_reason(
      arrays[0], arrays[1], arrays[2], arrays[5], **quantization, **two_splits
    )
    is None
  )


def test_kernel_key_bias_agrees_with_xlas_f32_bias():
  """The kernel's bias (bf16 query halves on the tensor core) against XLA's f32 einsum, the same
  kernel otherwise: far tighter than the reference tolerance, so that a lost low half (2^-9
  relative error in the bias instead of 2^-17) shows. On the H200 (v39, XLA's product then at
  its default tf32) the kernel's lse differed by up to 0.023: more than XLA's tf32 explains
  (<= 0.0026 by a CPU simulation of these inputs), about what a lost low half gives (0.014);
  with XLA's product at full precision now, a native failure here points at the kernel."""
  arrays, _ = _kivi2_inputs(11)
  # minimums far from zero, so that the bias carries most of each score
  k_min = arrays[3].astype(jnp.float32)
  arrays = (*arrays[:3], (k_min + 4.0 * jnp.sign(k_min)).astype(jnp.bfloat16), *arrays[4:])
  run = functools.partial(
    folded.folded_partials_mosaic_gpu,
    *arrays,
    bits=2,
    group_size=32,
    sm_scale=128**-0.5,
    interpret=triton_interpret(),
    **dict(V34_SETTINGS, num_splits=1),
  )
  # XLA's f32 product at full precision: on a GPU its default takes tf32 tensor cores (2^-11,
  # worse than the kernel's halves)
  with jax.default_matmul_precision("highest"):
    out_xla, lse_xla = run(key_bias_source="xla")
  out_kernel, lse_kernel = run(key_bias_source="kernel")
  finite = np.isfinite(np.asarray(lse_xla))
  assert finite.any()
  np.testing.assert_allclose(
    np.asarray(lse_kernel)[finite], np.asarray(lse_xla)[finite], rtol=0, atol=2e-4
  )
  np.testing.assert_allclose(
    np.asarray(out_kernel), np.asarray(out_xla), rtol=0, atol=2e-4 * float(jnp.abs(out_xla).max())
  )


def test_kernel_key_bias_plans_splits_of_whole_eight_group_tiles():
  """The planner lengthens splits for key_bias_source="kernel" (block 64, group 32: two groups
  per block, so splits of a multiple of four blocks), and the kernel's partials come out with
  the plan's split count."""
  arrays, quantization = _zeros_segment(tokens=1024, group_size=32)
  for source, splits in (("xla", 8), ("kernel", 4)):
    plan = folded.folded_split_plan(
      arrays[0], arrays[1], 64, 8, group_size=32, key_bias_source=source
    )
    assert plan.num_splits == splits
    assert (plan.split_tokens // 32) % 8 == 0 or source == "xla"


def test_ring_slots_of_several_blocks_plan_whole_slots_per_split():
  """blocks_per_copy: each split a whole number of ring slots (24 blocks asked in 8 splits: 3
  blocks each, or with two blocks per slot 4 each, 6 splits; with the kernel's bias also a
  multiple of 8 key groups, 4 blocks at group 32), so that no copy reaches into the next
  split."""
  arrays, _ = _zeros_segment(tokens=1536, group_size=32)
  for source, blocks_per_copy, splits in (
    ("xla", 1, 8),
    ("xla", 2, 6),
    ("xla", 4, 6),
    ("kernel", 2, 6),
  ):
    plan = folded.folded_split_plan(
      arrays[0],
      arrays[1],
      64,
      8,
      group_size=32,
      key_bias_source=source,
      blocks_per_copy=blocks_per_copy,
    )
    assert plan.num_splits == splits
    assert (plan.split_tokens // 64) % blocks_per_copy == 0


def test_two_stages_of_two_blocks_take_the_memory_of_four_stages_of_one():
  """The ring's bytes are stages x slot tokens: v36's candidate at four programs per SM either
  way; a ring past what a program may allocate is refused with the setting named."""
  shapes = (4, 128, 2, 32, 64)
  settings = dict(value_stats="separate", row_max="bound", code_tile=False)
  one = folded.shared_memory_bytes(*shapes, 4, **settings)
  assert folded.shared_memory_bytes(*shapes, 2, **settings, blocks_per_copy=2) == one
  assert folded.shared_memory_bytes(*shapes, 4, **settings, blocks_per_copy=2) > one
  folded.check_config(4, 128, 4, 32, block_tokens=128, num_stages=4, num_splits=None)
  match = r"num_stages=4, blocks_per_copy=4 and warpgroups_per_program=1 needs \d+ bytes"
  with pytest.raises(ValueError, match=match):
    folded.check_config(
      4, 128, 4, 32, block_tokens=128, num_stages=4, num_splits=None, blocks_per_copy=4
    )


@pytest.mark.parametrize("value", [3, 0, True, "2"])
def test_a_bad_blocks_per_copy_is_named(value):
  message = rf"blocks_per_copy={value!r} is not supported; allowed: \(1, 2, 4\)"
  _assert_refused_by_kernel_and_dispatch(dict(block_tokens=64, blocks_per_copy=value), message)
  with pytest.raises(ValueError, match=r"\['blocks_per_copy'\] are taken by the folded Mosaic"):
    quantized_decode_attention_gpu.check_config({"lowering": "mosaic_gpu", "blocks_per_copy": 2})


def test_the_spread_token_order_needs_register_value_codes():
  arrays, quantization = _zeros_segment()
  with pytest.raises(ValueError, match=r"token_order='spread' with value_operand='shared_memory'"):
    folded.folded_partials_mosaic_gpu(
      *arrays, **quantization, sm_scale=1.0, block_tokens=64, token_order="spread"
    )
  with pytest.raises(ValueError, match=r"\(value_operand='registers'\)"):
    quantized_decode_attention_gpu.check_config(
      {"lowering": "mosaic_gpu", "variant": "folded", "token_order": "spread"}
    )
  _assert_refused_by_kernel_and_dispatch(
    dict(V36_CANDIDATE, value_operand="matrix_loads", token_order="spread"),
    r"token_order='spread' with value_operand='matrix_loads'",
  )


@pytest.mark.parametrize(
  "name,value",
  [("row_max", "exchange"), ("key_operand", "shared_memory"), ("value_operand", "shared_memory")],
)
def test_one_barrier_per_block_needs_separate_stacks_and_register_operands(name, value):
  """key_stack_timing="block_ahead" is refused, naming the setting, where its one barrier per
  block would not order the buffers it relies on: Q' and P' sharing a buffer (row_max
  "exchange") or a staged code tile (either code operand from shared memory)."""
  settings = dict(V36_CANDIDATE, key_stack_timing="block_ahead", **{name: value})
  needed = dict(row_max="bound", key_operand="registers", value_operand="registers")[name]
  message = rf"key_stack_timing='block_ahead' needs {name}='{needed}' \(got '{value}'\)"
  _assert_refused_by_kernel_and_dispatch(settings, message)


@pytest.mark.parametrize("key_bias_source,extra", [("kernel", 0), ("xla", 6144)])
def test_one_barrier_per_block_doubles_q_and_p(key_bias_source, extra):
  """ "block_ahead" gives Q' (4 KB at the shapes of record) and P' (2 KB) two buffers each. With
  the kernel's bias they sit in the union with its prologue's buffers (the query halves and the
  k_min tile, 24 KB), which stays the larger: no byte more, four programs per SM; with XLA's
  bias 6 KB more."""
  shapes = (4, 128, 2, 32, 64, 4, "separate", "bound", False)
  settings = dict(key_bias_source=key_bias_source, split_groups=32)
  own_block = folded.shared_memory_bytes(*shapes, **settings)
  ahead = folded.shared_memory_bytes(*shapes, **settings, key_stack_timing="block_ahead")
  assert ahead - own_block == extra
  assert 4 * (ahead + 1024) <= 228 * 1024


def test_own_value_tiles_are_refused_for_word_order_rows():
  """v34's settings stage the value codes in the word order: a 64-row tile of the value product
  then holds channels of value groups 0 and 2, which no single P' tile range serves."""
  message = "value_product_columns='own_tiles' needs the value product's rows in channel order"
  _assert_refused_by_kernel_and_dispatch(
    dict(V34_SETTINGS, value_product_columns="own_tiles"), message
  )
  # with register value codes the rows are channels whatever the key side's order
  quantized_decode_attention_gpu.check_config(
    dict(FOLDED_MOSAIC_GPU_V34, value_operand="registers", value_product_columns="own_tiles")
  )
  # matrix loads take them in their own order
  _assert_refused_by_kernel_and_dispatch(
    dict(V36_CANDIDATE, value_operand="matrix_loads", value_product_columns="own_tiles"), message
  )


def test_folded_refuses_non_bf16_statistics():
  arrays, quantization = _zeros_segment()
  arrays = tuple(a.astype(jnp.float16) if a.dtype == jnp.bfloat16 else a for a in arrays)
  with pytest.raises(ValueError, match="statistics dtype float16 .the folded variant"):
    folded.folded_partials_mosaic_gpu(*arrays, **quantization, sm_scale=1.0)


def test_bad_mosaic_gpu_variant_is_named():
  with pytest.raises(ValueError, match="variant='fold' is not a Mosaic GPU quantized kernel; "):
    quantized_decode_attention_gpu.check_config({"lowering": "mosaic_gpu", "variant": "fold"})
  with pytest.raises(ValueError, match="allowed: dequantize, folded"):
    quantized_decode_attention_gpu.check_config({"lowering": "mosaic_gpu", "variant": "planar"})


@pytest.mark.parametrize(
  "name,value",
  [
    ("key_operand", "smem"),
    ("operand_order", "words"),
    ("copy_issuer", "warp"),
    ("value_accumulator", "kept"),
    ("value_stats", "pair"),
    ("row_max", "max"),
    ("key_products", "dot"),
    ("value_operand", "regs"),
    ("key_bias_source", "smem"),
    ("split_merge", "kernel"),
    ("value_stat_loads", "mine"),
    ("token_order", "mixed"),
    ("partial_slots", "mine"),
    ("key_stack_timing", "early"),
    ("copy_issue_point", "block_end"),
    ("value_product_columns", "own"),
  ],
)
def test_a_bad_setting_is_named_before_tracing(name, value):
  arrays, quantization = _zeros_segment()
  for entry in (folded.folded_partials_mosaic_gpu, folded.folded_decode_attention_mosaic_gpu):
    with pytest.raises(ValueError, match=rf"{name}='{value}' is not supported; allowed: \("):
      entry(*arrays, **quantization, sm_scale=1.0, **{name: value})


@pytest.mark.parametrize(
  "name,value",
  [
    ("key_operand", "regs"),
    ("copy_issuer", "one_warp"),
    ("value_stats", "split"),
    ("row_max", "bounds"),
    ("key_products", "reduce"),
    ("value_operand", "register"),
    ("key_bias_source", "in_kernel"),
    ("split_merge", "pallas"),
    ("value_stat_loads", "own"),
    ("token_order", "spreaded"),
    ("partial_slots", "own_slot"),
    ("key_stack_timing", "ahead"),
    ("copy_issue_point", "value"),
    ("value_product_columns", "own_tile"),
  ],
)
def test_a_bad_setting_is_named_by_the_dispatch(name, value):
  with pytest.raises(ValueError, match=f"{name}='{value}' is not supported"):
    quantized_decode_attention_gpu.check_config(
      {"lowering": "mosaic_gpu", "variant": "folded", name: value}
    )


def test_folded_settings_need_the_folded_variant_and_their_types():
  with pytest.raises(ValueError, match=r"approx_math=1 is not supported; allowed: \(False, True\)"):
    quantized_decode_attention_gpu.check_config(
      {"lowering": "mosaic_gpu", "variant": "folded", "approx_math": 1}
    )
  with pytest.raises(ValueError, match=r"\['key_operand'\] are taken by the folded Mosaic GPU"):
    quantized_decode_attention_gpu.check_config(
      {"lowering": "mosaic_gpu", "key_operand": "registers"}
    )


def test_f16_segment_asking_for_folded_runs_the_triton_kernel_with_a_warning(monkeypatch):
  arrays, clean = _inputs(
    np.random.default_rng(4),
    head_dim=64,
    group=2,
    bits=4,
    group_size=32,
    tokens=128,
    dtype=jnp.float16,
  )
  quantization = dict(bits=4, group_size=32)
  monkeypatch.setattr(attention_dispatch, "_warned", set())
  with pytest.warns(RuntimeWarning, match="statistics dtype float16.*Triton kernel"):
    out, lse = attention_dispatch.quantized_decode_attention(
      *arrays,
      **quantization,
      sm_scale=0.125,
      implementation="interpret",
      kernel_config={"lowering": "mosaic_gpu", "variant": "folded"},
    )
  ref = quantized_decode_attention_reference(*clean, **quantization, sm_scale=0.125)
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.float16, True))
