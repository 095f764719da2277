"""Codes to float32 by integer operations: exact values, and the folded dequantization FMA."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.bit_packing import pack_codes
from pallas_kernels.float_unpacking import field_at_mantissa_bit, magic_dequantization_constants


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**31 - 1))
def test_every_field_lands_exactly_at_its_mantissa_bit(bits, seed):
  rng = np.random.default_rng(seed)
  per_word = 32 // bits
  codes = rng.integers(0, 2**bits, size=(5, 4 * per_word))
  words = pack_codes(jnp.asarray(codes), bits)  # planar: field k holds codes [4k, 4k + 4)
  for field in range(per_word):
    got = np.asarray(field_at_mantissa_bit(words, bits, field), np.float64)
    expected = 2.0**23 + codes[:, 4 * field : 4 * field + 4] * 2.0 ** (23 - bits)
    np.testing.assert_array_equal(got, expected)


@settings(max_examples=30, deadline=None)
@given(
  bits=st.sampled_from([2, 4, 8]),
  seed=st.integers(0, 2**31 - 1),
  log_scale=st.floats(-12, 6),
)
def test_one_fma_dequantizes_to_float32_rounding(bits, seed, log_scale):
  rng = np.random.default_rng(seed)
  codes = rng.integers(0, 2**bits, size=(8, 32 // bits * 2))
  scale = np.float32(2.0**log_scale * rng.uniform(1, 2))
  minimum = np.float32(rng.normal() * 2.0**log_scale * 2**bits)
  words = pack_codes(jnp.asarray(codes), bits)
  step, shifted_min = magic_dequantization_constants(jnp.float32(scale), jnp.float32(minimum), bits)
  fields = [field_at_mantissa_bit(words, bits, f) for f in range(32 // bits)]
  got = np.concatenate([np.asarray(jnp.float32(f) * step + shifted_min) for f in fields], axis=1)
  exact = codes.astype(np.float64) * np.float64(scale) + np.float64(minimum)
  # float32 rounding of the result, of the folded minimum (a number the size of the range) and,
  # where the multiply and add are not fused (XLA on CPU), of the product (4 + code) * scale.
  size = abs(float(minimum)) + 2.0 ** (bits + 1) * float(scale)
  bound = 2.0**-24 * (np.abs(exact) + 2 * size) * 1.01
  bound += np.finfo(np.float32).tiny
  assert np.all(np.abs(got - exact) <= bound)
