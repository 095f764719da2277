"""Which P' columns each 64-channel row tile of the folded Mosaic GPU kernel's value product
multiplies: every value tile's ("all_tiles", v14 on) or only those of its own channels' value
groups ("own_tiles", v41).

The value product is out^T [D, N] += V^T [D, tokens] P'^T [tokens, N]. wgmma cuts its A operand
into 64-row tiles (rows are channels, in channel order for register value codes,
`value_operand_registers`), and P' holds `value_tiles` tiles of `tile_rows` columns, tile t the
value groups [t slots, (t + 1) slots) side by side (`value_slots`). Channel c uses only the
columns of its own group's tile (the epilogue picks them), so the columns a row tile multiplies
for the other tiles are computed, carried in registers across the loop and dropped. With
"own_tiles" row tile m multiplies only tiles [first, first + count) (`row_tile_value_tiles`),
one wgmma chain per row tile, into an accumulator of count x tile_rows columns. At the shapes of
record (head_dim 128, value groups of 32, 4 query heads per KV head: two tiles of 8 columns, 64
channels each) each row tile needs one tile of the two: N 16 -> 8 per product, and the carried
accumulator f32 [128, 8] instead of [128, 16], 8 registers per thread instead of 16 (what ptxas
allocates in all moves either way with its scheduling: KERNEL_NOTES v41).

Every column an accumulator keeps is computed as before, from the same operands, so the outputs
are the same numbers (in interpret mode within float32 rounding: its dots of one row tile sum in
another order; not yet run on a GPU). Channel-order rows only: in the "word" order (value codes
staged from shared memory with `operand_order="word"`) a 64-row tile holds channels of
non-adjacent groups.
"""

VALUE_PRODUCT_COLUMNS = ("all_tiles", "own_tiles")
DEFAULT_VALUE_PRODUCT_COLUMNS = "all_tiles"
ROW_TILE = 64  # wgmma's M


def check_value_product_columns(value_product_columns) -> None:
  """ValueError naming `value_product_columns` and its allowed values."""
  if value_product_columns not in VALUE_PRODUCT_COLUMNS:
    raise ValueError(
      f"value_product_columns={value_product_columns!r} is not supported; allowed: "
      f"{VALUE_PRODUCT_COLUMNS}"
    )


def row_tile_value_tiles(
  head_dim: int, group_size: int, slots: int, value_tiles: int
) -> tuple[tuple[int, int], ...]:
  """(first value tile, tile count) per 64-channel row tile: the P' tiles whose value groups its
  channels belong to (channel c is in tile c // (slots x group_size))."""
  channels_per_tile = slots * group_size
  tiles = []
  for row_tile in range(head_dim // ROW_TILE):
    first = ROW_TILE * row_tile // channels_per_tile
    last = min((ROW_TILE * (row_tile + 1) - 1) // channels_per_tile, value_tiles - 1)
    tiles.append((first, last - first + 1))
  return tuple(tiles)


def check_value_order(value_product_columns: str, value_order: str) -> None:
  """ValueError if "own_tiles" is asked for with the value product's rows not in channel order
  (`value_output_order`: "word" for value codes staged from shared memory with
  operand_order="word", "matrix" for value_operand="matrix_loads")."""
  if value_product_columns != DEFAULT_VALUE_PRODUCT_COLUMNS and value_order != "channel":
    raise ValueError(
      "value_product_columns='own_tiles' needs the value product's rows in channel order: with "
      "value_operand='shared_memory' and operand_order='word', or value_operand='matrix_loads', "
      "a 64-row tile holds channels of non-adjacent value groups; use value_operand='registers' "
      "or operand_order='channel'"
    )


def uneven_row_tiles_reason(
  value_product_columns: str, *, head_dim: int, group_size: int, slots: int, value_tiles: int
) -> str | None:
  """Why "own_tiles" cannot serve this shape (None if it can, or for "all_tiles"): row tiles
  that need different numbers of value tiles (one accumulator width serves them all). Not met
  where value groups and slots are powers of two, as the kernel's are."""
  if value_product_columns == DEFAULT_VALUE_PRODUCT_COLUMNS:
    return None
  counts = {count for _, count in row_tile_value_tiles(head_dim, group_size, slots, value_tiles)}
  if len(counts) != 1:
    return (
      f"value_product_columns='own_tiles' at head_dim={head_dim} with group_size={group_size} "
      f"and {slots} value groups per tile: the 64-channel row tiles need {sorted(counts)} value "
      f"tiles each, not one count; use value_product_columns='all_tiles'"
    )
  return None


def accumulator_tiles(
  value_product_columns: str, head_dim: int, group_size: int, slots: int, value_tiles: int
) -> int:
  """Value tiles per accumulator row: all of them ("all_tiles"), or each row tile's count."""
  if value_product_columns == DEFAULT_VALUE_PRODUCT_COLUMNS:
    return value_tiles
  return row_tile_value_tiles(head_dim, group_size, slots, value_tiles)[0][1]


def first_tile_of_channel(channel, group_size: int, slots: int):
  """The first value tile of `channel`'s row tile under "own_tiles" (ints, numpy or jnp): the
  accumulator's column block k of that row holds tile first + k."""
  return ROW_TILE * (channel // ROW_TILE) // (slots * group_size)
