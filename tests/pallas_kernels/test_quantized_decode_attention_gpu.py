"""The GPU entry point's measured default: what an empty kernel_config runs (KERNEL_NOTES v29,
v34, v59), on CPU in interpret mode, which picks as a Hopper GPU does."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import attention_dispatch
from pallas_kernels import (
  _compat,
  quantized_decode_attention_folded_mosaic_gpu,
  quantized_decode_attention_gpu,
  quantized_decode_attention_triton,
)
from pallas_kernels.quantized_decode_attention_reference import (
  quantized_decode_attention_reference,
)
from pallas_kernels.random_inputs import random_quantized_segment, random_queries
from tests.pallas_kernels.kernel_checks import (
  assert_matches_reference,
  poison_past_lengths,
  relative_tolerance,
)
from tests.pallas_kernels.test_quantized_decode_attention_mosaic_gpu import _inputs

pytestmark = pytest.mark.filterwarnings(
  "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)

FOLDED_MOSAIC_GPU = quantized_decode_attention_gpu.FOLDED_MOSAIC_GPU
FOLDED_MOSAIC_GPU_V30 = quantized_decode_attention_gpu.FOLDED_MOSAIC_GPU_V30
FOLDED_MOSAIC_GPU_V34 = quantized_decode_attention_gpu.FOLDED_MOSAIC_GPU_V34
WARP_MOSAIC_GPU_V59 = quantized_decode_attention_gpu.WARP_MOSAIC_GPU_V59


def _segment(*, group, dtype=jnp.bfloat16, bits=2, head_dim=128, gear=False, group_size=32):
  rng = np.random.default_rng(group)
  segment = random_quantized_segment(
    rng,
    1,
    2,
    128,
    head_dim,
    bits=bits,
    group_size=group_size,
    dtype=dtype,
    rank=2 if gear else 0,
    outliers_per_block=4 if gear else 0,
  )
  queries = random_queries(rng, 1, 2, group, head_dim)
  return queries, segment


@pytest.mark.parametrize(
  "group,dtype,bits,head_dim,gear,capability,interpret,expected",
  [
    # Hopper, or interpret mode: the warp variant with v59's settings where it takes the
    # segment, one query head per KV head included (v59 timed it faster than the folded kernels
    # and folded Triton with stack copies at each)
    (4, jnp.bfloat16, 2, 128, False, "9.0", False, WARP_MOSAIC_GPU_V59),
    (8, jnp.bfloat16, 4, 64, False, "9.0", False, WARP_MOSAIC_GPU_V59),
    (2, jnp.bfloat16, 2, 128, False, None, True, WARP_MOSAIC_GPU_V59),
    (1, jnp.bfloat16, 2, 128, False, "9.0", False, WARP_MOSAIC_GPU_V59),
    # 2-bit codes at head_dim 64 (4 words a token, which the folded kernels do not take): the
    # warp variant takes them, but its native generate check there diverged (v59): folded Triton
    (4, jnp.bfloat16, 2, 64, False, "9.0", False, {}),
    # one head, a segment no Mosaic kernel takes: folded Triton with stack copies (v29, Hopper)
    (1, jnp.float32, 2, 128, False, None, True, {"stack_copies": True}),
    (1, jnp.bfloat16, 2, 128, False, "8.0", False, {}),
    # segments no Mosaic kernel takes, and GPUs without wgmma: folded Triton
    (4, jnp.float32, 2, 128, False, "9.0", False, {}),
    (4, jnp.bfloat16, 2, 128, True, "9.0", False, {}),
    (4, jnp.bfloat16, 2, 128, False, "8.0", False, {}),
    (4, jnp.bfloat16, 2, 128, False, "10.0", False, {}),
    (4, jnp.bfloat16, 2, 128, False, None, False, {}),
    (16, jnp.bfloat16, 4, 128, False, "9.0", False, {}),  # past the query groups timed
  ],
)
def test_an_empty_config_stands_for_the_kernel_measured_fastest(
  group, dtype, bits, head_dim, gear, capability, interpret, expected, monkeypatch
):
  monkeypatch.setattr(_compat, "gpu_compute_capability", lambda: capability)
  queries, segment = _segment(group=group, dtype=dtype, bits=bits, head_dim=head_dim, gear=gear)
  assert _default_config(queries, segment, bits=bits, group_size=32, interpret=interpret) == (
    expected
  )


@pytest.mark.parametrize("group", [1, 4])
def test_group_size_64_takes_the_folded_kernel_with_v34s_settings(group, monkeypatch):
  """The warp variant takes key groups of 32 only: 64 runs v34's folded Mosaic default."""
  monkeypatch.setattr(_compat, "gpu_compute_capability", lambda: "9.0")
  queries, segment = _segment(group=group, group_size=64)
  config = _default_config(queries, segment, bits=2, group_size=64, interpret=False)
  assert config == FOLDED_MOSAIC_GPU_V34


