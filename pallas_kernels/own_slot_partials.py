"""The folded Mosaic GPU kernel's split partials with only each channel's own value slot:
picked by the kernel in its epilogue (`partial_slots="own"`), before they are written.

The value product has one column per query row and value slot: below 8 query heads per KV head,
`slots` value groups share one `tile_rows`-column tile side by side ([D, rows], rows = slots x
real_rows), and channel c's output lies only in the columns of its group's slot,
[s real_rows, (s + 1) real_rows) with s = (c // group_size) % slots. With "every" the kernel
writes every column, f32 [B, H, S, D, rows], and the merge picks each channel's
(`split_merge_triton.pick_value_slots`): at the shapes of record (4 query heads per KV head, two
slots) half of the 8.4 MB the kernel writes per call belongs to no channel, and the merge reads
it too (XLA's whole; the Triton merge gathers the slot, but a channel's 16 bytes lie in 32-byte
sectors: KERNEL_NOTES, "What to try next" item 3).

With "own" each real row j of the output is picked in registers: a masked sum over the columns
of the normalised [D, rows] tile, with exactly one column kept per channel, so the value passes
unchanged (and a NaN elsewhere in the row does not reach it). The real_rows rows, f32 [D] each,
go to a [real_rows, D] tile in shared memory (the queries' buffer, free after the loop) and out
by one copy: the partials are f32 [B, H, S, real_rows, D], the head dim last, its positions the
accumulator's (operand positions in the word order). Bytes written per split: real_rows x D x 4
instead of rows x D x 4 (half at 3-4 query heads per KV head, an eighth at one, the same at 5-8).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_attention_mosaic_gpu import send_partials

PARTIAL_SLOTS = ("every", "own")
DEFAULT_PARTIAL_SLOTS = "every"


def check_partial_slots(partial_slots) -> None:
  """ValueError naming `partial_slots` and its allowed values."""
  if partial_slots not in PARTIAL_SLOTS:
    raise ValueError(f"partial_slots={partial_slots!r} is not supported; allowed: {PARTIAL_SLOTS}")


def slot_first_column(channel, group_size: int, real_rows: int, slots: int):
  """The first output column of `channel`'s value slot (ints, numpy or jnp integer arrays)."""
  return (channel // group_size) % slots * real_rows


def own_slot_rows(out: jax.Array, first_column: jax.Array, real_rows: int) -> list[jax.Array]:
  """f32 [D, rows] in the wgmma layout (the normalised output, every slot's columns) and int32
  [D, rows] (each row's `slot_first_column`, the same across the columns) -> real_rows f32 [D]
  vectors: vector j holds column first_column + j of each row."""
  column = plgpu.broadcasted_iota(jnp.int32, out.shape, 1, layout=plgpu.Layout.WGMMA)
  return [jnp.where(column == first_column + j, out, 0.0).sum(axis=1) for j in range(real_rows)]


def write_own_slot_partials(
  out: jax.Array,  # f32 [D, rows]: normalised, every slot's columns
  lse: jax.Array,  # f32 [rows]
  first_column: jax.Array,  # int32 [D, rows]
  rows_smem,  # f32 [real_rows, D]
  lse_smem,  # f32 [rows]
  out_gmem,  # f32 [real_rows, D]: the program's slice of the partials
  lse_gmem,  # f32 [rows]
) -> None:
  """The split's own-slot rows (`own_slot_rows`) and lse, through shared memory to global."""
  for j, row in enumerate(own_slot_rows(out, first_column, rows_smem.shape[0])):
    rows_smem[j, :] = row
  lse_smem[...] = lse
  send_partials(rows_smem, lse_smem, out_gmem, lse_gmem)


def own_slot_columns(out: jax.Array, first_columns: np.ndarray, real_rows: int) -> jax.Array:
  """The jnp reference of the kernel's pick (`own_slot_rows` over the splits): f32
  [..., D, rows] -> [..., real_rows, D], row j of position p being column first_columns[p] + j
  (`slot_first_column` of the channel at position p). One gather."""
  head_dim, rows = out.shape[-2:]
  columns = np.asarray(first_columns)[None, :] + np.arange(real_rows)[:, None]  # [real_rows, D]
  flat = out.reshape(*out.shape[:-2], head_dim * rows)
  picked = jnp.take(flat, (np.arange(head_dim)[None, :] * rows + columns).reshape(-1), axis=-1)
  return picked.reshape(*out.shape[:-2], real_rows, head_dim)
