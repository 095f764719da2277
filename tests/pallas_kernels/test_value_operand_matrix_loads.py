"""The value codes as wgmma's register operand by transposing matrix loads
(`value_operand_matrix_loads`): the row order and its inverse; the per-thread construction's
numpy model against the cache's own codes masked in place, rows in that order; `ldmatrix.trans`'s
numpy model against its lane mapping; the kernel's inline code itself, its MLIR ops and the
`ldmatrix` instruction replaced by the same operations on numpy arrays, against the model. The
kernel with the setting is checked in test_quantized_decode_attention_folded_mosaic_gpu.py
(interpret mode: the emulated path) and lowered for sm_90 in test_lowering.py; only a GPU runs
the inline code as compiled."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import value_operand_matrix_loads as matrix_loads
from pallas_kernels.value_operand_registers import assemble_value_operand
from tests.pallas_kernels.inline_code_emulation import (
  as_uint,
  captured_wgmma_operand,
  emulate_inline_code,
  transposed_matrix_loads,
)
from tests.pallas_kernels.test_value_operand_registers import _masked_in_place

SHAPES = [(128, 2), (128, 4), (64, 2), (64, 4)]


@pytest.mark.parametrize("head_dim,bits", SHAPES)
def test_rows_hold_every_channel_once_and_the_inverse_finds_them(head_dim, bits):
  rows = np.arange(head_dim)
  channels = matrix_loads.channel_of_row(rows, head_dim, bits)
  assert sorted(channels) == list(range(head_dim))
  assert np.any(channels != rows)
  np.testing.assert_array_equal(matrix_loads.row_of_channel(channels, head_dim, bits), rows)
  # one thread's rows (2 per 64-row tile) come from one half-word of the token
  half_word = (
    2 * (channels % (head_dim * bits // 32)) + (bits * (channels // (head_dim * bits // 32))) // 16
  )
  for warp in range(4):
    for g in range(8):
      thread_rows = [64 * t + 16 * warp + 8 * h + g for t in range(head_dim // 64) for h in (0, 1)]
      assert len(set(half_word[thread_rows])) == 1


def test_row_order_at_the_shapes_of_record():
  """head_dim 128, 2 bits: warp w takes byte w % 2 of half-words 8 (w // 2) .. + 7; row
  (tile 0, warp 0, half 0, g 0) is field 0 of word 0 (channel 0), its half 1 field 1 (channel
  8), tile 1's rows fields 2 and 3 (channels 16, 24); warp 1's first row byte 1, field 4."""
  channel = lambda row: int(matrix_loads.channel_of_row(row, 128, 2))
  assert [channel(r) for r in (0, 8, 64, 72)] == [0, 8, 16, 24]
  assert channel(16) == 32  # warp 1: field 4 of word 0
  assert channel(1) == 64  # g = 1: half-word 1 = the high half of word 0, field 8
  assert channel(2) == 1  # g = 2: word 1, field 0


@settings(max_examples=20, deadline=None)
@given(
  shape=st.sampled_from(SHAPES),
  tokens=st.sampled_from([64, 128]),
  seed=st.integers(0, 2**31 - 1),
)
def test_registers_hold_each_rows_channel_codes_masked_in_place(shape, tokens, seed):
  head_dim, bits = shape
  words = np.random.default_rng(seed).integers(0, 2**32, (tokens, head_dim * bits // 32), np.uint64)
  words = words.astype(np.uint32)
  channels = matrix_loads.channel_of_row(np.arange(head_dim), head_dim, bits)
  operand = matrix_loads.assemble_value_operand_from_matrix_loads(words, bits)
  np.testing.assert_array_equal(operand, _masked_in_place(words, bits)[channels])
  np.testing.assert_array_equal(operand, assemble_value_operand(words, bits)[channels])


def test_every_code_value_reaches_its_row():
  for code in range(4):
    word = sum(code << (2 * field) for field in range(16))
    words = np.full((64, 8), word, np.uint32)
    channels = matrix_loads.channel_of_row(np.arange(128), 128, 2)
    exponent = 2 * ((channels // 8) % 4)  # the field's bit within its byte
    np.testing.assert_array_equal(
      matrix_loads.assemble_value_operand_from_matrix_loads(words, 2),
      np.broadcast_to((code << exponent)[:, None], (128, 64)),
    )


def test_transposed_matrix_load_gives_each_lane_two_rows_of_one_column():
  """Lane l's register m: column first + l / 4 of rows 8 m + 2 (l % 4) (low half) and the next
  (high half), PTX's fragment of a column-major 8 x 8 matrix."""
  half_words = np.arange(32 * 16, dtype=np.uint16).reshape(32, 16)  # value 16 row + column
  registers = matrix_loads.transposed_matrix_registers(half_words, 8)
  assert registers[0, 0] == (0 * 16 + 8) | ((1 * 16 + 8) << 16)
  assert registers[5, 0] == (2 * 16 + 9) | ((3 * 16 + 9) << 16)  # lane 5: column 9, rows 2, 3
  assert registers[31, 3] == (30 * 16 + 15) | ((31 * 16 + 15) << 16)


def test_sizes_the_operand_cannot_take_are_named():
  assert matrix_loads.unsupported_reason(128, 2, 64) is None
  assert "head_dim=96" in matrix_loads.unsupported_reason(96, 2, 64)
  assert "bits=8" in matrix_loads.unsupported_reason(128, 8, 64)
  assert "block_tokens=32" in matrix_loads.unsupported_reason(128, 2, 32)


def _emulated_ldmatrix(slot_bytes: np.ndarray):
  """`ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16` over 128 threads' byte addresses into
  `slot_bytes`: lanes 8 m .. 8 m + 7 of each warp address the rows of matrix m."""

  def ldmatrix(ptx, address, *, result_types, has_side_effects, convergent):
    assert ptx.startswith("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16")
    # kept after the slot's barrier wait and out of divergent code; four registers
    assert has_side_effects and convergent and len(result_types) == 4
    return transposed_matrix_loads(slot_bytes, address)

  return ldmatrix


@pytest.mark.parametrize(
  "head_dim,bits,tokens,first_thread,first_token",
  [
    (128, 2, 64, 0, 0),
    (128, 4, 64, 0, 0),
    (64, 2, 128, 0, 0),
    (64, 4, 64, 128, 0),
    (128, 2, 128, 256, 0),
    # a block of a ring slot that holds several (blocks_per_copy): its tokens only
    (128, 2, 64, 0, 64),
    (64, 4, 64, 128, 192),
  ],
)
def test_the_inline_code_assembles_what_the_model_does(
  head_dim, bits, tokens, first_thread, first_token, monkeypatch
):
  """`value_operand_from_matrix_loads`'s own code, run with each MLIR op it emits replaced by
  the same operation on numpy arrays of the warpgroup's 128 threads and `ldmatrix.trans` by its
  lane mapping over the slot's bytes (each lane's row address as the code computes it), its
  registers placed where the wgmma layout puts them: the numpy model's operand."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith

  words_per_token = head_dim * bits // 32
  slot_tokens = first_token + tokens + (64 if first_token else 0)  # blocks before and after
  words = np.random.default_rng(head_dim + bits + tokens + first_token)
  words = words.integers(0, 2**32, (slot_tokens, words_per_token), np.uint64).astype(np.uint32)
  emulate_inline_code(monkeypatch, first_thread=first_thread, load=None)
  monkeypatch.setattr(arith, "shrui", lambda a, b: as_uint(a) >> as_uint(b))
  monkeypatch.setattr(arith, "xori", lambda a, b: as_uint(a) ^ as_uint(b))
  monkeypatch.setattr(mgpu_utils, "memref_ptr", lambda ref: as_uint(np.zeros(128)))

  def byte_offset(pointer, offsets, element_type):
    assert str(element_type) == "i8", "offsets are in bytes"
    return as_uint(pointer) + as_uint(offsets[0])

  monkeypatch.setattr(mgpu_utils, "getelementptr", byte_offset)
  # the slot's bytes where the ring's TMA swizzle puts them
  logical = words.view(np.uint8).ravel()
  slot_bytes = np.zeros_like(logical)
  swizzle = matrix_loads.ring_swizzle_bytes(head_dim, bits)
  slot_bytes[matrix_loads.swizzled_offsets(np.arange(logical.size), swizzle)] = logical
  monkeypatch.setattr(mgpu_utils, "inline_ptx", _emulated_ldmatrix(slot_bytes))

  class WordsRef:
    shape = words.shape

  with ir.Context(), ir.Location.unknown():
    matrix_loads.value_operand_from_matrix_loads(
      WordsRef(), head_dim, bits, first_token=first_token, tokens=tokens
    )
  operand = captured_wgmma_operand(head_dim, tokens)
  block_words = words[first_token : first_token + tokens]
  np.testing.assert_array_equal(
    operand, matrix_loads.assemble_value_operand_from_matrix_loads(block_words, bits)
  )


def test_the_ring_swizzle_is_a_token_row_wide_and_permutes_chunks_within_rows():
  """32 bytes at head_dim 128 and 2 bits (and at 64 / 4), 64 at 128 / 4, none for 16-byte rows;
  the placement is a permutation of each 1 KB that keeps bytes within their 16-byte chunk and
  their row group, the banks model's swizzle (benchmarks/shared_bank_conflicts.py)."""
  assert [matrix_loads.ring_swizzle_bytes(*shape) for shape in SHAPES] == [32, 64, 0, 32]
  assert matrix_loads.ring_transforms(64, 2) == ()
  offsets = np.arange(4096)
  for swizzle in (32, 64):
    placed = matrix_loads.swizzled_offsets(offsets, swizzle)
    assert sorted(placed) == list(offsets)
    np.testing.assert_array_equal(placed % 16, offsets % 16)
    np.testing.assert_array_equal(placed // swizzle, offsets // swizzle)
  # rows of 32 bytes: row 4 (byte 128) moves to the second chunk
  assert matrix_loads.swizzled_offsets(128, 32) == 144
  assert matrix_loads.swizzled_offsets(128 + 16, 32) == 128
