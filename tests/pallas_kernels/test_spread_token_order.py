"""The spread token order of the value product (`spread_token_order`): the permutation itself,
its gather (interpret mode's path) and the inline shuffle (the native path) run with each MLIR op
replaced by the same operation on numpy arrays of the warpgroup's 128 threads. The kernel with
the setting is checked in test_quantized_decode_attention_folded_mosaic_gpu.py and lowered for
sm_90 in test_lowering.py; the bank conflicts it removes are counted in
tests/benchmarks/test_shared_bank_conflicts.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import spread_token_order
from tests.pallas_kernels.inline_code_emulation import CapturedArray, emulate_inline_code


def test_the_spread_order_swaps_the_upper_pairs_of_each_eight():
  columns = np.arange(24)
  tokens = spread_token_order.spread_token(columns)
  np.testing.assert_array_equal(tokens[:8], [0, 1, 2, 3, 5, 4, 7, 6])
  np.testing.assert_array_equal(tokens[8:16], tokens[:8] + 8)
  np.testing.assert_array_equal(spread_token_order.spread_token(tokens), columns)
  # each lane's first column (2 q) lands on a different row modulo 4: one bank group each
  assert sorted(tokens[0:8:2] % 4) == [0, 1, 2, 3]
  np.testing.assert_array_equal(spread_token_order.token_of_column(columns, "natural"), columns)


def test_a_bad_token_order_is_named():
  with pytest.raises(ValueError, match=r"token_order='mixed' is not supported; allowed: \("):
    spread_token_order.check_token_order("mixed")
  assert spread_token_order.token_order_unsupported_reason("spread", "registers") is None
  assert spread_token_order.token_order_unsupported_reason("natural", "shared_memory") is None
  reason = spread_token_order.token_order_unsupported_reason("spread", "shared_memory")
  assert "value_operand='registers'" in reason


def test_the_gather_puts_row_spread_token_k_at_row_k():
  array = jnp.arange(128 * 3, dtype=jnp.float32).reshape(128, 3)
  spread = np.asarray(spread_token_order.spread_rows_emulated(array))
  np.testing.assert_array_equal(
    spread, np.asarray(array)[spread_token_order.spread_token(np.arange(128))]
  )


@pytest.mark.parametrize("tokens,first_thread", [(64, 0), (128, 128)])
def test_the_inline_shuffle_gives_each_row_its_spread_token(tokens, first_thread, monkeypatch):
  """`spread_rows`' own code, its MLIR ops replaced by numpy operations over the warpgroup's 128
  threads: every register of a thread holding row 64 mt + 16 warp + 8 half + lane / 4 (the
  wgmma layout) ends up holding what the thread of row spread_token(row) held."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jaxlib.mlir import ir

  emulate_inline_code(monkeypatch, first_thread=first_thread, load=None)
  thread = np.arange(128)
  warp, lane = thread // 32, thread % 32
  registers = np.empty(fa.WGMMA_LAYOUT.registers_shape((tokens, 8)), dtype=object)
  rows = {}
  for index in np.ndindex(registers.shape):
    rows[index] = 64 * index[0] + 16 * warp + 8 * index[4] + lane // 4
    registers[index] = (rows[index] * 1000 + index[1]).astype(np.uint64)  # row, column group

  class Fragments:  # the wgmma-layout array the inline body is handed
    shape, dtype, is_signed = (tokens, 8), jnp.bfloat16, None

  Fragments.registers = registers
  with ir.Context(), ir.Location.unknown():
    spread_token_order.spread_rows(Fragments)
  for index, register in np.ndenumerate(CapturedArray.last.registers):
    expected = spread_token_order.spread_token(rows[index]) * 1000 + index[1]
    np.testing.assert_array_equal(register, expected)
