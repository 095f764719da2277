"""Each lane's own value slot's statistics (`value_stat_loads="own_slot"`): the assignment of
groups to lanes against the wgmma layout's columns, and the inline code that loads them run on
numpy arrays of the warpgroup's threads. The kernel with the setting runs natively only (interpret
mode takes the select path): its cases are in test_quantized_decode_attention_folded_mosaic_gpu.py
and test_lowering.py."""

import numpy as np
import pytest

from pallas_kernels import value_stats_own_slot as own_slot
from tests.pallas_kernels.inline_code_emulation import emulate_inline_code


@pytest.mark.parametrize("rows", [8, 16, 32])
def test_thread_columns_are_the_wgmma_layouts(rows):
  """Lane % 4 = q holds columns 8 i + 2 q and 8 i + 2 q + 1: every column once over the quad."""
  columns = own_slot.thread_columns(rows)
  assert sorted(columns.reshape(-1).tolist()) == list(range(rows))
  np.testing.assert_array_equal(columns[1], own_slot.thread_columns(rows)[0] + 2)


@pytest.mark.parametrize(
  "rows,real_rows,value_groups",
  [(8, 2, 8), (8, 4, 4), (8, 4, 3), (8, 8, 2), (16, 16, 4), (8, 2, 4)],
)
def test_each_lane_loads_the_group_of_every_column_it_holds(rows, real_rows, value_groups):
  """For every tile, each thread's group is the group of all its columns' slot (clamped to the
  last group where the slot has none: a last tile with an unused slot)."""
  assert own_slot.own_slot_unsupported_reason(rows, real_rows, "separate") is None
  slots = rows // real_rows
  tiles = -(-value_groups // slots)
  columns = own_slot.thread_columns(rows)
  for tile in range(tiles):
    groups = own_slot.lane_groups(tile, rows, real_rows, value_groups)
    for thread in range(own_slot.WARPGROUP_THREADS):
      expected = tile * slots + columns[thread % 4] // real_rows
      used = expected < value_groups
      np.testing.assert_array_equal(groups[thread] == expected, used)
      assert groups[thread] < value_groups


@pytest.mark.parametrize(
  "rows,real_rows,value_stats,match",
  [
    (8, 1, "separate", "1 query rows per value slot of a 8-column tile"),
    (16, 8, "separate", "8 query rows per value slot of a 16-column tile"),
    (8, 4, "pairs", "value_stats='pairs'"),
  ],
)
def test_where_a_lane_spans_slots_it_is_refused(rows, real_rows, value_stats, match):
  reason = own_slot.own_slot_unsupported_reason(rows, real_rows, value_stats)
  assert reason is not None and match in reason


def test_a_bad_value_stat_loads_is_named():
  with pytest.raises(ValueError, match=r"value_stat_loads='mine' is not supported; allowed: \("):
    own_slot.check_value_stat_loads("mine")


@pytest.mark.parametrize(
  "block,rows,real_rows,value_groups,first_thread,first_token",
  [
    (64, 8, 4, 4, 0, 0),
    (128, 8, 2, 8, 128, 0),
    (64, 8, 4, 3, 0, 0),
    (64, 16, 16, 2, 256, 0),
    # a block of a ring slot that holds several (blocks_per_copy): its tokens only
    (64, 8, 4, 4, 0, 64),
    (64, 8, 2, 3, 128, 128),
  ],
)
def test_the_inline_code_loads_each_lanes_own_group(
  block, rows, real_rows, value_groups, first_thread, first_token, monkeypatch
):
  """`own_slot_statistics`'s own code, each MLIR op it emits replaced by the same operation on
  numpy arrays of the warpgroup's 128 threads, its registers read where the wgmma row layout
  puts them (token 64 row_tile + 16 warp + 8 half + lane / 4): per tile, each thread's
  statistic is that of `lane_groups`' group for its token. What only a GPU checks is that the
  ops are these ops."""
  from jaxlib.mlir import ir

  slot_tokens = first_token + block + (64 if first_token else 0)  # blocks before and after
  statistics = np.random.default_rng(block + rows + first_token)
  statistics = statistics.integers(0, 2**16, (value_groups, slot_tokens))
  emulate_inline_code(
    monkeypatch, first_thread=first_thread, load=lambda index: statistics[index[0], index[1]]
  )

  class StatisticsRef:
    shape = (value_groups, slot_tokens)

  slots = rows // real_rows
  tiles = -(-value_groups // slots)
  with ir.Context(), ir.Location.unknown():
    outputs = own_slot.own_slot_statistics(
      StatisticsRef(),
      tiles=tiles,
      rows=rows,
      real_rows=real_rows,
      first_token=first_token,
      tokens=block,
    )
  assert len(outputs) == tiles
  thread = np.arange(128)
  warp, lane = thread // 32, thread % 32
  for tile, output in enumerate(outputs):
    groups = own_slot.lane_groups(tile, rows, real_rows, value_groups)
    assert output.registers.shape == (block // 64, 1, 2, 1, 1)
    for (row_tile, _, half, _, _), register in np.ndenumerate(output.registers):
      token = first_token + 64 * row_tile + 16 * warp + 8 * half + lane // 4
      np.testing.assert_array_equal(register, statistics[groups, token])