def test_splits_too_long_for_the_warp_kernels_bias_take_the_folded_kernel(monkeypatch):
  """Splits of more than 256 key groups are past the warp kernel's bias (with batch 8 x 8 KV
  heads on an H200, contexts past ~270k tokens): v34's folded default takes those segments. Here
  the planner aims at one program, so 8448 tokens make one split of 264 key groups."""
  monkeypatch.setattr(_compat, "gpu_compute_capability", lambda: "9.0")
  monkeypatch.setattr(
    quantized_decode_attention_folded_mosaic_gpu, "gpu_target_programs", lambda: 1
  )
  rng = np.random.default_rng(0)
  segment = random_quantized_segment(
    rng, 1, 1, 8448, 128, bits=2, group_size=32, dtype=jnp.bfloat16
  )
  queries = random_queries(rng, 1, 1, 4, 128)
  reason = quantized_decode_attention_gpu.mosaic_gpu_fallback_reason(
    queries,
    segment.k_codes,
    segment.k_scale,
    segment.v_scale,
    config=WARP_MOSAIC_GPU_V59,
    bits=2,
    group_size=32,
  )
  assert reason is not None and "key groups per split" in reason
  assert _default_config(queries, segment, bits=2, group_size=32, interpret=False) == (
    FOLDED_MOSAIC_GPU_V34
  )


@pytest.mark.parametrize("group", [1, 4])
def test_group_size_128_keeps_the_block_128_default(group, monkeypatch):
  """A 128-token key group does not fit v30's 64-token blocks: v29's folded Mosaic default."""
  monkeypatch.setattr(_compat, "gpu_compute_capability", lambda: "9.0")
  queries, segment = _segment(group=group, group_size=128)
  config = _default_config(queries, segment, bits=2, group_size=128, interpret=False)
  assert config == FOLDED_MOSAIC_GPU


def _default_config(queries, segment, *, bits, group_size, interpret):
  return quantized_decode_attention_gpu.measured_default_config(
    queries,
    segment.k_codes,
    segment.k_scale,
    segment.v_scale,
    bits=bits,
    group_size=group_size,
    lowrank=segment.lowrank,
    outliers=segment.outliers,
    block=64,
    interpret=interpret,
  )


def _recording(monkeypatch, module, name, calls):
  kernel = getattr(module, name)

  def record(*args, **kwargs):
    calls.append(kwargs)
    return kernel(*args, **kwargs)

  monkeypatch.setattr(module, name, record)


def _record_both_kernels(monkeypatch, variant="folded"):
  """(calls of the variant's Mosaic GPU entry point, calls of the Triton one): each call's
  kwargs."""
  mosaic_calls, triton_calls = [], []
  module, entry_point = quantized_decode_attention_gpu.MOSAIC_GPU_KERNELS[variant]
  _recording(monkeypatch, module, entry_point, mosaic_calls)
  _recording(
    monkeypatch,
    quantized_decode_attention_triton,
    "quantized_decode_attention_triton",
    triton_calls,
  )
  return mosaic_calls, triton_calls


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no fallback warning for the default
@pytest.mark.parametrize("group", [1, 4])
def test_an_empty_config_runs_the_measured_default_kernel(group, monkeypatch):
  """One and four heads per KV head reach the warp Mosaic GPU kernel with v59's settings, and
  give the reference's attention."""
  mosaic_calls, triton_calls = _record_both_kernels(monkeypatch, variant="warp")
  arrays, clean = _inputs(
    np.random.default_rng(3),
    head_dim=128,
    group=group,
    bits=2,
    group_size=32,
    tokens=192,
    dtype=jnp.bfloat16,
  )
  quantization = dict(bits=2, group_size=32)
  out, lse = attention_dispatch.quantized_decode_attention(
    *arrays, **quantization, sm_scale=0.1, implementation="interpret"
  )
  assert len(mosaic_calls) == 1 and not triton_calls
  expected = {k: v for k, v in WARP_MOSAIC_GPU_V59.items() if k not in ("lowering", "variant")}
  assert {key: mosaic_calls[0][key] for key in expected} == expected
  ref = quantized_decode_attention_reference(*clean, **quantization, sm_scale=0.1)
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.bfloat16, True))


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_segment_the_default_mosaic_kernel_does_not_take_runs_triton_without_a_warning(
  monkeypatch,
):
  """f32 statistics: the folded Mosaic kernel refuses them; the default was not asked for by
  name, so its fallback to folded Triton says nothing (a warning would fail here)."""
  monkeypatch.setattr(attention_dispatch, "_warned", set())  # warnings are given once a process
  triton_calls = []
  _recording(
    monkeypatch,
    quantized_decode_attention_triton,
    "quantized_decode_attention_triton",
    triton_calls,
  )
  queries, segment = _segment(group=4, dtype=jnp.float32)
  lengths = jnp.asarray([100], jnp.int32)
  arrays = (queries, *segment[:6], lengths)
  quantization = dict(bits=2, group_size=32)
  out, lse = attention_dispatch.quantized_decode_attention(
    *arrays, **quantization, sm_scale=0.1, implementation="interpret"
  )
  assert len(triton_calls) == 1 and "lowering" not in triton_calls[0]
  ref = quantized_decode_attention_reference(*arrays, **quantization, sm_scale=0.1)
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.float32, True))


