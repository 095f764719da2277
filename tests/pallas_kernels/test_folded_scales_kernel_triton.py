"""The folded variant's operand unpacking, channel order and row padding (the kernel itself is
checked against the reference in test_quantized_kernels.py)."""

import itertools

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from pallas_kernels.bit_packing import pack_codes
from pallas_kernels.folded_scales_kernel_triton import (
  MIN_TILE_ROWS,
  first_copy_rows,
  folded_channel_order,
  folded_rows,
  repeat_stacked_rows,
  tile_copies,
  unpack_codes_for_dot,
  uses_bf16_pairs,
)

DTYPES = (jnp.bfloat16, jnp.float32, jnp.float16)


@settings(max_examples=30, deadline=None)
@given(
  bits=st.sampled_from((2, 4, 8)),
  head_dim=st.sampled_from((64, 128)),
  dtype=st.sampled_from(DTYPES),
  seed=st.integers(0, 2**31 - 1),
)
def test_unpacked_operands_are_the_codes_in_the_folded_order(bits, head_dim, dtype, seed):
  codes = np.random.default_rng(seed).integers(0, 2**bits, size=(8, head_dim))
  words = pack_codes(jnp.asarray(codes, jnp.int32), bits)
  operands = unpack_codes_for_dot(words, bits, dtype)
  assert operands.dtype == jnp.dtype(dtype)
  order = folded_channel_order(head_dim, bits, dtype)
  expected = codes[:, order]
  # Exact: every operand is a small integer the dtype represents (bf16 pairs go through
  # 128 + code and back).
  np.testing.assert_array_equal(np.asarray(operands, np.float32), expected)


def test_bf16_pairs_only_where_exact():
  assert uses_bf16_pairs(2, jnp.bfloat16) and uses_bf16_pairs(4, jnp.bfloat16)
  # 128 + an 8-bit code needs 9 significant bits; f32/f16 operands take the magic-number path.
  assert not uses_bf16_pairs(8, jnp.bfloat16)
  assert not uses_bf16_pairs(2, jnp.float32) and not uses_bf16_pairs(2, jnp.float16)


def test_folded_channel_order_is_a_permutation_with_word_pairs_adjacent():
  for head_dim, bits, dtype in itertools.product((64, 128), (2, 4, 8), DTYPES):
    order = folded_channel_order(head_dim, bits, dtype)
    np.testing.assert_array_equal(np.sort(order), np.arange(head_dim))
    if uses_bf16_pairs(bits, dtype):
      # Positions 2i, 2i+1 hold fields j and j + n/2 of one word: one 32-bit register.
      width = head_dim * bits // 32
      low, high = order[0::2], order[1::2]
      np.testing.assert_array_equal(low % width, high % width)
      np.testing.assert_array_equal(high // width - low // width, 16 // bits)


def test_channel_parts_take_their_own_words_and_unpack_to_the_order():
  rng = np.random.default_rng(0)
  for head_dim, bits, dtype, parts in itertools.product((64, 128), (2, 4, 8), DTYPES, (1, 2, 4)):
    width = head_dim * bits // 32
    if width % parts:
      continue
    order = folded_channel_order(head_dim, bits, dtype, parts)
    np.testing.assert_array_equal(np.sort(order), np.arange(head_dim))
    codes = rng.integers(0, 2**bits, size=(4, head_dim))
    words = np.asarray(pack_codes(jnp.asarray(codes, jnp.int32), bits))
    part_width, part_channels = width // parts, head_dim // parts
    for part in range(parts):
      positions = order[part * part_channels : (part + 1) * part_channels]
      # Channel c sits in word c % W: part p holds exactly the channels of its own words.
      assert set(positions % width) == set(range(part * part_width, (part + 1) * part_width))
      part_words = jnp.asarray(words[:, part * part_width : (part + 1) * part_width])
      operands = unpack_codes_for_dot(part_words, bits, dtype)
      np.testing.assert_array_equal(np.asarray(operands, np.float32), codes[:, positions])


def test_folded_rows_fill_the_smallest_tensor_core_tile():
  for group, block, head_dim in itertools.product((1, 2, 3, 4, 8), (32, 64, 128), (64, 128)):
    rows = folded_rows(group, block, head_dim, 32)
    assert rows >= group and rows & (rows - 1) == 0
    assert rows * (block // 32) >= 16 and rows * (head_dim // 32) >= 16
  assert folded_rows(4, 128, 128, 32) == 4  # the benchmark shape: no padding rows


def test_stack_copies_fill_the_tile_with_the_unpadded_rows():
  for group, block, head_dim, group_size in itertools.product(
    (1, 2, 3, 4, 8), (64, 128), (64, 128), (32, 64)
  ):
    rows = folded_rows(group, block, head_dim, group_size, stack_copies=True)
    assert rows == 1 << (group - 1).bit_length()  # the group padded to a power of two only
    for stacks in (block // group_size, head_dim // group_size):
      copies = tile_copies(stacks * rows)
      assert copies * stacks * rows == max(MIN_TILE_ROWS, stacks * rows)


def test_the_first_copy_of_a_repeated_operand_is_the_operand():
  stacked = jnp.arange(4 * 6, dtype=jnp.float32).reshape(4, 6)
  for copies in (1, 2, 4):
    repeated = repeat_stacked_rows(stacked, copies)
    assert repeated.shape == (4 * copies, 6)
    for copy in range(copies):  # each block of rows is one whole copy, in order
      np.testing.assert_array_equal(repeated[4 * copy : 4 * (copy + 1)], stacked)
    # A dot against the repeated operand, its first copy's rows kept: the dot itself.
    other = jnp.arange(6 * 3, dtype=jnp.float32).reshape(6, 3)
    np.testing.assert_array_equal(first_copy_rows(repeated @ other, copies), stacked @ other)
