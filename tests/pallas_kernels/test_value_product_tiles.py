import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_kernels import quantized_decode_attention_folded_mosaic_gpu as folded
from pallas_kernels.value_product_tiles import (
  accumulator_tiles,
  check_value_order,
  check_value_product_columns,
  first_tile_of_channel,
  row_tile_value_tiles,
  uneven_row_tiles_reason,
)


@pytest.mark.parametrize(
  "head_dim,group_size,group,expected",
  [
    (128, 32, 4, ((0, 1), (1, 1))),  # the shapes of record: two tiles, one per row tile
    (128, 32, 8, ((0, 2), (2, 2))),  # one group per tile: two per row tile
    (128, 32, 2, ((0, 1), (0, 1))),  # four groups per tile: the one tile both read
    (128, 16, 4, ((0, 2), (2, 2))),
    (128, 64, 1, ((0, 1), (0, 1))),  # eight slots, two groups: one tile
    (64, 32, 4, ((0, 1),)),  # one row tile, the one tile
    (64, 16, 8, ((0, 4),)),
  ],
)
def test_each_row_tile_reads_the_tiles_of_its_channels_groups(
  head_dim, group_size, group, expected
):
  _, slots = folded.value_slots(group)
  _, value_rows = folded.stacks(64, head_dim, group_size, group)
  value_tiles = value_rows // folded.tile_rows(group)
  tiles = row_tile_value_tiles(head_dim, group_size, slots, value_tiles)
  assert tiles == expected
  # every channel's tile lies in its row tile's range, and every tile of the range is some
  # channel's of that row tile
  channel = np.arange(head_dim)
  tile = channel // (slots * group_size)
  for row_tile, (first, count) in enumerate(tiles):
    own = tile[row_tile * 64 : (row_tile + 1) * 64]
    assert set(own) == set(range(first, first + count))
  assert accumulator_tiles("own_tiles", head_dim, group_size, slots, value_tiles) == tiles[0][1]
  assert accumulator_tiles("all_tiles", head_dim, group_size, slots, value_tiles) == value_tiles


@given(
  head_dim=st.sampled_from([64, 128, 256]),
  group_size=st.sampled_from([8, 16, 32, 64, 128]),
  slots=st.sampled_from([1, 2, 4, 8]),
)
def test_first_tile_of_a_channel_is_its_row_tiles(head_dim, group_size, slots):
  value_tiles = -(-(head_dim // group_size) // slots)
  if not value_tiles:
    return
  tiles = row_tile_value_tiles(head_dim, group_size, slots, value_tiles)
  channel = np.arange(head_dim)
  tile = channel // (slots * group_size)
  # by brute force: the first tile any channel of the row tile is in
  expected = np.array([tile[c // 64 * 64 : c // 64 * 64 + 64].min() for c in channel])
  np.testing.assert_array_equal(first_tile_of_channel(channel, group_size, slots), expected)
  assert [first for first, _ in tiles] == list(expected[::64])
  # powers of two: every row tile needs the same number of tiles
  assert (
    uneven_row_tiles_reason(
      "own_tiles", head_dim=head_dim, group_size=group_size, slots=slots, value_tiles=value_tiles
    )
    is None
  )


def test_row_tiles_needing_different_tile_counts_are_refused():
  # 96 channels per tile (three slots of 32: not a shape the kernel takes): row tile 0 reads
  # tile 0 alone, row tile 1 tiles 0 and 1
  reason = uneven_row_tiles_reason("own_tiles", head_dim=128, group_size=32, slots=3, value_tiles=2)
  assert reason is not None and "[1, 2] value tiles each" in reason
  assert (
    uneven_row_tiles_reason("all_tiles", head_dim=128, group_size=32, slots=3, value_tiles=2)
    is None
  )


def test_own_tiles_need_channel_order_rows():
  check_value_order("own_tiles", "channel")
  check_value_order("all_tiles", "word")
  with pytest.raises(ValueError, match="needs the value product's rows in channel order"):
    check_value_order("own_tiles", "word")


def test_a_bad_value_product_columns_is_named():
  with pytest.raises(
    ValueError,
    match=r"value_product_columns='mine' is not supported; allowed: \('all_tiles', 'own_tiles'\)",
  ):
    check_value_product_columns("mine")
