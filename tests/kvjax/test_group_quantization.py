import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.quantization.group_quantization import (
  check_quantization_config,
  dequantize_keys,
  dequantize_values,
  quantize_keys_per_channel,
  quantize_values_per_token,
)
from pallas_kernels.bit_packing import pack_codes, unpack_codes

PROPERTY = settings(max_examples=20, deadline=None)

# Jitted once per static configuration: a compiled program per shape is much cheaper than
# dispatching (and compiling) every primitive eagerly for each hypothesis example.
_jit = functools.partial(jax.jit, static_argnames=("bits", "group_size"))
_quantize_keys, _quantize_values = _jit(quantize_keys_per_channel), _jit(quantize_values_per_token)
_dequantize_keys, _dequantize_values = _jit(dequantize_keys), _jit(dequantize_values)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _random_data(seed, shape, spread, offset, dtype):
  """Gaussian data with a random per-channel offset (like keys' outlier channels)."""
  rng = np.random.default_rng(seed)
  data = rng.normal(size=shape) * spread + offset * rng.normal(size=shape[-1:])
  return jnp.asarray(data, jnp.float32).astype(dtype)


@PROPERTY
@given(
  bits=st.sampled_from([2, 4, 8]),
  seed=st.integers(0, 2**31 - 1),
)
def test_pack_then_unpack_is_the_identity_on_codes(bits, seed):
  lead, words = 3, 4
  length = words * 32 // bits
  codes = np.random.default_rng(seed).integers(0, 2**bits, size=(lead, 2, length))
  packed = jax.jit(pack_codes, static_argnums=1)(jnp.asarray(codes), bits)
  assert packed.dtype == jnp.uint32 and packed.shape == (lead, 2, words)
  np.testing.assert_array_equal(jax.jit(unpack_codes, static_argnums=1)(packed, bits), codes)


def _assert_within_half_step(x, restored, step):
  x = np.asarray(x, np.float32)
  error = np.abs(np.asarray(restored) - x)
  # Half a step, plus float32 rounding of the arithmetic on values of this size.
  slack = 1e-6 * (np.abs(x) + 1.0)
  assert np.all(error <= 0.5 * np.asarray(step) + slack), float((error - 0.5 * step).max())


def _assert_stats_span_each_group(groups, quantized, bits):
  """The stored minimum and step against each group's own range, from numpy: the minimum at or
  at most one unit of the stats dtype below the group's, and the step the range over
  2^bits - 1 levels, at or at most one unit above (the stats round outward, module docstring).
  `groups`: float32 [..., group elements] in the layout of the stats' [...]."""
  # one unit in the last place, relative (eps), or absolute among subnormals (float16's below
  # 6.1e-5 are on a grid of 2**-24)
  unit = float(jnp.finfo(quantized.scale.dtype).eps)
  tiny = float(jnp.finfo(quantized.scale.dtype).smallest_subnormal)
  group_min, group_max = groups.min(axis=-1), groups.max(axis=-1)
  minimum = np.asarray(quantized.minimum, np.float32)
  step = np.asarray(quantized.scale, np.float32)
  assert np.all(minimum <= group_min)
  assert np.all(minimum >= group_min - unit * np.abs(group_min) - tiny)
  exact_step = (group_max - minimum) / (2**bits - 1)
  assert np.all(step >= exact_step * (1 - 2.0**-23))
  assert np.all(step <= exact_step * (1 + 2 * unit) + tiny)


