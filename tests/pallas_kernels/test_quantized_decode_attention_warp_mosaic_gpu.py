"""The "warp" Mosaic GPU quantized (KIVI) decode kernel against the jnp reference, its settings
and segments, and the GPU entry point that picks it.

Interpret mode on CPU (natively with KVJAX_NATIVE_KERNELS=1 on a GPU machine) runs the kernel
with its inline pieces replaced by their jnp counterparts (`warp_key_product`,
`warp_value_product`; those are checked against the inline code, lane by lane, in
`test_warp_products_inline.py`). Inputs are poisoned as in the other Mosaic GPU kernels' tests:
NaN in every value statistic past a row's length and in every key group that starts past it, and
every buffer the kernel allocates starts as NaN.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import quantized_decode_attention_gpu
from pallas_kernels import quantized_decode_attention_warp_mosaic_gpu as warp
from pallas_kernels.quantized_decode_attention_reference import (
  quantized_decode_attention_reference,
)
from pallas_kernels.softmax_reference_bounds import EXCHANGE
from pallas_kernels.splits import SplitPlan
from tests.benchmarks.benchmark_modules import load_benchmark
from tests.pallas_kernels.kernel_checks import (
  assert_all_written,
  assert_matches_reference,
  detect_mosaic_gpu_races,
  triton_interpret,
)
from tests.pallas_kernels.test_quantized_decode_attention_mosaic_gpu import _inputs, _zeros_segment

QUANTIZATION = dict(bits=2, group_size=32)
WARP = {"lowering": "mosaic_gpu", "variant": "warp"}
# bf16 Q' and P' (as the folded kernels' operands): the folded kernels' tolerance
RTOL = 2e-2


def _check(
  *, group, tokens, seed, num_splits=None, query_scale=1.0, batch=3, bits=2, head_dim=128,
  **settings,
):  # fmt: skip
  quantization = dict(QUANTIZATION, bits=bits)
  rng = np.random.default_rng(seed)
  arrays, clean = _inputs(
    rng, head_dim=head_dim, group=group, tokens=tokens, dtype=jnp.bfloat16, batch=batch,
    **quantization,
  )  # fmt: skip
  arrays = (arrays[0] * query_scale, *arrays[1:])
  clean = (clean[0] * query_scale, *clean[1:])
  sm_scale = head_dim**-0.5
  common = dict(
    **quantization, sm_scale=sm_scale, interpret=triton_interpret(), num_splits=num_splits
  )
  # The kernel runs once, in the entry point (interpret mode takes seconds a run); its outputs,
  # recorded there, are then given to the partials' entry point in place of a second run.
  kernel_outputs = []

  def recording_kernel_outputs(*args, **kwargs):
    kernel_outputs.append(kernel_outputs_of(*args, **kwargs))
    return kernel_outputs[-1]

  kernel_outputs_of = warp.warp_kernel_outputs
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(warp, "warp_kernel_outputs", recording_kernel_outputs)
    out, lse = warp.warp_decode_attention_mosaic_gpu(*arrays, **common, **settings)
    assert len(kernel_outputs) == 1
    patch.setattr(warp, "warp_kernel_outputs", lambda *args, **kwargs: kernel_outputs[0])
    out_p, lse_p = warp.warp_partials_mosaic_gpu(*arrays, **common, **settings)
  assert_all_written(out_p, jnp.where(jnp.isneginf(lse_p), 0.0, lse_p))
  ref_out, ref_lse = quantized_decode_attention_reference(*clean, **quantization, sm_scale=sm_scale)
  assert_matches_reference(out, lse, ref_out, ref_lse, rtol=RTOL)
  return arrays


@pytest.mark.parametrize(
  "group,tokens,num_splits,bits",
  [
    pytest.param(4, 256, 2, 2, marks=pytest.mark.slow),  # (one block a split)
    (4, 512, 2, 2),  # two blocks a split: the ring's second slot and the loop's carry
    pytest.param(1, 384, 3, 2, marks=pytest.mark.slow),  # (one block a split at one head)
    pytest.param(2, 256, None, 2, marks=pytest.mark.slow),  # the planner's splits
    pytest.param(3, 640, 2, 2, marks=pytest.mark.slow),  # a split of three blocks
    (4, 512, 2, 4),  # 4-bit codes: 16 words a token, two matrix loads per 16 value tokens
    pytest.param(2, 640, None, 4, marks=pytest.mark.slow),  # (the planner's splits at 4 bits)
    (8, 512, 2, 2),  # 8 query rows: one value group per P', two MMAs an m-tile
    pytest.param(5, 640, 2, 4, marks=pytest.mark.slow),  # 5 heads padded to 8 rows, 4-bit codes
    pytest.param(6, 384, None, 2, marks=pytest.mark.slow),  # (8 rows, the planner's splits)
  ],
)
def test_warp_kernel_matches_reference(group, tokens, num_splits, bits):
  """Rows of full, partial (ending mid-block) and zero length, and random ones; 1 to 4 query
  heads per KV head (padded to 4 rows, repeated to the 8 columns) and 5 to 8 (padded to 8);
  2- and 4-bit codes."""
  _check(group=group, tokens=tokens, num_splits=num_splits, seed=group + tokens, bits=bits)


@pytest.mark.parametrize(
  "group,tokens,num_splits,bits,settings",
  [
    (4, 256, 2, 2, {}),  # 4 words a token: the key codes one word a lane, one x2 matrix load
    (8, 512, 2, 2, {}),  # 8 rows: one P' per value group (two), two MMAs an m-tile
    # 8 words a token: the word order of head_dim 128's 2-bit codes (slow: 13 s in interpret
    # mode; 4 bits at 64 run below too)
    pytest.param(3, 640, None, 4, {}, marks=pytest.mark.slow),
    pytest.param(6, 384, 2, 4, {}, marks=pytest.mark.slow),
    (4, 512, 2, 2, dict(key_bias_source="kernel")),
    pytest.param(
      5,
      1024,
      1,
      2,
      dict(copy_issuer="slot_owner", ring_release="per_warp", num_stages=3),
      marks=pytest.mark.slow,
    ),
    (2, 512, 2, 4, dict(split_merge="triton")),
  ],
)
def test_warp_kernel_at_head_dim_64(group, tokens, num_splits, bits, settings):
  """head_dim 64: 4 m-tiles a warp, value group s in half s of the rows (one P' at 4 query rows,
  two at 8), partials [256, 8], each thread finishing channel t % 64 of every other query row;
  with the kernel's bias, the per-warp ring release and the Triton merge too."""
  _check(
    group=group, tokens=tokens, num_splits=num_splits, seed=40 + group, bits=bits, head_dim=64,
    **settings,
  )  # fmt: skip


