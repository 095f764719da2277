"""Codes as small bf16 bit patterns (`subnormal_codes`): the patterns' values, the pairs'
values and order, the exact powers of two, the interpret-mode dot, and (natively on a GPU)
that the tensor cores take subnormal bf16 operands exactly. The folded kernel with these
operands is checked against the reference in test_quantized_kernels.py."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental import pallas as pl

from pallas_kernels.bit_packing import pack_codes
from pallas_kernels.decode_attention_triton import _dot_nn, _dot_nt
from pallas_kernels.folded_scales_kernel_triton import folded_channel_order, unpack_codes_for_dot
from pallas_kernels.subnormal_codes import (
  PROBS_EXPONENT,
  QUERY_EXPONENT,
  code_exponent,
  dot_with_code_operand,
  output_position_scale,
  power_of_two,
  query_position_scale,
)
from tests.pallas_kernels.kernel_checks import NATIVE


def _pattern_values(operands) -> np.ndarray:
  """float64 values of bf16 operands, decoded by numpy (no flushing of subnormals)."""
  bits = np.asarray(jax.lax.bitcast_convert_type(operands, jnp.uint16))
  return bits.view(ml_dtypes.bfloat16).astype(np.float64)


def test_patterns_below_0x100_are_linear_across_the_subnormal_boundary():
  patterns = np.arange(256, dtype=np.uint16)
  values = patterns.view(ml_dtypes.bfloat16).astype(np.float64)
  np.testing.assert_array_equal(values, patterns * 2.0**-133)
  # The third binade has half the resolution: 0x101 is 258 * 2^-133, so a code may not reach it.
  assert np.uint16(0x101).view(ml_dtypes.bfloat16).astype(np.float64) == 258 * 2.0**-133


@settings(max_examples=30, deadline=None)
@given(
  bits=st.sampled_from((2, 4)),
  head_dim=st.sampled_from((64, 128)),
  seed=st.integers(0, 2**31 - 1),
)
def test_pairs_are_code_times_a_power_of_two_in_the_folded_order(bits, head_dim, seed):
  codes = np.random.default_rng(seed).integers(0, 2**bits, size=(8, head_dim))
  words = pack_codes(jnp.asarray(codes, jnp.int32), bits)
  operands = unpack_codes_for_dot(words, bits, jnp.bfloat16, "subnormal")
  order = folded_channel_order(head_dim, bits, jnp.bfloat16)
  exponents = code_exponent(order, head_dim, bits)
  expected = codes[:, order] * 2.0 ** (exponents - 133.0)
  np.testing.assert_array_equal(_pattern_values(operands), expected)
  # Every pattern is below 0x100, the linear range.
  assert int(np.asarray(jax.lax.bitcast_convert_type(operands, jnp.uint16)).max()) < 256


def test_code_exponents_are_the_bit_within_the_low_byte():
  # 2-bit, D 128: W = 8 words' worth of channels per field; field k sits at bit 2k of the word.
  channels = np.arange(128)
  expected = (2 * (channels // 8)) % 8
  np.testing.assert_array_equal(code_exponent(channels, 128, 2), expected)
  np.testing.assert_array_equal(np.unique(code_exponent(channels, 128, 4)), [0, 4])


def test_power_of_two_is_exact_and_the_position_scales_undo_the_operands():
  exponents = jnp.arange(-120, 121, dtype=jnp.int32)
  np.testing.assert_array_equal(
    np.asarray(power_of_two(exponents), np.float64), 2.0 ** np.arange(-120, 121)
  )
  order = folded_channel_order(128, 2, jnp.bfloat16)
  q = code_exponent(order, 128, 2)
  np.testing.assert_array_equal(
    np.asarray(query_position_scale(order, 128, 2), np.float64), 2.0 ** (QUERY_EXPONENT - q)
  )
  # An operand c * 2^(q - 133) times the probabilities' 2^PROBS_EXPONENT, times the output
  # scale, is c.
  product = 2.0 ** (q - 133.0 + PROBS_EXPONENT) * np.asarray(
    output_position_scale(jnp.asarray(order), 128, 2), np.float64
  )
  np.testing.assert_array_equal(product, np.ones(128))


@pytest.mark.parametrize("codes_are_lhs", [True, False])
def test_emulated_dot_is_the_dot_of_the_decoded_operands(codes_are_lhs):
  rng = np.random.default_rng(3)
  codes = rng.integers(0, 4, size=(16, 64))
  words = pack_codes(jnp.asarray(codes, jnp.int32), 2)
  operands = unpack_codes_for_dot(words, 2, jnp.bfloat16, "subnormal")  # [16, 64]
  other = jnp.asarray(rng.normal(size=(16, 64)) * 2.0**60, jnp.bfloat16)
  if codes_are_lhs:
    result = dot_with_code_operand(_dot_nn, operands.T, other, codes_are_lhs=True, emulate=True)
    exact = _pattern_values(operands).T @ np.asarray(other, np.float64)
  else:
    result = dot_with_code_operand(_dot_nt, other, operands, codes_are_lhs=False, emulate=True)
    exact = np.asarray(other, np.float64) @ _pattern_values(operands).T
  np.testing.assert_allclose(np.asarray(result, np.float64), exact, rtol=1e-5, atol=0)
  assert np.abs(exact).max() > 1e-30  # the products are far from f32's subnormals


@pytest.mark.skipif(
  not (NATIVE and jax.default_backend() == "gpu"),
  reason="the tensor cores' handling of subnormal bf16 needs a GPU (KVJAX_NATIVE_KERNELS=1)",
)
def test_tensor_cores_take_subnormal_bf16_operands_exactly():
  """The hardware premise of the subnormal encoding: a Pallas (Triton) dot of subnormal-pattern
  codes with bf16 numbers gives the exact products, summed in f32."""
  rng = np.random.default_rng(5)
  codes = rng.integers(0, 4, size=(128, 128))
  words = pack_codes(jnp.asarray(codes, jnp.int32), 2)
  operands = unpack_codes_for_dot(words, 2, jnp.bfloat16, "subnormal")
  queries = jnp.asarray(rng.normal(size=(16, 128)) * 2.0**64, jnp.bfloat16)

  def kernel(q_ref, c_ref, o_ref):
    o_ref[...] = _dot_nt(q_ref[...], c_ref[...])

  result = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32))(
    queries, operands
  )
  exact = np.asarray(queries, np.float64) @ _pattern_values(operands).T
  np.testing.assert_allclose(np.asarray(result, np.float64), exact, rtol=1e-5, atol=0)