def test_asking_for_triton_by_name_keeps_folded_triton(monkeypatch):
  """{"lowering": "triton"} is not empty: where the default would run the Mosaic kernel (4 heads,
  bf16 statistics), the Triton kernel runs, with its own defaults."""
  mosaic_calls, triton_calls = _record_both_kernels(monkeypatch, variant="warp")
  queries, segment = _segment(group=4)
  lengths = jnp.asarray([100], jnp.int32)
  arrays = (queries, *segment[:6], lengths)
  quantization = dict(bits=2, group_size=32)
  out, lse = attention_dispatch.quantized_decode_attention(
    *arrays,
    **quantization,
    sm_scale=0.1,
    implementation="interpret",
    kernel_config={"lowering": "triton"},
  )
  assert not mosaic_calls and len(triton_calls) == 1 and "stack_copies" not in triton_calls[0]
  ref = quantized_decode_attention_reference(*arrays, **quantization, sm_scale=0.1)
  assert_matches_reference(out, lse, *ref, rtol=relative_tolerance(jnp.bfloat16, True))


@pytest.mark.parametrize("group,falls_back", [(1, True), (2, False), (4, False), (8, False)])
def test_own_slot_statistics_fall_back_where_a_lane_spans_slots(group, falls_back):
  """value_stat_loads='own_slot' at one query head per KV head (a lane's two columns in two
  value slots) runs folded Triton with a warning, as the kernel's other shape limits do; it
  raised inside the trace before."""
  queries, segment = _segment(group=group)
  config = {**FOLDED_MOSAIC_GPU_V34, "value_stat_loads": "own_slot"}
  reason = quantized_decode_attention_gpu.mosaic_gpu_fallback_reason(
    queries,
    segment.k_codes,
    segment.k_scale,
    segment.v_scale,
    config=config,
    bits=2,
    group_size=32,
    lowrank=None,
    outliers=None,
    block=64,
  )
  if falls_back:
    assert "value_stat_loads='own_slot' with 1 query rows per value slot" in reason
  else:
    assert reason is None


@pytest.mark.parametrize(
  "config",
  [
    pytest.param({"lowering": "mosaic_gpu"}, marks=pytest.mark.slow),  # 10 s, not a default
    {"lowering": "mosaic_gpu", "variant": "folded"},
    # (the warp variant's own defaults, slow: the measured default below runs the warp
    # kernel with v59's settings here)
    pytest.param({"lowering": "mosaic_gpu", "variant": "warp"}, marks=pytest.mark.slow),
    {},  # the measured default
  ],
  ids=["mosaic_dequantize", "mosaic_folded", "mosaic_warp", "default"],
)
def test_the_mosaic_gpu_kernels_ignore_garbage_past_lengths_and_capacity(config):
  """Storage past a row's length holding garbage (`poison_past_lengths`: NaN statistics,
  all-ones codes), and a length past the capacity: the clean segment's result at the capacity,
  exactly (interpreted; the Triton and TPU kernels' tests are in test_quantized_kernels.py)."""
  rng = np.random.default_rng(31)
  tokens = 640
  queries = random_queries(rng, 3, 2, 4, 128)
  segment = random_quantized_segment(
    rng, 3, 2, tokens, 128, bits=2, group_size=32, dtype=jnp.bfloat16
  )
  lengths = jnp.asarray([tokens, 333, 0], jnp.int32)
  call = lambda segment, lengths: attention_dispatch.quantized_decode_attention(
    queries,
    *segment[:6],
    lengths,
    bits=2,
    group_size=32,
    sm_scale=0.1,
    implementation="interpret",
    kernel_config=config,
  )
  clean = call(segment, lengths)
  poisoned = poison_past_lengths(segment, lengths, group_size=32)
  for result in (call(poisoned, lengths), call(segment, lengths.at[0].set(tokens + 300))):
    np.testing.assert_array_equal(np.asarray(result[0]), np.asarray(clean[0]))
    np.testing.assert_array_equal(np.asarray(result[1]), np.asarray(clean[1]))
  reference = quantized_decode_attention_reference(
    queries, *segment[:6], lengths, bits=2, group_size=32, sm_scale=0.1
  )
  assert_matches_reference(*clean, *reference, rtol=relative_tolerance(jnp.bfloat16, True))