@PROPERTY
@given(
  bits=st.sampled_from([2, 4, 8]),
  dtype=st.sampled_from(sorted(DTYPES)),
  spread=st.sampled_from([0.0, 1e-3, 1.0, 30.0]),
  offset=st.sampled_from([0.0, 5.0]),
  seed=st.integers(0, 2**31 - 1),
)
def test_key_dequantization_error_is_at_most_half_a_step_per_channel_group(
  bits, dtype, spread, offset, seed
):
  # Shapes are fixed so each (bits, dtype) compiles once; the data vary across examples.
  head_dim, group_size, groups = 16, 8, 3
  keys = _random_data(seed, (2, 1, groups * group_size, head_dim), spread, offset, DTYPES[dtype])
  quantized = _quantize_keys(keys, bits=bits, group_size=group_size)
  assert quantized.codes.dtype == jnp.uint32
  assert quantized.codes.shape == (2, 1, groups * group_size, head_dim * bits // 32)
  assert quantized.scale.shape == quantized.minimum.shape == (2, 1, groups, head_dim)
  assert quantized.scale.dtype == keys.dtype  # stats in the cache dtype
  restored = _dequantize_keys(*quantized, bits=bits, group_size=group_size)
  step = np.repeat(np.asarray(quantized.scale, np.float32), group_size, axis=-2)
  _assert_within_half_step(keys.astype(jnp.float32), restored, step)
  by_group = np.asarray(keys, np.float32).reshape(2, 1, groups, group_size, head_dim)
  _assert_stats_span_each_group(np.moveaxis(by_group, 3, -1), quantized, bits)


@PROPERTY
@given(
  bits=st.sampled_from([2, 4, 8]),
  dtype=st.sampled_from(sorted(DTYPES)),
  spread=st.sampled_from([0.0, 1e-3, 1.0, 30.0]),
  offset=st.sampled_from([0.0, 5.0]),
  seed=st.integers(0, 2**31 - 1),
)
def test_value_dequantization_error_is_at_most_half_a_step_per_token_group(
  bits, dtype, spread, offset, seed
):
  head_dim, group_size, tokens = 16, 8, 3
  values = _random_data(seed, (1, 2, tokens, head_dim), spread, offset, DTYPES[dtype])
  quantized = _quantize_values(values, bits=bits, group_size=group_size)
  assert quantized.scale.shape == (1, 2, tokens, head_dim // group_size)
  restored = _dequantize_values(*quantized, bits=bits, group_size=group_size)
  step = np.repeat(np.asarray(quantized.scale, np.float32), group_size, axis=-1)
  _assert_within_half_step(values.astype(jnp.float32), restored, step)
  by_group = np.asarray(values, np.float32).reshape(1, 2, tokens, head_dim // group_size, -1)
  _assert_stats_span_each_group(by_group, quantized, bits)


def test_steps_are_the_group_range_over_the_levels():
  keys = jnp.asarray(np.arange(8 * 16, dtype=np.float32).reshape(1, 1, 8, 16))
  quantized = quantize_keys_per_channel(keys, bits=2, group_size=4)
  # Channel d of the first group holds d, d+16, d+32, d+48: range 48 over 3 levels.
  np.testing.assert_allclose(quantized.scale[0, 0], np.full((2, 16), 16.0))
  np.testing.assert_allclose(quantized.minimum[0, 0], [np.arange(16), 64 + np.arange(16)])
  np.testing.assert_array_equal(dequantize_keys(*quantized, bits=2, group_size=4), keys)


def test_constant_groups_dequantize_exactly():
  values = jnp.full((1, 1, 3, 16), -2.5, jnp.bfloat16)
  quantized = quantize_values_per_token(values, bits=2, group_size=8)
  assert np.all(np.asarray(quantized.scale, np.float32) == 0)
  np.testing.assert_array_equal(
    dequantize_values(*quantized, bits=2, group_size=8), values.astype(jnp.float32)
  )


def test_a_nan_makes_its_group_nan_and_leaves_the_others_finite():
  """A full cache hands a NaN on to attention; quantized, it must not come back finite (XLA on
  CPU skips NaN in a min along the token axis)."""
  keys = np.random.default_rng(0).normal(size=(1, 1, 16, 32)).astype(np.float32)
  keys[0, 0, 3, 5] = np.nan  # token group 0 (tokens 0..7), channel 5
  restored = np.asarray(
    dequantize_keys(
      *quantize_keys_per_channel(jnp.asarray(keys), bits=2, group_size=8), bits=2, group_size=8
    )
  )
  nan = np.isnan(restored)
  assert nan[0, 0, :8, 5].all() and nan.sum() == 8
  values = keys.copy()
  restored = np.asarray(
    dequantize_values(
      *quantize_values_per_token(jnp.asarray(values), bits=4, group_size=16), bits=4, group_size=16
    )
  )
  nan = np.isnan(restored)
  assert nan[0, 0, 3, :16].all() and nan.sum() == 16  # token 3, channel group 0


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(bits=4.0, group_size=8), "bits=4.0 is not supported"),
    (dict(bits=True, group_size=8), "bits=True is not supported"),
    (dict(bits=2, group_size=True), "group_size=True must be a positive int"),
  ],
)
def test_floats_and_bools_are_not_taken_for_ints(kwargs, message):
  with pytest.raises(ValueError, match=message):
    check_quantization_config(**kwargs)


def test_excluded_elements_do_not_stretch_the_range_and_get_code_zero():
  keys = np.random.default_rng(0).normal(size=(1, 1, 4, 8)).astype(np.float32)
  keys[0, 0, 2, 3] = 1000.0
  exclude = np.zeros(keys.shape, bool)
  exclude[0, 0, 2, 3] = True
  quantized = quantize_keys_per_channel(
    jnp.asarray(keys), bits=4, group_size=4, exclude=jnp.asarray(exclude)
  )
  restored = np.asarray(dequantize_keys(*quantized, bits=4, group_size=4))
  others = np.delete(keys[0, 0, :, 3], 2)
  assert float(quantized.scale[0, 0, 0, 3]) <= (others.max() - others.min()) / 15 * (1 + 1e-6)
  assert restored[0, 0, 2, 3] == pytest.approx(float(quantized.minimum[0, 0, 0, 3]))
  kept = ~exclude
  step = np.repeat(np.asarray(quantized.scale), 4, axis=-2)
  assert np.all(np.abs(restored - keys)[kept] <= 0.5 * step[kept] + 1e-6)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(bits=3, group_size=8), "bits=3"),
    (dict(bits=2, group_size=0), "group_size=0"),
    (dict(bits=2, group_size=24, head_dim=64), "group_size=24 must divide head_dim=64"),
    (dict(bits=2, group_size=8, head_dim=8), "multiple of 16"),
  ],
)
def test_bad_configurations_raise_clear_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    check_quantization_config(**kwargs)


def test_keys_reject_token_counts_that_are_not_whole_groups():
  with pytest.raises(ValueError, match="group_size=4 must divide the 6 tokens"):
    quantize_keys_per_channel(jnp.zeros((1, 1, 6, 16)), bits=2, group_size=4)


@pytest.mark.parametrize("quantize", [quantize_keys_per_channel, quantize_values_per_token])
def test_an_exclude_mask_of_another_shape_is_refused(quantize):
  """Reshaped, a transposed mask of the same size would mark other elements."""
  x = jnp.ones((32, 32 // 2), jnp.float32)
  with pytest.raises(
    ValueError, match=r"exclude must be a bool mask of .* \(32, 16\); got bool \(16, 32\)"
  ):
    quantize(x, bits=2, group_size=16, exclude=jnp.zeros((16, 32), bool))
