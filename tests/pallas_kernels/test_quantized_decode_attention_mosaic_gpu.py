"""The Mosaic GPU quantized (KIVI) decode kernel against the jnp reference, and the GPU entry point
that picks it.

Interpret mode on CPU (compiled with KVJAX_NATIVE_KERNELS=1 on a GPU machine). The interpreter
starts every buffer the kernel allocates, its outputs included, as NaN, so an element the kernel
never writes fails `assert_all_written`. Inputs are fresh random per case, with NaN in every
value statistic past a row's length and in every key group that starts past it.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention_dispatch
from pallas_kernels import quantized_decode_attention_gpu, quantized_decode_attention_mosaic_gpu
from pallas_kernels.quantized_decode_attention_mosaic_gpu import (
  group_major_value_stats,
  quantized_decode_attention_partials_mosaic_gpu,
)
from pallas_kernels.quantized_decode_attention_reference import (
  quantized_decode_attention_reference,
)
from pallas_kernels.random_inputs import random_quantized_segment, random_queries
from pallas_kernels.splits import merge_split_partials
from tests.pallas_kernels.kernel_checks import (
  assert_all_written,
  assert_matches_reference,
  detect_mosaic_gpu_races,
  relative_tolerance,
  triton_interpret,
)

pytestmark = pytest.mark.filterwarnings(
  "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)


def _inputs(rng, *, head_dim, group, bits, group_size, tokens, dtype, batch=3):
  """(poisoned, clean) kernel arguments: the reference reads the clean ones (it assumes the
  cache's zeros past a row's length), the kernel must give its result from the poisoned ones."""
  queries = random_queries(rng, batch, 2, group, head_dim)
  segment = random_quantized_segment(
    rng, batch, 2, tokens, head_dim, bits=bits, group_size=group_size, dtype=dtype
  )
  # Full row, a row ending mid-block, an empty row, then any others at random.
  lengths = [tokens, int(rng.integers(1, tokens)), 0] + list(
    rng.integers(1, tokens + 1, size=batch - 3)
  )
  lengths = jnp.asarray(lengths, jnp.int32)
  past = jnp.arange(tokens)[None, None, :, None] >= lengths[:, None, None, None]
  group_starts = jnp.arange(0, tokens, group_size)[None, None, :, None]
  group_past = group_starts >= lengths[:, None, None, None]
  k_scale = jnp.where(group_past, jnp.nan, segment.k_scale)
  k_min = jnp.where(group_past, jnp.nan, segment.k_min)
  v_scale = jnp.where(past, jnp.nan, segment.v_scale)
  v_min = jnp.where(past, jnp.nan, segment.v_min)
  poisoned = (queries, segment.k_codes, k_scale, k_min, segment.v_codes, v_scale, v_min, lengths)
  clean = (queries, *segment[:6], lengths)
  return poisoned, clean


def _check(*, head_dim, group, bits, group_size, dtype, seed, tokens=200, batch=3, **config):
  rng = np.random.default_rng(seed)
  arrays, clean = _inputs(
    rng,
    head_dim=head_dim,
    group=group,
    bits=bits,
    group_size=group_size,
    tokens=tokens,
    dtype=dtype,
    batch=batch,
  )
  quantization = dict(bits=bits, group_size=group_size)
  sm_scale = head_dim**-0.5
  interpret = triton_interpret()
  out_t, lse_p = quantized_decode_attention_partials_mosaic_gpu(
    *arrays, **quantization, sm_scale=sm_scale, interpret=interpret, **config
  )
  rows = quantized_decode_attention_mosaic_gpu.tile_rows(group)
  assert out_t.shape[-2:] == (head_dim, rows) and lse_p.shape[-1] == rows
  assert_all_written(out_t, lse_p)
  out, lse = merge_split_partials(out_t, lse_p, group, head_dim_last=False)
  ref = quantized_decode_attention_reference(*clean, **quantization, sm_scale=sm_scale)
  # K and V are staged in bf16 / f16 whatever the statistics' dtype.
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.bfloat16, interpret))


@pytest.mark.parametrize(
  "bits,head_dim,group,group_size,dtype,tokens,config",
  [
    (2, 128, 4, 32, jnp.bfloat16, 224, dict(block_tokens=128, num_stages=2, num_splits=1)),
    pytest.param(  # block 64 and splits are in the cases below too
      2,
      128,
      4,
      32,
      jnp.bfloat16,
      224,
      dict(block_tokens=64, num_stages=3, num_splits=2),
      marks=pytest.mark.slow,
    ),
    (4, 128, 8, 32, jnp.float16, 192, dict(block_tokens=64, num_stages=4, num_splits=2)),
    (4, 64, 3, 64, jnp.bfloat16, 192, dict(block_tokens=128, num_stages=3)),
    (8, 64, 1, 16, jnp.float32, 176, dict(block_tokens=64, num_stages=2, num_splits=3)),
    (2, 128, 2, 128, jnp.bfloat16, 256, dict(block_tokens=64, num_stages=2, num_splits=2)),
  ],
)
def test_mosaic_gpu_quantized_kernel_matches_reference(
  bits, head_dim, group, group_size, dtype, tokens, config
):
  """Capacities that are not a multiple of the block (the last box runs past the capacity, and
  the TMA unit fills it with zeros), key groups smaller than, equal to and larger than the
  64-token dequantization chunk, bf16 / f16 / f32 statistics, 1 to 3 splits."""
  _check(
    head_dim=head_dim,
    group=group,
    bits=bits,
    group_size=group_size,
    dtype=dtype,
    tokens=tokens,
    seed=bits * 7 + head_dim + group,
    **config,
  )


def test_mosaic_gpu_quantized_kernel_runs_without_races(monkeypatch):
  """Under the interpreter's race detector: 10 blocks through 2 ring stages, every slot refilled
  after the block's K and V were dequantized from it and staged. (It reports the partials'
  copies without the `commit_smem` before them; the staged tiles' fences are for `wgmma`, whose
  reads it does not see.)"""
  detect_mosaic_gpu_races(monkeypatch)
  _check(
    head_dim=128, group=4, bits=2, group_size=32, dtype=jnp.bfloat16, seed=61, tokens=640,
    block_tokens=64, num_stages=2, num_splits=1,
  )  # fmt: skip


def test_mosaic_gpu_quantized_kernel_batch_of_unequal_rows():
  """Five rows of different lengths, one of them empty; the capacity holds a single key group
  of 32 past the last whole block."""
  _check(
    head_dim=128,
    group=4,
    bits=2,
    group_size=32,
    dtype=jnp.bfloat16,
    tokens=160,
    batch=5,
    seed=5,
    num_splits=2,
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "bits,head_dim,group",
  [
    (bits, head_dim, group)
    for bits, head_dim, group in itertools.product((2, 4, 8), (64, 128), (1, 2, 4, 8))
    if head_dim * bits // 32 % 8 == 0
  ],
)
def test_mosaic_gpu_quantized_kernel_grid(bits, head_dim, group):
  _check(
    head_dim=head_dim,
    group=group,
    bits=bits,
    group_size=32,
    dtype=jnp.bfloat16,
    tokens=224,
    seed=bits * 31 + head_dim * 3 + group,
    num_splits=2,
  )


def test_value_statistics_are_joined_group_major():
  rng = np.random.default_rng(0)
  scale = jnp.asarray(rng.standard_normal((2, 3, 40, 4)), jnp.float32)
  minimum = jnp.asarray(rng.standard_normal((2, 3, 40, 4)), jnp.float32)
  joined = group_major_value_stats(scale, minimum)
  assert joined.shape == (2, 3, 8, 40)
  np.testing.assert_array_equal(joined[:, :, 2, :], scale[..., 2])
  np.testing.assert_array_equal(joined[:, :, 4 + 1, :], minimum[..., 1])


def _zeros_segment(*, head_dim=128, bits=2, group_size=32, tokens=256, group=4):
  dtype = jnp.bfloat16
  words = head_dim * bits // 32
  codes = jnp.zeros((1, 1, tokens, words), jnp.uint32)
  key_stats = jnp.zeros((1, 1, tokens // group_size, head_dim), dtype)
  value_stats = jnp.zeros((1, 1, tokens, head_dim // group_size), dtype)
  queries = jnp.zeros((1, 1, group, head_dim), jnp.float32)
  lengths = jnp.ones((1,), jnp.int32)
  arrays = (queries, codes, key_stats, key_stats, codes, value_stats, value_stats, lengths)
  return arrays, dict(bits=bits, group_size=group_size)


@pytest.mark.parametrize(
  "config,match",
  [
    (dict(block_tokens=32), r"block_tokens=32 is not supported; allowed: \(64, 128\)"),
    (dict(num_stages=1), r"num_stages=1 is not supported; allowed: \(2, 3, 4\)"),
    (dict(num_splits=0), "num_splits=0"),
  ],
)
def test_bad_mosaic_gpu_quantized_settings_name_the_setting(config, match):
  arrays, quantization = _zeros_segment()
  with pytest.raises(ValueError, match=match):
    quantized_decode_attention_partials_mosaic_gpu(*arrays, **quantization, sm_scale=1.0, **config)
  with pytest.raises(ValueError, match=match):
    quantized_decode_attention_gpu.check_config({"lowering": "mosaic_gpu", **config})


@pytest.mark.parametrize(
  "segment,match",
  [
    (dict(head_dim=64, bits=2), "4 code words per token"),
    (dict(tokens=252, group_size=4), "capacity 252"),
    (dict(group=65, tokens=256), "query group 65"),
    (dict(group_size=4, tokens=256), "group_size=4"),
  ],
)
def test_mosaic_gpu_quantized_unsupported_segments_are_refused(segment, match):
  arrays, quantization = _zeros_segment(**segment)
  reason = quantized_decode_attention_mosaic_gpu.unsupported_reason(
    arrays[0], arrays[1], arrays[2], arrays[5], **quantization
  )
  assert match in reason
  with pytest.raises(ValueError, match=match):
    quantized_decode_attention_partials_mosaic_gpu(*arrays, **quantization, sm_scale=1.0)


@pytest.mark.parametrize(
  "config,match",
  [
    ({"lowering": "mosaic"}, "lowering='mosaic' is not supported; allowed: triton, mosaic_gpu"),
    ({"lowering": "mosaic_gpu", "prefetch": True}, r"\['prefetch'\] are not taken"),
    ({"lowering": "mosaic_gpu", "block_tokens": 256}, "block_tokens=256"),
    ({"block_size": 64}, r"\['block_size'\] are not taken by the quantized kernel of lowering"),
  ],
)
def test_bad_quantized_gpu_config_is_named(config, match):
  with pytest.raises(ValueError, match=match):
    quantized_decode_attention_gpu.check_config(config)
  arrays, quantization = _zeros_segment()
  with pytest.raises(ValueError, match=match):
    attention_dispatch.quantized_decode_attention(
      *arrays,
      **quantization,
      sm_scale=1.0,
      implementation="interpret",
      kernel_config=config,
    )


@pytest.mark.parametrize(
  "variant,settings",
  [("dequantize", {"num_splits": 2}), ("folded", {"variant": "folded", "num_stages": 3})],
)
@pytest.mark.filterwarnings("error::RuntimeWarning")  # a fallback fails
def test_dispatch_runs_the_mosaic_gpu_quantized_kernel(variant, settings, monkeypatch):
  """The variant's own kernel is called, with its settings (and not the variant key)."""
  calls = []
  module, entry_point = quantized_decode_attention_gpu.MOSAIC_GPU_KERNELS[variant]
  kernel = getattr(module, entry_point)

  def recording(*args, **kwargs):
    calls.append(kwargs)
    return kernel(*args, **kwargs)

  monkeypatch.setattr(module, entry_point, recording)
  arrays, clean = _inputs(
    np.random.default_rng(9),
    head_dim=128,
    group=4,
    bits=4,
    group_size=32,
    tokens=192,
    dtype=jnp.bfloat16,
  )
  quantization = dict(bits=4, group_size=32)
  out, lse = attention_dispatch.quantized_decode_attention(
    *arrays,
    **quantization,
    sm_scale=0.1,
    implementation="interpret",
    kernel_config={"lowering": "mosaic_gpu", **settings},
  )
  expected = {key: value for key, value in settings.items() if key != "variant"}
  assert len(calls) == 1 and "variant" not in calls[0]
  assert {key: calls[0][key] for key in expected} == expected
  ref = quantized_decode_attention_reference(*clean, **quantization, sm_scale=0.1)
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.bfloat16, True))


def test_gear_segment_asking_for_mosaic_gpu_runs_the_triton_kernel_with_a_warning(monkeypatch):
  rng = np.random.default_rng(2)
  segment = random_quantized_segment(
    rng,
    1,
    2,
    128,
    64,
    bits=4,
    group_size=32,
    dtype=jnp.bfloat16,
    rank=2,
    outliers_per_block=8,
    block=64,
  )
  queries = random_queries(rng, 1, 2, 2, 64)
  lengths = jnp.asarray([100], jnp.int32)
  arrays = (queries, *segment[:6], lengths)
  gear = dict(bits=4, group_size=32, lowrank=segment.lowrank, outliers=segment.outliers, block=64)
  monkeypatch.setattr(attention_dispatch, "_warned", set())
  with pytest.warns(RuntimeWarning, match="GEAR's low-rank and outlier terms.*Triton kernel"):
    out, lse = attention_dispatch.quantized_decode_attention(
      *arrays,
      **gear,
      sm_scale=0.125,
      implementation="interpret",
      kernel_config={"lowering": "mosaic_gpu", "block_tokens": 128},
    )
  ref = quantized_decode_attention_reference(*arrays, **gear, sm_scale=0.125)
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.bfloat16, True))