@pytest.mark.parametrize(
  "group,tokens,num_splits,num_stages",
  [
    (4, 512, 2, 2),  # splits of 8 key groups in one 64-group prologue chunk
    # 72 key groups: two chunks, the second short (slow: 10 s in interpret mode)
    pytest.param(2, 2304, 1, 2, marks=pytest.mark.slow),
    pytest.param(3, 768, None, 4, marks=pytest.mark.slow),
    (4, 512, None, None),  # 4 bits (below), the default stages
    pytest.param(7, 512, 2, 2, marks=pytest.mark.slow),  # 8 query rows
  ],
)
def test_warp_kernel_with_the_kernels_bias_and_references(group, tokens, num_splits, num_stages):
  """key_bias_source="kernel": each program computes q . k_min and its split's softmax
  references itself (`key_bias_in_kernel.split_key_statistics`, a warpgroup product per 64 key
  groups), so XLA computes no product for the kernel."""
  _check(
    group=group,
    tokens=tokens,
    num_splits=num_splits,
    seed=20 + group,
    num_stages=num_stages,
    key_bias_source="kernel",
    bits=2 if num_stages else 4,
  )


def _assert_every_split_exchanges(group, query_scale, seed=9):
  """XLA's references for `_check(group, 256 tokens, 2 splits, seed)`'s inputs: EXCHANGE in
  every split of every nonempty row (the kernel's own references use the same criterion)."""
  rng = np.random.default_rng(seed)
  arrays, _ = _inputs(
    rng, head_dim=128, group=group, tokens=256, dtype=jnp.bfloat16, batch=3, **QUANTIZATION
  )
  plan = SplitPlan(warp.BLOCK_TOKENS, 2, 1)
  *_, references = warp.kernel_inputs(
    arrays[0] * query_scale, *arrays[2:4], *arrays[5:8], sm_scale=128**-0.5, plan=plan,
    key_products="einsum",
  )  # fmt: skip
  nonempty_rows = np.asarray(arrays[7]) > 0
  assert np.all(np.asarray(references)[nonempty_rows] == EXCHANGE)


