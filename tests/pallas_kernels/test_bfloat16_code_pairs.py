"""`bfloat16_code_pairs`: packed 2- and 4-bit codes as bfloat16 operand rows by bit operations,
their row order and factors, against `bit_packing`'s codes."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import bfloat16_code_pairs
from pallas_kernels.bit_packing import pack_codes

code_pairs = jax.jit(bfloat16_code_pairs.code_pairs, static_argnums=1)  # pltpu.bitcast: no eager


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(
  seed=st.integers(0, 2**16),
  bits=st.sampled_from([2, 4]),
  head_dim=st.sampled_from([64, 128, 192, 256]),
  tokens=st.integers(1, 300),
)
def test_the_pairs_less_one_times_their_factors_are_the_codes(seed, bits, head_dim, tokens):
  rng = np.random.default_rng(seed)
  codes = rng.integers(0, 2**bits, (tokens, head_dim))
  words = pack_codes(jnp.asarray(codes), bits)  # [T, W]
  pairs = code_pairs(words.T, bits)
  assert pairs.shape == (head_dim, tokens) and pairs.dtype == jnp.bfloat16
  channel, factor = bfloat16_code_pairs.pair_rows(head_dim, bits)
  values = np.asarray(pairs, np.float64)
  np.testing.assert_array_equal((values - 1.0) * factor[:, None], codes.T[channel])
  decoded = jax.jit(bfloat16_code_pairs.decoded_pairs, static_argnums=(1, 2))
  np.testing.assert_array_equal(np.asarray(decoded(pairs, head_dim, bits)), codes.T)


@pytest.mark.parametrize("bits", [2, 4])
def test_any_bits_give_finite_numbers_in_one_to_two(bits):
  """Garbage words (past a row's length) make no NaN: every pair is 1 + a mantissa."""
  words = jnp.asarray(
    [[0xFFFFFFFF, 0x7FC00000, 0xFF800000, 0x00000000, 0x80000001, 0x3F803F80, 0xDEADBEEF, 1]],
    jnp.uint32,
  ).T  # [8 words, 1 token]: head_dim 128 at 2 bits, 64 at 4
  pairs = np.asarray(code_pairs(words, bits), np.float64)
  assert np.all(np.isfinite(pairs)) and np.all((pairs >= 1.0) & (pairs < 2.0))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_pair_matrix_is_a_permutation_times_powers_of_two(bits, head_dim):
  matrix = bfloat16_code_pairs.pair_matrix(head_dim, bits)
  nonzero = matrix != 0
  assert np.all(nonzero.sum(axis=0) == 1) and np.all(nonzero.sum(axis=1) == 1)
  exponents = np.log2(matrix[nonzero])
  assert np.all(exponents == np.round(exponents)) and np.all((exponents >= 1) & (exponents <= 7))
  # Exact in bfloat16, and x @ matrix.T puts channel-ordered x into row order times the factors.
  assert np.array_equal(np.asarray(jnp.asarray(matrix, jnp.bfloat16), np.float32), matrix)
  channel, factor = bfloat16_code_pairs.pair_rows(head_dim, bits)
  x = np.random.default_rng(0).normal(size=(3, head_dim))
  np.testing.assert_array_equal(x @ matrix.T, x[:, channel] * factor)


@pytest.mark.parametrize("bits", [2, 4])
def test_each_chain_keeps_its_field_inside_the_mantissa(bits):
  chains = bfloat16_code_pairs.pair_chains(bits)
  assert len(chains) == 16 // bits
  for field, chain in enumerate(chains):
    assert chain.shift + chain.position == bits * field
    assert 0 <= chain.position and chain.position + bits <= bfloat16_code_pairs.MANTISSA_BITS
  shifts = {chain.shift for chain in chains}
  assert len(shifts) == {2: 3, 4: 4}[bits]  # the shifts a word needs (one is none)


@pytest.mark.parametrize("bits", [8, 3, 1])
def test_other_bits_are_refused_by_name(bits):
  with pytest.raises(ValueError, match=r"bits=.*allowed: \(2, 4\)"):
    bfloat16_code_pairs.pair_chains(bits)
  with pytest.raises(ValueError, match="allowed"):
    functools.partial(bfloat16_code_pairs.pair_rows, 128)(bits)
