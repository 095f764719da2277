"""The "word" operand order against a simulation of what each thread's registers hold."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import word_operand_order as order
from pallas_kernels.subnormal_codes import code_exponent
from tests.pallas_kernels.inline_code_emulation import register_placements


def _simulated_channels(head_dim: int, bits: int) -> np.ndarray:
  """Operand column -> channel, built from the registers: in the wgmma layout a thread of quad q
  holds words 8j + 2q + t of a row; pair p of word w holds fields p and p + P (low and high
  halves) and is operand register G = 2P j + 2p + t, i.e. columns 8G + 2q + (0, 1). With 4
  words a token (one word per lane) lane q holds word q, and pair p is register p."""
  words = head_dim * bits // 32
  pairs = 16 // bits
  channels = np.full(head_dim, -1)
  if words == 4:
    for q in range(4):
      for p in range(pairs):
        for half in range(2):
          channels[8 * p + 2 * q + half] = (p + half * pairs) * words + q
    return channels
  for j in range(words // 8):
    for q in range(4):
      for t in range(2):
        word = 8 * j + 2 * q + t
        for p in range(pairs):
          register = 2 * pairs * j + 2 * p + t
          for half in range(2):
            field = p + half * pairs
            channels[8 * register + 2 * q + half] = field * words + word  # planar packing
  return channels


@pytest.mark.parametrize("head_dim,bits", [(128, 2), (128, 4), (64, 4), (64, 2), (256, 2)])
def test_word_order_is_what_the_registers_hold(head_dim, bits):
  channels = order.word_order_channels(head_dim, bits)
  np.testing.assert_array_equal(channels, _simulated_channels(head_dim, bits))
  assert sorted(channels.tolist()) == list(range(head_dim))


@pytest.mark.parametrize("head_dim,bits", [(128, 2), (128, 4), (64, 4), (64, 2)])
def test_a_register_pairs_channels_of_one_word_at_one_bit(head_dim, bits):
  """Columns 2i and 2i + 1 are the two halves of one masked word: channels D/2 apart, each at
  the same bit of its half (so one AND masks both)."""
  channels = order.word_order_channels(head_dim, bits)
  low, high = channels[0::2], channels[1::2]
  words = head_dim * bits // 32
  np.testing.assert_array_equal(high - low, head_dim // 2)
  np.testing.assert_array_equal(low % words, high % words)
  np.testing.assert_array_equal(
    code_exponent(low, head_dim, bits), code_exponent(high, head_dim, bits)
  )


def test_too_few_words_per_row_are_refused():
  """The wgmma staging needs whole 8-word groups; the order itself also takes 4 words (one a
  lane, for the per-warp products) and refuses other widths by name."""
  reason = order.word_order_unsupported_reason(64, 2)
  assert reason is not None and "head_dim=64 with bits=2: 4 code words" in reason
  assert order.word_order_unsupported_reason(64, 4) is None  # 8 words: one whole group
  assert order.words_per_lane(64, 2) == 1 and order.words_per_lane(128, 2) == 2
  with pytest.raises(ValueError, match="head_dim=32 with bits=2: 2 code words"):
    order.channel_at_position(0, 32, 2)


@pytest.mark.parametrize("head_dim,bits", [(64, 4), (64, 2), (128, 2), (128, 4), (256, 2)])
@pytest.mark.parametrize("axis", [0, 2, -1])
def test_the_word_order_as_a_transpose_is_the_gather(head_dim, bits, axis):
  """`channels_in_word_order` (a reshape and a transpose, which XLA fuses) moves each channel to
  the position `word_order_channels` gives it, along any axis."""
  shape = [3, 5, 2]
  shape[axis] = head_dim
  values = np.random.default_rng(head_dim + bits).standard_normal(shape).astype(np.float32)
  gathered = np.take(values, order.word_order_channels(head_dim, bits), axis=axis)
  np.testing.assert_array_equal(
    np.asarray(order.channels_in_word_order(jnp.asarray(values), axis, bits)), gathered
  )


@pytest.mark.parametrize("head_dim,bits", [(64, 4), (64, 2), (128, 2), (128, 4), (256, 2)])
def test_position_of_channel_inverts_channel_at_position(head_dim, bits):
  """L(C) on every channel is the argsort of C(L), on numpy and jnp integers alike."""
  channels = np.arange(head_dim)
  expected = np.argsort(order.word_order_channels(head_dim, bits))
  np.testing.assert_array_equal(order.position_of_channel(channels, head_dim, bits), expected)
  np.testing.assert_array_equal(
    np.asarray(order.position_of_channel(jnp.asarray(channels), head_dim, bits)), expected
  )


def test_stage_words_refuses_an_unknown_operand_layout():
  with pytest.raises(
    ValueError, match="operand_layout='wgmma_transposed' is not supported; allowed: wgmma, mma_lhs"
  ):
    order.stage_words_in_word_order(
      jnp.zeros((64, 8), jnp.uint32), 2, operand_layout="wgmma_transposed"
    )


def test_mma_lhs_registers_hold_the_elements_wgmma_registers_hold():
  """`stage_words_in_word_order(..., operand_layout="mma_lhs")` moves each wgmma register to
  the MMA_LHS index `operand_register_layout` gives: by Mosaic GPU's own tilings of the two
  layouts, every element of a [64, 128] operand then sits in the same thread, at the same
  position of a register, as in the wgmma layout."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa

  mma_lhs_layout, to_mma_lhs = order.operand_register_layout("mma_lhs")
  shape = (64, 128)

  def by_element(layout):
    """{element: (register index, thread, position)}"""
    return {
      element: (register, thread, position)
      for register, places in register_placements(layout, shape).items()
      for thread, position, element in places
    }

  wgmma, mma_lhs = by_element(fa.WGMMA_LAYOUT), by_element(mma_lhs_layout.to_mgpu())
  for (row, column), (wgmma_register, thread, position) in wgmma.items():
    # the wgmma layout as the module doc states it: warp 16-row block, lane (row % 8, pair)
    assert (thread // 32, thread % 32, position) == (
      (row % 64) // 16,
      4 * (row % 8) + (column % 8) // 2,
      column % 2,
    )
    lhs_register, lhs_thread, lhs_position = mma_lhs[row, column]
    assert (lhs_thread, lhs_position) == (thread, position)
    row_tile, group, *rest = wgmma_register
    assert to_mma_lhs(row_tile, group, rest) == lhs_register
  assert len(wgmma) == 64 * 128