# Queries this many times larger send every split to the exact arm (asserted by
# `_assert_every_split_exchanges`); the scores' bf16 rounding in Q' grows with them, and over 8
# rows 4x reached an lse error of 0.084 (tolerance 0.06), so 8 rows take 2.5x.
EXCHANGING_QUERY_SCALE = {4: 4.0, 8: 2.5}


@pytest.mark.parametrize("group", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_the_kernels_references_choose_the_exact_arm(group):
  """Queries large enough that no split's bounds serve it (as in
  `test_wide_score_ranges_take_the_exact_arm`): the kernel's own bounds (the same criterion)
  send every split to the exact loop; at 4 and 8 query rows."""
  scale = EXCHANGING_QUERY_SCALE[group]
  _assert_every_split_exchanges(group, scale)
  _check(group=group, tokens=256, num_splits=2, seed=9, query_scale=scale, key_bias_source="kernel")


@pytest.mark.parametrize(
  "copy_issuer,ring_release,num_stages,group,key_bias_source,query_loads",
  [
    pytest.param(
      "slot_owner", "barrier", 4, 4, "xla", "per_block", marks=pytest.mark.slow
    ),  # each warp refills its own slot
    # the first warp waits for the others' arrivals; v45's queries loaded once (slow: v61's
    # candidate below takes per_warp, and query_loads="once" is no default's)
    pytest.param("first_warp", "per_warp", 2, 3, "xla", "once", marks=pytest.mark.slow),
    # warps 0-2 wait for their slots' arrivals (slow: v61's candidate, which no default picks;
    # 22 s in interpret mode)
    pytest.param("slot_owner", "per_warp", 3, 8, "kernel", "per_block", marks=pytest.mark.slow),
  ],
)
def test_copy_issuers_ring_releases_and_query_loads(
  copy_issuer, ring_release, num_stages, group, key_bias_source, query_loads
):
  """Eight blocks in one split, so every slot is refilled more than once: with
  ring_release="per_warp" each slot's barrier completes once all four warps have arrived (a
  wrong arrival count never completes, and interpret mode then hangs), and the issuing warp waits
  for each phase in turn."""
  _check(
    group=group,
    tokens=1024,
    num_splits=1,
    seed=30 + num_stages,
    num_stages=num_stages,
    copy_issuer=copy_issuer,
    ring_release=ring_release,
    key_bias_source=key_bias_source,
    query_loads=query_loads,
  )


def test_the_kernels_bias_path_runs_without_races(monkeypatch):
  """The Hopper default's path under the interpreter's happens-before race detector: the ring's
  copies and refills (5 blocks through 2 stages), the prologue, and the epilogue in the
  prologue's bytes (KERNEL_NOTES v60). The detector does not see `wgmma`'s reads, so this checks
  the copies and the plain accesses, not the union's lifetimes. Interpret mode only; 16 s."""
  detect_mosaic_gpu_races(monkeypatch)
  _check(group=3, tokens=640, num_splits=1, seed=60, key_bias_source="kernel", num_stages=2)


@pytest.mark.parametrize(
  "settings",
  [
    # the v61 sweep's candidate: each slot's copies by its own warp (slow, as every setting no
    # default picks: the GPU session's v61 step runs this file natively, slow cases included)
    pytest.param(dict(key_bias_source="kernel", copy_issuer="slot_owner"), marks=pytest.mark.slow),
    pytest.param(dict(key_bias_source="xla", copy_issuer="first_warp"), marks=pytest.mark.slow),
  ],
)
def test_the_per_warp_release_runs_without_races(monkeypatch, settings):
  """ring_release="per_warp": a slot's refill (a TMA write) waits only for the warps' arrivals,
  so the warps' reads of the slot are ordered before it by the issuing warp's proxy fence after
  the arrivals (`fence_shared_reads_before_async_writes`); without it the detector reports the
  refill against the block's reads (KERNEL_NOTES v61). 5 blocks through 2 stages; 7 s."""
  detect_mosaic_gpu_races(monkeypatch)
  _check(
    group=3, tokens=640, num_splits=1, seed=61, num_stages=2, ring_release="per_warp", **settings
  )


@pytest.mark.parametrize(
  "group,bits,head_dim,settings",
  [
    # WARP_MOSAIC_GPU_V59's settings: 32-byte rows, the ring beside the prologue's union (slow,
    # as every case here: v62's settings, which no default picks; the GPU session's v61 step
    # runs this file natively, slow cases included)
    pytest.param(
      4,
      2,
      128,
      dict(key_bias_source="kernel", num_stages=2, value_ring_layout="swizzled"),
      marks=pytest.mark.slow,
    ),
    # 64-byte rows in the value ring's union with XLA's bias's partials; 8 query rows (slow:
    # the swizzled ring once in the default run, above)
    pytest.param(
      6,
      4,
      128,
      dict(key_bias_source="xla", num_stages=2, value_ring_layout="swizzled"),
      marks=pytest.mark.slow,
    ),
    # the statistics in one ring, by matrix loads: one .x4 a tile at 4 query rows
    pytest.param(
      4,
      2,
      128,
      dict(key_bias_source="kernel", num_stages=2, statistic_loads="matrix_loads"),
      marks=pytest.mark.slow,
    ),
    pytest.param(
      3,
      4,
      64,
      dict(key_bias_source="kernel", num_stages=3, value_ring_layout="swizzled"),
      marks=pytest.mark.slow,
    ),
    # one .x2 a tile (head_dim 64, 4 rows); two .x4 (head_dim 128, 8 rows)
    pytest.param(2, 2, 64, dict(statistic_loads="matrix_loads"), marks=pytest.mark.slow),
    pytest.param(
      7,
      2,
      128,
      dict(statistic_loads="matrix_loads", value_ring_layout="swizzled"),
      marks=pytest.mark.slow,
    ),
  ],
)
def test_the_swizzled_value_ring_and_the_statistics_matrix_loads(group, bits, head_dim, settings):
  """value_ring_layout="swizzled" (the value words TMA-swizzled into their ring slots) and
  statistic_loads="matrix_loads" (both statistics in one ring, read by `ldmatrix`). Their inline
  loads are checked lane by lane in `test_warp_products_inline.py` and run here only natively;
  in interpret mode this checks the rings' copies, slices and refills, 4 blocks a split."""
  _check(
    group=group,
    tokens=512,
    num_splits=1,
    seed=62 + bits,
    bits=bits,
    head_dim=head_dim,
    **settings,
  )


@pytest.mark.slow  # 12 s in interpret mode; the other tests run 2 and 4 stages
def test_warp_kernel_with_more_stages_than_blocks_and_three_stages():
  _check(group=4, tokens=768, num_splits=1, seed=5, num_stages=3)
  _check(group=4, tokens=256, num_splits=1, seed=6, num_stages=4)


@pytest.mark.parametrize(
  "case",
  [
    dict(group=8, tokens=512, num_splits=2, seed=18),  # four sums of p v_min rescaled
    dict(group=7, tokens=512, num_splits=2, seed=19, head_dim=64),  # two, and 256 partial rows
    # three blocks in each exact split; four splits
    pytest.param(dict(group=4, tokens=768, num_splits=2, seed=7), marks=pytest.mark.slow),
    pytest.param(dict(group=2, tokens=512, num_splits=4, seed=8), marks=pytest.mark.slow),
  ],
)
def test_exact_softmax_arm(monkeypatch, case):
  """Splits whose references are EXCHANGE run the running max, reduced across the warps, and
  rescale what they carry: every other split here (the bounds would serve them all)."""
  references = warp.split_softmax_references

  def every_other_split_exchanges(*args, **kwargs):
    fixed = references(*args, **kwargs)
    split = jnp.arange(fixed.shape[2])[None, None, :, None]
    return jnp.where(split % 2 == 1, EXCHANGE, fixed)

  monkeypatch.setattr(warp, "split_softmax_references", every_other_split_exchanges)
  _check(**case)


def test_wide_score_ranges_take_the_exact_arm():
  """Queries large enough that the key statistics' bounds cannot serve a split (U - L above
  HEADROOM + UNDERFLOW_MARGIN): the exact arm, chosen by XLA's references. (4x: every split's
  bounds are too wide, and the scores' bf16 rounding in Q', which grows with them, keeps lse
  within the tolerance: 0.048 of 0.06 here, 0.35 at 30x.)"""
  _assert_every_split_exchanges(4, EXCHANGING_QUERY_SCALE[4])
  _check(group=4, tokens=256, num_splits=2, seed=9, query_scale=EXCHANGING_QUERY_SCALE[4])


def test_nan_in_a_valid_statistic_reaches_the_output():
  """NaN is never hidden: a valid token's NaN value scale makes its row's output NaN."""
  rng = np.random.default_rng(10)
  arrays, _ = _inputs(rng, head_dim=128, group=4, tokens=256, dtype=jnp.bfloat16, **QUANTIZATION)
  v_scale = arrays[5].at[0, 1, 3, 2].set(jnp.nan)
  arrays = (*arrays[:5], v_scale, *arrays[6:])
  out, _ = warp.warp_decode_attention_mosaic_gpu(
    *arrays, **QUANTIZATION, sm_scale=128**-0.5, interpret=triton_interpret(), num_splits=2
  )
  out = np.asarray(out)
  assert np.isnan(out[0, 1]).any()
  assert not np.isnan(out[0, 0]).any() and not np.isnan(out[1]).any()


@pytest.mark.parametrize(
  "case",
  [
    dict(group=4, tokens=512, num_splits=2, seed=13),
    pytest.param(
      dict(group=1, tokens=768, num_splits=3, seed=14, key_bias_source="kernel"),
      marks=pytest.mark.slow,
    ),
    pytest.param(dict(group=3, tokens=512, num_splits=2, seed=15, bits=4), marks=pytest.mark.slow),
    dict(group=7, tokens=512, num_splits=2, seed=16),  # 8 rows a split, 7 merged
  ],
)
def test_the_triton_merge_takes_the_kernels_partials(case):
  """split_merge="triton": the folded kernels' merge kernel, which takes this kernel's partials
  as own-slot partials (each channel's own slot, normalised, head dim last)."""
  _check(split_merge="triton", **case)


@pytest.mark.parametrize(
  "settings,match",
  [
    (dict(block_tokens=64), r"block_tokens=64 is not supported by the warp variant; allowed"),
    (
      dict(num_stages=5),
      r"num_stages=5 is not supported by the warp variant; allowed: \(2, 3, 4\)",
    ),
    (dict(num_splits=0), "num_splits=0"),
    (dict(key_products="gemm"), "key_products='gemm' is not supported; allowed"),
    (dict(key_bias_source="cpu"), "key_bias_source='cpu' is not supported; allowed"),
    (dict(split_merge="numpy"), "split_merge='numpy' is not supported; allowed"),
    (
      dict(copy_issuer="spread"),
      r"copy_issuer='spread' is not supported by the warp variant; allowed: \('first_warp'",
    ),
    (
      dict(ring_release="fence"),
      r"ring_release='fence' is not supported by the warp variant; allowed: \('barrier'",
    ),
    (
      dict(query_loads="twice"),
      r"query_loads='twice' is not supported by the warp variant; allowed: \('per_block'",
    ),
    (
      dict(value_ring_layout="tiled"),
      r"value_ring_layout='tiled' is not supported by the warp variant; allowed: \('rows'",
    ),
    (
      dict(statistic_loads="gather"),
      r"statistic_loads='gather' is not supported by the warp variant; allowed: \('per_token'",
    ),
  ],
)
def test_bad_settings_name_the_setting(settings, match):
  arrays, quantization = _zeros_segment()
  with pytest.raises(ValueError, match=match):
    warp.warp_decode_attention_mosaic_gpu(*arrays, **quantization, sm_scale=1.0, **settings)
  with pytest.raises(ValueError, match=match):
    quantized_decode_attention_gpu.check_config({**WARP, **settings})


def _shared_memory_bytes(scratch) -> int:
  """Shared memory a program of the kernel allocates for `scratch` (`_scratch_types`): each
  buffer rounded up to the 1024 bytes Pallas aligns it to, a union the largest of its groups,
  and the reduction scratch. The barriers are not counted: the compiled sizes match without
  them."""

  def aligned(ref):
    return -(-math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize // 1024) * 1024

  def size(entry):
    if isinstance(entry, plgpu.Barrier):
      return 0
    if isinstance(entry, tuple):  # the value statistics' two rings
      return sum(map(size, entry))
    if isinstance(entry, plgpu.RefUnion):
      return max(sum(map(aligned, jax.tree.leaves(group))) for group in entry.refs)
    return aligned(entry)

  return sum(map(size, scratch)) + warp.REDUCTION_SCRATCH_BYTES


@pytest.mark.parametrize(
  "bits,head_dim,num_stages,kernel_bias,compiled",
  [
    (2, 128, 2, True, 56320),  # WARP_MOSAIC_GPU_V59 at the shape of record
    (4, 128, 2, True, 72704),
    (2, 64, 2, True, 31744),
    (2, 128, 3, True, 67584),
    (2, 128, 4, False, 55296),  # the variant's defaults: XLA's bias, 4 stages
  ],
)
def test_shared_memory_is_what_the_compiled_kernel_allocates(
  bits, head_dim, num_stages, kernel_bias, compiled
):
  """Against the sm_90a static count of the compiled kernels (`mosaic_static_cost.py`,
  `benchmarks/results/warp_static_cost_v60*.json`, 4 query heads per KV head). With the kernel's
  bias the prologue's buffers and the epilogue's partials share bytes (KERNEL_NOTES v60): at
  2-bit codes, head_dim 128 and 2 stages that is 55 KB, four programs an SM (65 KB before:
  three), where an SM gives each of four 57 KB less the driver's 1 KB."""
  occupancy = load_benchmark("sm90_occupancy")
  scratch = warp._scratch_types(
    8,
    SplitPlan(warp.BLOCK_TOKENS, 32, 8),
    num_stages,
    bits,
    head_dim,
    kernel_bias,
    4,
    "barrier",
    "rows",
    "per_token",
  )
  shared = _shared_memory_bytes(scratch)
  assert shared == compiled
  if (bits, head_dim, num_stages, kernel_bias) == (2, 128, 2, True):
    programs = occupancy.SHARED_BYTES_PER_SM // (
      shared + occupancy.SHARED_BYTES_RESERVED_PER_PROGRAM
    )
    assert programs == 4


def test_splits_too_long_for_the_kernels_bias_are_refused():
  """At the kernel (ValueError) and at the dispatch, which runs folded Triton for them."""
  arrays, quantization = _zeros_segment(tokens=8448)
  match = "264 key groups per split, more than the 256"
  with pytest.raises(ValueError, match=match):
    warp.warp_decode_attention_mosaic_gpu(
      *arrays, **quantization, sm_scale=1.0, num_splits=1, key_bias_source="kernel"
    )
  config = {**WARP, "num_splits": 1, "key_bias_source": "kernel"}
  fallback = quantized_decode_attention_gpu.mosaic_gpu_fallback_reason(
    arrays[0], arrays[1], arrays[2], arrays[5], config=config, **quantization
  )
  assert match in fallback


def test_folded_settings_are_refused_by_name():
  with pytest.raises(ValueError, match=r"\['row_max'\] are not taken by the \"warp\""):
    quantized_decode_attention_gpu.check_config({**WARP, "row_max": "bound"})


@pytest.mark.parametrize("variant", ["folded", "dequantize"])
@pytest.mark.parametrize(
  "setting",
  [
    dict(ring_release="per_warp"),
    dict(query_loads="once"),
    dict(value_ring_layout="swizzled"),
    dict(statistic_loads="matrix_loads"),
  ],
)
def test_warp_settings_are_refused_for_other_variants(variant, setting):
  config = {"lowering": "mosaic_gpu", "variant": variant, **setting}
  with pytest.raises(ValueError, match=rf"\['{next(iter(setting))}'\] are taken by the \"warp\""):
    quantized_decode_attention_gpu.check_config(config)


@pytest.mark.parametrize(
  "segment,match",
  [
    (dict(bits=8), "bits=8"),
    (dict(head_dim=256), "head_dim=256"),
    (dict(head_dim=96, tokens=256), "head_dim=96"),
    (dict(group=9), "query group 9"),
    (dict(group_size=64, tokens=256), "group_size=64"),
  ],
)
def test_unsupported_segments_are_refused(segment, match):
  arrays, quantization = _zeros_segment(**segment)
  reason = warp.unsupported_reason(arrays[0], arrays[1], arrays[2], arrays[5], **quantization)
  assert reason is not None and match in reason
  with pytest.raises(ValueError, match=match):
    warp.warp_decode_attention_mosaic_gpu(*arrays, **quantization, sm_scale=1.0)
  fallback = quantized_decode_attention_gpu.mosaic_gpu_fallback_reason(
    arrays[0], arrays[1], arrays[2], arrays[5], config=WARP, **quantization
  )
  assert match in fallback


@pytest.mark.parametrize("head_dim", [128, 64])
def test_gpu_entry_point_runs_the_warp_kernel(monkeypatch, head_dim):
  """kernel_config {"lowering": "mosaic_gpu", "variant": "warp"} reaches this kernel (and a
  segment it does not take, the Triton kernel), at head_dim 64 with 2-bit codes too (4 words a
  token, which the other Mosaic GPU kernels refuse)."""
  calls = []
  entry = warp.warp_decode_attention_mosaic_gpu

  def counted(*args, **kwargs):
    calls.append(kwargs)
    return entry(*args, **kwargs)

  monkeypatch.setattr(warp, "warp_decode_attention_mosaic_gpu", counted)
  rng = np.random.default_rng(12)
  arrays, clean = _inputs(
    rng, head_dim=head_dim, group=4, tokens=256, dtype=jnp.bfloat16, **QUANTIZATION
  )
  sm_scale = head_dim**-0.5
  out, lse = quantized_decode_attention_gpu.quantized_decode_attention_gpu(
    *arrays, **QUANTIZATION, sm_scale=sm_scale, interpret=triton_interpret(), **WARP, num_splits=2
  )
  assert len(calls) == 1 and calls[0]["num_splits"] == 2
  ref_out, ref_lse = quantized_decode_attention_reference(*clean, **QUANTIZATION, sm_scale=sm_scale)
  assert_matches_reference(out, lse, ref_out, ref_lse, rtol=RTOL)


_LOWERED_SHAPES = [
  (2, "xla", 2, 4, 128),
  (4, "xla", 2, 4, 128),
  (2, "kernel", 2, 4, 128),
  (2, "xla", 4, 4, 128),
  (2, "kernel", 4, 4, 128),
  (4, "xla", 2, 8, 128),
  (2, "kernel", 4, 6, 128),
  (4, "xla", 2, 4, 64),
  (2, "kernel", 2, 8, 64),
  (2, "xla", 4, 3, 64),
]
_COPY_SCHEMES = [
  ("first_warp", "barrier", "per_block", "rows", "per_token"),
  ("slot_owner", "per_warp", "once", "swizzled", "matrix_loads"),
]


@pytest.mark.parametrize(
  "num_stages,key_bias_source,bits,group,head_dim,copy_issuer,ring_release,query_loads,"
  "value_ring_layout,statistic_loads",
  # Each shape with one copy scheme by default, the schemes taking turns; the other pairing of
  # every shape under -m slow.
  [
    pytest.param(*shape, *scheme, marks=() if i % 2 == j else pytest.mark.slow)
    for i, shape in enumerate(_LOWERED_SHAPES)
    for j, scheme in enumerate(_COPY_SCHEMES)
  ],
)
def test_the_kernel_lowers_for_sm90(
  num_stages,
  key_bias_source,
  bits,
  group,
  head_dim,
  copy_issuer,
  ring_release,
  query_loads,
  value_ring_layout,
  statistic_loads,
):
  """The native kernel (inline mma.sync, movmatrix, ldmatrix; the ring; both softmax arms; 4 and
  8 query rows; head_dim 64 and 128) through Mosaic GPU's layout inference and lowering for a
  CUDA target, on this jax."""
  batch, heads, tokens = 2, 2, 1024
  shape = jax.ShapeDtypeStruct
  words, groups = head_dim * bits // 32, head_dim // 32
  arrays = (
    shape((batch, heads, group, head_dim), jnp.float32),
    shape((batch, heads, tokens, words), jnp.uint32),
    shape((batch, heads, tokens // 32, head_dim), jnp.bfloat16),
    shape((batch, heads, tokens // 32, head_dim), jnp.bfloat16),
    shape((batch, heads, tokens, words), jnp.uint32),
    shape((batch, heads, tokens, groups), jnp.bfloat16),
    shape((batch, heads, tokens, groups), jnp.bfloat16),
    shape((batch,), jnp.int32),
  )
  traced = warp._jitted_kernel_outputs.trace(
    *arrays,
    sm_scale=0.1,
    plan=SplitPlan(warp.BLOCK_TOKENS, 4, 2),
    num_stages=num_stages,
    bits=bits,
    key_products="einsum",
    key_bias_source=key_bias_source,
    copy_issuer=copy_issuer,
    ring_release=ring_release,
    query_loads=query_loads,
    value_ring_layout=value_ring_layout,
    statistic_loads=statistic_loads,
    interpret=False,
  )
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
