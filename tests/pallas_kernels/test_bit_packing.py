import hypothesis
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from pallas_kernels.bit_packing import pack_codes, packed_width, unpack_codes


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
  bits=st.sampled_from([2, 4, 8]),
  words=st.integers(1, 6),
  rows=st.integers(1, 4),
  seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_and_planar_layout(bits, words, rows, seed):
  per_word = 32 // bits
  rng = np.random.default_rng(seed)
  codes = rng.integers(0, 2**bits, size=(rows, words * per_word))
  packed = np.asarray(pack_codes(jnp.asarray(codes), bits))
  assert packed.dtype == np.uint32 and packed.shape == (rows, words)
  # The pinned layout: packed[..., j] = OR_k code[..., k*W + j] << (bits*k).
  expected = np.zeros((rows, words), np.uint64)
  for k in range(per_word):
    expected |= codes[:, k * words : (k + 1) * words].astype(np.uint64) << np.uint64(bits * k)
  np.testing.assert_array_equal(packed, expected.astype(np.uint32))
  unpacked = np.asarray(unpack_codes(jnp.asarray(packed), bits))
  assert unpacked.dtype == np.uint8
  np.testing.assert_array_equal(unpacked, codes)


def test_known_words():
  # 2-bit, 32 codes -> 2 words; field k of word j holds code k*2 + j.
  codes = np.zeros(32, np.int32)
  codes[0] = 3  # word 0, field 0
  codes[1] = 1  # word 1, field 0
  codes[31] = 2  # word 1, field 15
  packed = np.asarray(pack_codes(jnp.asarray(codes), 2))
  np.testing.assert_array_equal(packed, [3, 1 | (2 << 30)])


@pytest.mark.parametrize("bits", [1, 3, 16])
def test_bad_bits_raise(bits):
  with pytest.raises(ValueError, match="bits"):
    pack_codes(jnp.zeros((4, 32), jnp.int32), bits)
  with pytest.raises(ValueError, match="bits"):
    unpack_codes(jnp.zeros((4, 2), jnp.uint32), bits)


def test_length_not_multiple_raises():
  with pytest.raises(ValueError, match="multiple of 16"):
    pack_codes(jnp.zeros((4, 24), jnp.int32), 2)
  with pytest.raises(ValueError, match="multiple of 4"):
    packed_width(6, 8)
