"""The value codes as wgmma's register operand (`value_operand_registers`): the per-thread
construction's numpy model against the cache's own codes masked in place; the kernel's inline
code itself, its MLIR ops replaced by the same operations on numpy arrays, against the model;
PTX's byte permute against its definition; which registers share their loads and permutes. The
kernel with the setting is checked in test_quantized_decode_attention_folded_mosaic_gpu.py
(interpret mode: the emulated path) and lowered for sm_90 in test_lowering.py (the inline
code); only a GPU runs the inline code as compiled."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.bit_packing import unpack_codes
from pallas_kernels.subnormal_codes import code_exponent
from pallas_kernels.value_operand_registers import (
  assemble_value_operand,
  prmt,
  register_sources,
  shared_sources,
  value_operand_unsupported_reason,
)
from tests.pallas_kernels.inline_code_emulation import (
  as_uint,
  captured_wgmma_operand,
  emulate_inline_code,
)


def _masked_in_place(words: np.ndarray, bits: int) -> np.ndarray:
  """uint16 [D, tokens]: each channel's code at its `code_exponent` bit, the pattern the staged
  tile holds in channel order (code * 2^(q - 133) as bf16)."""
  codes = np.asarray(unpack_codes(jnp.asarray(words)[None, None], bits))[0, 0]  # [tokens, D]
  head_dim = codes.shape[1]
  exponent = np.asarray(code_exponent(np.arange(head_dim), head_dim, bits))
  return (codes.T.astype(np.uint32) << exponent[:, None]).astype(np.uint16)


@settings(max_examples=20, deadline=None)
@given(
  head_dim=st.sampled_from([64, 128]),
  bits=st.sampled_from([2, 4]),
  tokens=st.sampled_from([64, 128]),
  seed=st.integers(0, 2**31 - 1),
)
def test_registers_hold_each_channels_codes_masked_in_place(head_dim, bits, tokens, seed):
  words_per_token = head_dim * bits // 32
  words = np.random.default_rng(seed).integers(0, 2**32, (tokens, words_per_token), np.uint64)
  words = words.astype(np.uint32)
  np.testing.assert_array_equal(assemble_value_operand(words, bits), _masked_in_place(words, bits))


@pytest.mark.parametrize("head_dim,bits", [(128, 2), (64, 4)])
def test_the_spread_order_puts_each_columns_token_in_it(head_dim, bits):
  """Column k of the spread-order operand is column spread_token(k) of the natural one: the
  upper two token pairs of each 8 swapped (`spread_token_order`)."""
  words = np.random.default_rng(head_dim + bits).integers(0, 2**32, (128, head_dim * bits // 32))
  words = words.astype(np.uint32)
  natural = assemble_value_operand(words, bits)
  spread = assemble_value_operand(words, bits, token_order="spread")
  columns = np.arange(128)
  np.testing.assert_array_equal(spread, natural[:, columns ^ ((columns >> 2) & 1)])
  assert not np.array_equal(spread, natural)


def test_every_code_value_reaches_its_channel():
  """Words holding one code value everywhere: every element is that value at its channel's bit,
  for each of the 2-bit values (a mask off by a bit would lose or keep a neighbour's bits)."""
  for code in range(4):
    word = sum(code << (2 * field) for field in range(16))
    words = np.full((64, 8), word, np.uint32)
    exponent = np.asarray(code_exponent(np.arange(128), 128, 2))
    np.testing.assert_array_equal(
      assemble_value_operand(words, 2), np.broadcast_to((code << exponent)[:, None], (128, 64))
    )


def test_prmt_picks_the_selected_bytes_of_both_operands():
  first, second = np.uint32(0x33221100), np.uint32(0x77665544)
  assert prmt(first, second, np.uint32(0x3210)) == 0x33221100
  assert prmt(first, second, np.uint32(0x7654)) == 0x77665544
  assert prmt(first, second, np.uint32(0x5410)) == 0x55441100
  assert prmt(first, second, np.uint32(0x7531)) == 0x77553311


@pytest.mark.parametrize(
  "head_dim,bits,loads,permutes",
  [(128, 2, 1, 2), (128, 4, 2, 4), (64, 2, 1, 1), (64, 4, 1, 1)],
)
def test_registers_share_loads_and_permutes(head_dim, bits, loads, permutes):
  """Per column group, the distinct words a thread loads (two tokens each) and the permutes it
  issues: at head_dim 128 with 2-bit codes one word for all four (row tile, half) registers
  and one permute per row tile."""
  groups = shared_sources(register_sources(head_dim, bits))
  assert len(groups) == loads
  assert sum(len(group) for group in groups) == permutes
  assert sorted(key for group in groups for keys in group for key in keys) == [
    (tile, half) for tile in range(head_dim // 64) for half in range(2)
  ]


def test_sizes_the_operand_cannot_take_are_named():
  assert value_operand_unsupported_reason(128, 64) is None
  assert "head_dim=96" in value_operand_unsupported_reason(96, 64)
  assert "block_tokens=32" in value_operand_unsupported_reason(128, 32)


@pytest.mark.parametrize(
  "head_dim,bits,tokens,first_thread,first_token,token_order",
  [
    (128, 2, 64, 0, 0, "natural"),
    (128, 4, 64, 0, 0, "natural"),
    (64, 2, 128, 0, 0, "natural"),
    (64, 4, 64, 128, 0, "natural"),
    (128, 2, 128, 256, 0, "natural"),
    # a block of a ring slot that holds several (blocks_per_copy): its tokens only
    (128, 2, 64, 0, 64, "natural"),
    (64, 4, 64, 128, 192, "natural"),
    # the spread token order (v37): each quad's upper token pairs swapped
    (128, 2, 64, 0, 0, "spread"),
    (128, 4, 128, 128, 64, "spread"),
  ],
)
def test_the_inline_code_assembles_what_the_model_does(
  head_dim, bits, tokens, first_thread, first_token, token_order, monkeypatch
):
  """`value_operand_from_registers`'s own code, run with each MLIR op it emits replaced by the
  same operation on numpy arrays of the warpgroup's 128 threads (PTX's prmt as defined:
  `prmt`), its registers placed where the wgmma layout puts them (row 64 mt + 16 warp + 8 half
  + lane / 4, columns 8 G + 2 (lane % 4) + (0, 1), the first in the low half): the numpy model's
  operand. What only a GPU checks is that the ops are these ops."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jaxlib.mlir import ir

  from pallas_kernels import value_operand_registers

  words_per_token = head_dim * bits // 32
  slot_tokens = first_token + tokens + (64 if first_token else 0)  # blocks before and after
  words = np.random.default_rng(head_dim + bits + tokens + first_token)
  words = words.integers(0, 2**32, (slot_tokens, words_per_token), np.uint64).astype(np.uint32)
  emulate_inline_code(
    monkeypatch,
    first_thread=first_thread,
    load=lambda index: as_uint(words[index[0], index[1]]),
  )
  monkeypatch.setattr(
    mgpu_utils, "prmt", lambda first, second, selector: prmt(first, second, selector)
  )

  class WordsRef:
    shape = words.shape

  with ir.Context(), ir.Location.unknown():
    value_operand_registers.value_operand_from_registers(
      WordsRef(), head_dim, bits, first_token=first_token, tokens=tokens, token_order=token_order
    )
  operand = captured_wgmma_operand(head_dim, tokens)
  block_words = words[first_token : first_token + tokens]
  np.testing.assert_array_equal(operand, assemble_value_operand(block_words, bits, token_order))
  if token_order == "natural":
    np.testing.assert_array_equal(operand, _masked_in_place(block_words, bits))
