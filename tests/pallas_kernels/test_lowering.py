"""The kernels lower for their real targets (Triton IR for CUDA, Mosaic GPU for sm_90, Mosaic for
TPU) on a CPU-only machine: catches a primitive the real lowering does not support, which
interpret mode cannot. For Mosaic GPU this runs its layout inference and its lowering to the
GPU dialects (only the final compile to PTX is left to the GPU), with no target to fake: on a
machine without a GPU, Mosaic GPU lowers for sm_90.

The target device is faked by patching jax's private device-info lookups; where those internals
moved (another jax version), the test is skipped rather than failing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention_mosaic_gpu import decode_attention_mosaic_gpu
from pallas_kernels.decode_attention_tpu import decode_attention_tpu
from pallas_kernels.decode_attention_triton import decode_attention_triton
from pallas_kernels.quantized_decode_attention_folded_mosaic_gpu import (
  folded_decode_attention_mosaic_gpu,
)
from pallas_kernels.quantized_decode_attention_mosaic_gpu import (
  quantized_decode_attention_mosaic_gpu,
)
from pallas_kernels.quantized_decode_attention_tpu import quantized_decode_attention_tpu
from pallas_kernels.quantized_decode_attention_triton import quantized_decode_attention_triton
from pallas_kernels.random_inputs import random_quantized_segment
from pallas_kernels.split_merge_triton import merge_value_slot_partials_triton
from tests.pallas_kernels.test_quantized_decode_attention_folded_mosaic_gpu import (
  V31_CANDIDATE,
  V34_SETTINGS,
  V36_CANDIDATE,
  V40_BOTH,
  V41_NEAREST,
  slow_if_experiment,
)

# Lowering the Triton kernels is exactly what jax's Pallas-Triton deprecation notice is about.
pytestmark = pytest.mark.filterwarnings(
  "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)


def _quantized_args(gear: bool):
  segment = random_quantized_segment(
    np.random.default_rng(0),
    2,
    2,
    256,
    128,
    bits=2,
    group_size=32,
    dtype=jnp.bfloat16,
    rank=3 if gear else 0,
    outliers_per_block=164 if gear else 0,  # GEAR's 2% of a 64 x 128 block: 3 one-hot chunks
  )
  queries = jax.ShapeDtypeStruct((2, 2, 4, 128), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  return queries, segment, lengths


def _lower(function, platform, *args):
  return jax.jit(function).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.fixture
def fake_h100(monkeypatch):
  try:
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: info)
  except (ImportError, AttributeError) as e:
    pytest.skip(f"jax internals for a fake GPU target moved: {e}")


@pytest.fixture
def fake_tpu_v5e(monkeypatch):
  try:
    from jax._src import tpu_info
    from jax._src.pallas.mosaic import lowering

    info = tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    monkeypatch.setattr(tpu_info, "get_tpu_info", lambda: info)
    # The Mosaic lowering reads it through a forwarding module that copied the function.
    monkeypatch.setattr(lowering.tpu_info, "get_tpu_info", lambda: info)
  except (ImportError, AttributeError) as e:
    pytest.skip(f"jax internals for a fake TPU target moved: {e}")


@pytest.mark.parametrize(
  "variant,config,group",
  [
    ("reshape", {}, 4),
    ("planar", {}, 4),
    ("joined", {}, 4),
    ("folded", {}, 4),  # GEAR's terms by XLA (the default): a score bias in, the scores out
    ("folded", {"gear_terms": "kernel"}, 4),  # GEAR's terms fused, one GEAR block per step
    # 1 and 2 query heads: the stacked operands repeated 4 and 2 times, one copy's rows kept by
    # a split (which interpret mode cannot check lowers)
    ("folded", {"stack_copies": True}, 1),
    ("folded", {"stack_copies": True}, 2),
  ],
)
def test_triton_kernels_lower_to_triton_ir(fake_h100, variant, config, group):
  _, segment, lengths = _quantized_args(gear=True)
  queries = jax.ShapeDtypeStruct((2, 2, group, 128), jnp.bfloat16)
  text = _lower(
    lambda q, s, lens: quantized_decode_attention_triton(
      q,
      *s[:6],
      lens,
      bits=2,
      group_size=32,
      sm_scale=0.1,
      lowrank=s.lowrank,
      outliers=s.outliers,
      variant=variant,
      **config,
    ),
    "cuda",
    queries,
    segment,
    lengths,
  )
  assert "triton" in text
  cache = jax.ShapeDtypeStruct((2, 2, 300, 128), jnp.bfloat16)
  text = _lower(
    lambda q, k, v, lens: decode_attention_triton(q, k, v, lens, sm_scale=0.1),
    "cuda",
    queries,
    cache,
    cache,
    lengths,
  )
  assert "triton" in text


@pytest.mark.parametrize(
  "value_order,splits", [("channel", 24), ("word", 24), ("word", 700), ("matrix", 24)]
)
def test_split_merge_kernel_lowers_to_triton_ir(fake_h100, value_order, splits):
  """The merge's gathers (32 splits of a channel's slot at once, at its operand position) and
  its scattered stores, with a split count that is not a power of two, and with the many splits
  a single head gets (walked in steps)."""
  partials = jax.ShapeDtypeStruct((2, 2, splits, 128, 8), jnp.float32)
  lse = jax.ShapeDtypeStruct((2, 2, splits, 8), jnp.float32)
  text = _lower(
    lambda out, total: merge_value_slot_partials_triton(
      out, total, group=3, group_size=32, real_rows=4, value_order=value_order, bits=2
    ),
    "cuda",
    partials,
    lse,
  )
  assert "triton" in text


def test_tpu_kernels_lower_to_mosaic(fake_tpu_v5e):
  queries, segment, lengths = _quantized_args(gear=True)
  text = _lower(
    lambda q, s, lens: quantized_decode_attention_tpu(
      q, *s[:6], lens, bits=2, group_size=32, sm_scale=0.1, lowrank=s.lowrank, outliers=s.outliers
    ),
    "tpu",
    queries,
    segment,
    lengths,
  )
  assert "tpu_custom_call" in text
  cache = jax.ShapeDtypeStruct((2, 2, 300, 128), jnp.bfloat16)
  text = _lower(
    lambda q, k, v, lens: decode_attention_tpu(q, k, v, lens, sm_scale=0.1),
    "tpu",
    queries,
    cache,
    cache,
    lengths,
  )
  assert "tpu_custom_call" in text


@pytest.mark.parametrize(
  "head_dim,group,config",
  [
    (128, 4, dict(block_tokens=64, num_stages=2)),
    (128, 8, dict(block_tokens=128, num_stages=3)),
    (64, 1, dict(block_tokens=256, num_stages=3)),
    (256, 16, dict(block_tokens=64, num_stages=2)),
  ],
)
def test_mosaic_gpu_kernel_lowers_for_sm90(head_dim, group, config):
  queries = jax.ShapeDtypeStruct((2, 2, group, head_dim), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((2, 2, 296, head_dim), jnp.bfloat16)  # 296: not a block multiple
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  text = _lower(
    lambda q, k, v, lens: decode_attention_mosaic_gpu(q, k, v, lens, sm_scale=0.1, **config),
    "cuda",
    queries,
    cache,
    cache,
    lengths,
  )
  assert "mosaic_gpu" in text


@pytest.mark.parametrize(
  "kernel,bits,head_dim,group,group_size,config",
  # The experiments' settings lower under -m slow (`slow_if_experiment`).
  slow_if_experiment(
    [
      # The dequantizing kernel is opt-in and the slowest to lower (26 s): its 2-bit case is slow.
      pytest.param(
        "dequantize", 2, 128, 4, 32, dict(block_tokens=128, num_stages=3), marks=pytest.mark.slow
      ),
      ("dequantize", 4, 128, 8, 128, dict(block_tokens=64, num_stages=2)),
      ("dequantize", 8, 64, 1, 16, dict(block_tokens=64, num_stages=4)),
      ("folded", 2, 128, 4, 32, dict(block_tokens=128, num_stages=2)),
      ("folded", 4, 128, 8, 16, dict(block_tokens=64, num_stages=3)),
      # Two key groups per block: the key-bias ring's slots padded to 128 bytes, TMA filling the
      # first two groups of each (KERNEL_NOTES v29).
      ("folded", 4, 128, 8, 32, dict(block_tokens=64, num_stages=4)),
      ("folded", 4, 64, 3, 64, dict(block_tokens=128, num_stages=4)),
      # 16 rows: a wider row max through the 1 KB reduction scratch (REDUCTION_SCRATCH_BYTES).
      ("folded", 2, 128, 16, 32, dict(block_tokens=128, num_stages=2)),
      # The key codes as wgmma's register operand (v30), which interpret mode replaces by a dot.
      ("folded", 2, 128, 4, 32, dict(block_tokens=128, num_stages=2, key_operand="registers")),
      # Each masked word one operand register, built by inline Mosaic GPU code (v30).
      (
        "folded",
        2,
        128,
        4,
        32,
        dict(block_tokens=64, num_stages=4, key_operand="registers", operand_order="word"),
      ),
      # v31: the copies from the first warp (warp semantics, one barrier per slot), the value
      # product into the running accumulator (an accumulator initialised from registers).
      ("folded", 2, 128, 4, 32, V31_CANDIDATE),
      # v32: the value statistics as two group-major bf16 arrays, six copies on one barrier.
      pytest.param(
        "folded", 2, 128, 4, 32, dict(V31_CANDIDATE, value_stats="separate"), marks=pytest.mark.slow
      ),
      # v33: a fixed softmax reference per split (two TMA copies on the queries' barrier, a scalar
      # read from shared memory and a branch per block between two loop bodies).
      pytest.param(
        "folded",
        2,
        128,
        4,
        32,
        dict(V31_CANDIDATE, value_stats="separate", row_max="bound"),
        marks=pytest.mark.slow,
      ),
      # v34: the value codes as wgmma's register operand, built by inline Mosaic GPU code (loads,
      # byte permutes, masks), with and without the fixed reference; 4-bit at head_dim 64
      pytest.param(
        "folded",
        2,
        128,
        4,
        32,
        dict(V31_CANDIDATE, value_stats="separate", value_operand="registers"),
        marks=pytest.mark.slow,
      ),
      pytest.param(
        "folded",
        2,
        128,
        4,
        32,
        dict(V31_CANDIDATE, value_stats="separate", row_max="bound", value_operand="registers"),
        marks=pytest.mark.slow,
      ),
      ("folded", 4, 64, 4, 32, dict(block_tokens=128, num_stages=2, value_operand="registers")),
      # v35: q . k_min computed by the kernel before its loop (a TMA copy into the code tile, one
      # wgmma against the query halves, a store; the loop reads the split's bias at a dynamic
      # row), with and without a code tile (both code operands from registers), group size 8
      ("folded", 2, 128, 4, 32, dict(V34_SETTINGS, num_splits=1, key_bias_source="kernel")),
      pytest.param(
        "folded",
        2,
        128,
        4,
        32,
        dict(V34_SETTINGS, value_operand="registers", key_bias_source="kernel"),
        marks=pytest.mark.slow,
      ),
      ("folded", 4, 64, 4, 8, dict(block_tokens=64, num_splits=1, key_bias_source="kernel")),
      # two chunks of 64 key groups
      (
        "folded",
        2,
        128,
        4,
        8,
        dict(V34_SETTINGS, num_splits=1, key_bias_source="kernel", tokens=1024),
      ),
      # and the softmax references from the bounds (a second copy and product per chunk, a max
      # over the groups across the warps, the branch chosen from every row's reference)
      (
        "folded",
        2,
        128,
        4,
        32,
        dict(V34_SETTINGS, num_splits=1, key_bias_source="kernel", row_max="bound"),
      ),
      pytest.param(
        "folded",
        2,
        128,
        4,
        8,
        dict(V34_SETTINGS, key_bias_source="kernel", row_max="bound", tokens=1024),
        marks=pytest.mark.slow,
      ),
      # v36: each warp issuing its share of the copies (a branch per stream in warp semantics),
      # six streams and five
      ("folded", 2, 128, 4, 32, dict(V34_SETTINGS, copy_issuer="spread")),
      pytest.param(
        "folded",
        2,
        128,
        4,
        32,
        dict(V34_SETTINGS, copy_issuer="spread", key_bias_source="kernel"),
        marks=pytest.mark.slow,
      ),
      # v36: each lane loading only its own value slot's statistics (inline Mosaic GPU code: row
      # vectors whose quads hold different groups), with the Hopper default's settings and with
      # the fixed reference, the kernel's bias and register value codes
      ("folded", 2, 128, 4, 32, dict(V34_SETTINGS, value_stat_loads="own_slot")),
      (
        "folded",
        2,
        128,
        4,
        32,
        V36_CANDIDATE,
      ),
      (
        "folded",
        4,
        64,
        8,
        16,
        dict(block_tokens=128, value_stats="separate", value_stat_loads="own_slot"),
      ),
      # v37: ring slots of two blocks (each block's loads at its offset in the slot), with the
      # Hopper default's settings and with every untimed setting of v34-v36 (the fixed reference
      # in both branches of the loop's body)
      ("folded", 2, 128, 4, 32, dict(V34_SETTINGS, num_stages=2, blocks_per_copy=2)),
      pytest.param(
        "folded",
        2,
        128,
        4,
        32,
        dict(V36_CANDIDATE, num_stages=2, blocks_per_copy=2),
        marks=pytest.mark.slow,
      ),
      # v37: the value product's tokens in the spread order (the register value loads' token
      # pairs swapped in each quad's upper half, P' rows by a butterfly shuffle), with register
      # values at the Hopper default's settings and in v36's candidate at 4 bits, head_dim 64
      (
        "folded",
        2,
        128,
        4,
        32,
        dict(V34_SETTINGS, value_operand="registers", token_order="spread"),
      ),
      (
        "folded",
        4,
        64,
        4,
        16,
        dict(V36_CANDIDATE, token_order="spread"),
      ),
      # v38: each channel's own value slot picked in the epilogue (masked sums over the output's
      # columns, row vectors stored into the queries' buffer), at the Hopper default's settings
      # (word order) and in v36's candidate at one query head per KV head
      ("folded", 2, 128, 4, 32, dict(V34_SETTINGS, partial_slots="own")),
      (
        "folded",
        4,
        64,
        1,
        16,
        # one head per KV head: every lane's statistics (own-slot ones are refused there)
        dict(
          V36_CANDIDATE,
          value_stat_loads="all_groups",
          num_stages=2,
          blocks_per_copy=2,
          partial_slots="own",
        ),
      ),
      # v39: the kernel's bias over caches of 12 and 22 key groups (not whole 8-row tiles: the
      # prologue's TMA copies into a swizzled tile refused them on the H200 until k_min and
      # k_scale were padded to whole tiles), alone and in the candidate with the bounds
      ("folded", 2, 128, 4, 16, dict(V34_SETTINGS, key_bias_source="kernel", tokens=192)),
      ("folded", 2, 128, 3, 32, dict(V36_CANDIDATE, tokens=704)),
      # v40: the next block's Q' staged before each block's one barrier (Q' and P' by block
      # parity, a dynamic index into their swizzled buffers), one and two blocks per slot
      ("folded", 2, 128, 4, 32, dict(V36_CANDIDATE, key_stack_timing="block_ahead")),
      # v40: each slot refilled in its last block's value product's shadow (the copies in warp
      # semantics between the wgmma and its wait), with one barrier per block and with the
      # Hopper default's settings at two blocks per slot
      pytest.param(
        "folded",
        2,
        128,
        4,
        32,
        dict(V36_CANDIDATE, key_stack_timing="block_ahead", copy_issue_point="value_product"),
        marks=pytest.mark.slow,
      ),
      pytest.param(
        "folded",
        2,
        128,
        4,
        32,
        dict(V34_SETTINGS, num_stages=2, blocks_per_copy=2, copy_issue_point="value_product"),
        marks=pytest.mark.slow,
      ),
      pytest.param(
        "folded",
        4,
        64,
        4,
        16,
        dict(V36_CANDIDATE, num_stages=2, blocks_per_copy=2, key_stack_timing="block_ahead"),
        marks=pytest.mark.slow,
      ),
      # v41: each 64-channel row tile's value product against its own P' tiles only (wgmma into
      # row slices of the accumulator, column slices of P'): register value codes in the carried
      # accumulator with v40's settings; staged channel-order codes into a fresh one; two tiles
      # per row tile at 8 query heads
      (
        "folded",
        2,
        128,
        4,
        32,
        dict(
          V36_CANDIDATE,
          key_stack_timing="block_ahead",
          copy_issue_point="value_product",
          value_product_columns="own_tiles",
        ),
      ),
      ("folded", 2, 128, 4, 32, dict(block_tokens=64, value_product_columns="own_tiles")),
      (
        "folded",
        2,
        128,
        8,
        32,
        dict(V36_CANDIDATE, value_product_columns="own_tiles", value_stat_loads="all_groups"),
      ),
      # v42: two warpgroups a program, each its own split, code and scratch; Pallas's program-wide
      # reduction scratch is 0 bytes there, so a cross-warp reduction not given the warpgroup's
      # own would fail here: v41's nearest to five programs per SM (the kernel's bias and bounds,
      # the exchange arm's row max), and v34's default (the running max every block, XLA's bias;
      # 3 splits, the last program's second warpgroup spare)
      pytest.param(
        "folded", 2, 128, 4, 32, dict(V41_NEAREST, warpgroups_per_program=2), marks=pytest.mark.slow
      ),
      ("folded", 2, 128, 4, 32, dict(V34_SETTINGS, num_splits=3, warpgroups_per_program=2)),
      # v43: the value codes by transposing matrix loads (ldmatrix.trans of the ring slot, each
      # thread's shift and masks): v36's candidate, at two blocks per slot, with v40's settings in
      # two warpgroups a program, and at 4 bits, head_dim 128 and 64
      ("folded", 2, 128, 4, 32, dict(V36_CANDIDATE, value_operand="matrix_loads")),
      pytest.param(
        "folded",
        2,
        128,
        4,
        32,
        dict(V36_CANDIDATE, value_operand="matrix_loads", num_stages=2, blocks_per_copy=2),
        marks=pytest.mark.slow,
      ),
      (
        "folded",
        2,
        128,
        4,
        32,
        dict(
          V36_CANDIDATE,
          value_operand="matrix_loads",
          num_stages=2,
          warpgroups_per_program=2,
          **V40_BOTH,
        ),
      ),
      ("folded", 4, 128, 4, 32, dict(V36_CANDIDATE, value_operand="matrix_loads")),
      ("folded", 4, 64, 4, 16, dict(V36_CANDIDATE, value_operand="matrix_loads")),
    ]
  ),
)
def test_mosaic_gpu_quantized_kernels_lower_for_sm90(
  kernel, bits, head_dim, group, group_size, config
):
  """Layout inference included: the code words and statistics are pinned to wgmma layouts (left
  to inference, the search ran for over 10 minutes without an answer). For "folded" this is its
  native path (subnormal patterns bitcast to bf16, stacked Q' / P' stored transposed, column
  slices of the stacked scores and accumulator), which interpret mode does not take."""
  function = {
    "dequantize": quantized_decode_attention_mosaic_gpu,
    "folded": folded_decode_attention_mosaic_gpu,
  }[kernel]
  text = _lower_quantized_mosaic_gpu(function, bits, head_dim, group, group_size, config)
  assert "mosaic_gpu" in text


@pytest.mark.parametrize(
  "bits,head_dim,group,group_size,config",
  [
    (2, 128, 4, 32, dict(block_tokens=64, num_stages=2)),  # staged codes, XLA's bias, exchange
    (2, 128, 4, 32, dict(V34_SETTINGS, copy_issuer="spread")),
    (2, 128, 4, 32, dict(V36_CANDIDATE, partial_slots="own")),
    pytest.param(
      2, 128, 4, 32, dict(V36_CANDIDATE, num_stages=2, blocks_per_copy=2), marks=pytest.mark.slow
    ),
    (2, 128, 4, 32, dict(V36_CANDIDATE, token_order="spread")),
    (4, 64, 8, 16, dict(block_tokens=64, key_operand="registers", operand_order="word")),
    (4, 128, 2, 32, dict(V36_CANDIDATE, value_stat_loads="all_groups", value_stats="pairs")),
  ],
)
@pytest.mark.slow  # two warpgroups a program: v42's experiment, which no default picks
def test_folded_settings_lower_with_two_warpgroups_a_program(
  bits, head_dim, group, group_size, config
):
  """v42: with two warpgroups a program Pallas's program-wide reduction scratch is 0 bytes, so
  any reduction across warps that a setting's code path leaves on it fails here (each
  warpgroup's must take its own, `warpgroup_reductions`)."""
  text = _lower_quantized_mosaic_gpu(
    folded_decode_attention_mosaic_gpu,
    bits,
    head_dim,
    group,
    group_size,
    dict(config, warpgroups_per_program=2),
  )
  assert "mosaic_gpu" in text


def _lower_quantized_mosaic_gpu(function, bits, head_dim, group, group_size, config) -> str:
  """`function` (a quantized Mosaic GPU entry point) lowered for sm_90 on a KIVI segment of 2
  rows x 2 KV heads (`config["tokens"]` tokens, default 256) with the rest of `config`."""
  segment = random_quantized_segment(
    np.random.default_rng(0),
    2,
    2,
    config.get("tokens", 256),
    head_dim,
    bits=bits,
    group_size=group_size,
    dtype=jnp.bfloat16,
  )
  queries = jax.ShapeDtypeStruct((2, 2, group, head_dim), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  return _lower(
    lambda q, s, lens: function(
      q,
      *s[:6],
      lens,
      bits=bits,
      group_size=group_size,
      sm_scale=0.1,
      **{key: value for key, value in config.items() if key != "tokens"},
    ),
    "cuda",
    queries,
    segment,
    lengths,
  )
