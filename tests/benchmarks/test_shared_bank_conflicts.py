"""The shared-memory bank model of benchmarks/shared_bank_conflicts.py (addresses only: no GPU)."""

import importlib.util
import pathlib

import numpy as np
import pytest

from pallas_kernels import value_operand_matrix_loads

_PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "shared_bank_conflicts.py"
_SPEC = importlib.util.spec_from_file_location("shared_bank_conflicts", _PATH)
bank_model = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bank_model)

LANES = np.arange(32)


@pytest.mark.parametrize(
  "addresses,expected",
  [
    (LANES * 4, 1),  # 32 consecutive words: one per bank
    (np.zeros(32, int), 1),  # one word for every lane: a broadcast
    (LANES * 2, 1),  # 16-bit loads, two lanes per word
    (LANES * 128, 32),  # every lane on bank 0, each its own word
    ((LANES % 16) * 4 + (LANES // 16) * 128, 2),  # two rows 128 bytes apart
    ((LANES % 8) * 4 + (LANES // 8) * 64, 2),  # four rows 64 bytes apart, 32-byte rows
  ],
)
def test_a_load_takes_the_most_distinct_words_any_bank_is_asked_for(addresses, expected):
  assert bank_model.wavefronts(addresses) == expected


def test_swizzles_xor_the_128_byte_row_into_the_16_byte_chunk():
  address = np.array([0x80, 0x100, 0x180, 0x200, 0x380])
  np.testing.assert_array_equal(bank_model.swizzled(address, 0), address)
  np.testing.assert_array_equal(bank_model.swizzled(address, 32), address ^ [16, 0, 16, 0, 16])
  np.testing.assert_array_equal(bank_model.swizzled(address, 64), address ^ [16, 32, 48, 0, 48])
  np.testing.assert_array_equal(bank_model.swizzled(address, 128), address ^ [16, 32, 48, 64, 112])
  with pytest.raises(ValueError, match=r"swizzle=16 is not supported; allowed: \(0, 32, 64, 128\)"):
    bank_model.swizzled(address, 16)


def test_the_register_value_codes_conflict_two_way_and_no_swizzle_helps():
  """head_dim 128, 2-bit: 16 loads per warp and 64-token block (as the kernel's docstring
  counts), each 2-way: lanes q and q + 2 read rows 128 bytes apart. Every TMA swizzle XORs
  address bit 7 into bit 4, which the word index already spans; the spread token order
  removes the conflicts."""
  loads = bank_model.value_code_loads(128, 2)
  assert len(loads) == 4 * 16
  for swizzle in bank_model.SWIZZLES:
    counts = bank_model.load_wavefronts(loads, swizzle)
    assert counts["wavefronts"] == 2 * counts["conflict_free"]
  spread = bank_model.value_code_loads(128, 2, token_order="spread")
  assert bank_model.load_wavefronts(spread)["wavefronts"] == len(spread)


def test_four_bit_value_codes_conflict_four_way_and_a_wide_swizzle_halves_it():
  loads = bank_model.value_code_loads(128, 4)
  assert bank_model.load_wavefronts(loads)["wavefronts"] == 4 * len(loads)
  assert bank_model.load_wavefronts(loads, 128)["wavefronts"] == 2 * len(loads)
  assert bank_model.load_wavefronts(loads, 32)["wavefronts"] == 4 * len(loads)


def test_matrix_loads_halve_the_value_codes_wavefronts_and_a_row_wide_swizzle_clears_them():
  """`value_operand="matrix_loads"` (v43): two ldmatrix.x4 per warp and 64-token block, eight
  matrices of 8 token rows x 16 bytes. At 2 bits the rows are 32 bytes apart, so rows r and
  r + 4 share banks (2-way: 64 wavefronts per warpgroup against the 32-bit loads' 128); at 4
  bits 64 bytes apart, 4-way (128 against 512). The kernel's ring swizzle, as wide as a token
  row (32 or 64 bytes), moves the rows that collide to other 16-byte chunks: one wavefront per
  matrix."""
  for bits, register_loads, matrix_ways, row_swizzle in ((2, 128, 2, 32), (4, 512, 4, 64)):
    loads = bank_model.value_code_matrix_loads(128, bits)
    assert len(loads) == 4 * 8  # matrices per warpgroup and block
    assert all(len(matrix) == 32 for matrix in loads)  # 8 rows of 4 words
    counts = bank_model.load_wavefronts(loads)
    assert counts["wavefronts"] == matrix_ways * len(loads)
    assert bank_model.load_wavefronts(bank_model.value_code_loads(128, bits))["wavefronts"] == (
      register_loads
    )
    assert bank_model.load_wavefronts(loads, row_swizzle)["wavefronts"] == len(loads)
    # the swizzle the kernel's value ring takes
    assert value_operand_matrix_loads.ring_swizzle_bytes(128, bits) == row_swizzle
  # at head_dim 64 and 2 bits a token row is 16 bytes: no conflict to remove
  loads = bank_model.value_code_matrix_loads(64, 2)
  assert bank_model.load_wavefronts(loads)["wavefronts"] == len(loads)


def test_own_slot_statistics_conflict_across_the_two_slots_groups():
  """Query group 4 (two slots per tile): the lanes of each slot read a different group's row,
  64 or 128 tokens apart in the ring slot, on the same banks: 2-way, whatever the token order.
  A query group of 8 (one slot) reads one group per tile: no conflict."""
  for slot_tokens in (64, 128):
    loads = bank_model.own_slot_statistic_loads(8, 4, 4, slot_tokens)
    assert bank_model.load_wavefronts(loads)["wavefronts"] == 2 * len(loads)
  loads = bank_model.own_slot_statistic_loads(8, 8, 4)
  assert bank_model.load_wavefronts(loads)["wavefronts"] == len(loads)


@pytest.mark.parametrize(
  "head_dim,bits,matrices,ways",
  [(128, 2, 32, 2), (128, 4, 64, 4), (64, 4, 32, 2), (64, 2, 16, 1)],
)
def test_the_warp_kernels_value_matrices_and_its_swizzled_ring(head_dim, bits, matrices, ways):
  """The warp kernel's value product (v62): per 128-token block, 8 tokens' rows a matrix, a token
  row apart: 2-way at 32-byte rows, 4-way at 64, none at 16; value_ring_layout="swizzled" leaves
  one wavefront a matrix (the kernel's own addresses give the same counts:
  `test_warp_products_inline.test_the_value_matrix_loads_bank_conflicts`)."""
  loads = bank_model.warp_value_matrix_loads(head_dim, bits, swizzled_ring=False)
  assert len(loads) == matrices and all(len(matrix) == 32 for matrix in loads)
  assert bank_model.load_wavefronts(loads)["wavefronts"] == ways * matrices
  swizzled = bank_model.warp_value_matrix_loads(head_dim, bits, swizzled_ring=True)
  assert bank_model.load_wavefronts(swizzled)["wavefronts"] == matrices


def test_the_warp_kernels_key_words_conflict_only_at_64_byte_rows():
  """64-bit loads in half-warp phases: 4 tokens of 32-byte rows fill a phase's 128 bytes; at
  64-byte rows (head_dim 128, 4 bits) the lanes read half of each row, and tokens 0 and 2 of a
  phase share banks."""
  for head_dim, bits, ways in ((128, 2, 1), (64, 4, 1), (64, 2, 1), (128, 4, 2)):
    loads = bank_model.warp_key_word_loads(head_dim, bits)
    assert bank_model.load_wavefronts(loads)["wavefronts"] == ways * len(loads)


def test_the_warp_kernels_statistics_conflict_across_the_two_slots_groups():
  """At 4 query rows quads' lanes 0-1 and 2-3 read two groups' rows of the same tokens, a
  multiple of 128 bytes apart: 2-way, as the folded kernel's own-slot statistics; at 8 rows one
  group a load, none."""
  for head_dim in (64, 128):
    loads = bank_model.warp_statistic_loads(head_dim, 4)
    assert bank_model.load_wavefronts(loads)["wavefronts"] == 2 * len(loads)
    loads = bank_model.warp_statistic_loads(head_dim, 8)
    assert bank_model.load_wavefronts(loads)["wavefronts"] == len(loads)
