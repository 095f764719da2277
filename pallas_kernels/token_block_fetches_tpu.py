"""A TPU kernel's token blocks of a cache's arrays, fetched by the kernel itself.

A decode kernel's grid (batch, split, block, KV head) reads one token block of each cache array
(codes, statistics, GEAR's factors and outliers) a step, none past the row's length. As
BlockSpecs whose index maps clamp the block to the row's last valid one (read from the
scalar-prefetched lengths), Mosaic's pipeline evaluated every array's index map for this step
and the next, compared them and decided each array's DMA on its own: 840 scalar ops (469
bundles) of a KIVI-2 8192-token step at head_dim 128 (2734 bundles) went there, 95 bundles with
index maps that do not read the lengths (compiled for a v5e, KERNEL_NOTES v58). Fetched here,
the next step's block and its validity are computed once for all arrays, and each array's
copy is issued and waited for by a descriptor of static shape: 2380 bundles a step, 138 of
them scalar work before the first vector op (with Mosaic's run-time bounds checks of the
copies, which the kernel leaves out as its offsets are in bounds by construction, 2595).

The blocks are double-buffered within a (row, split): the grid's first two axes are "parallel"
(on a chip with two TensorCores each core runs whole (row, split) sequences), so the first step
of each starts its own fetch and waits for it, and every step starts the next step's before it
waits for its own. A step whose block lies past the length fetches nothing (and computes
nothing: the kernel's own `pl.when`). Arrays whose block holds every KV head (`heads_whole`)
are fetched once a block, at the block's first head, into a slot of their own parity.

Where an array's blocks do not tile it (a capacity that is not a multiple of the block, as most
are), the kernel copies its last block short, into the start of the slot, when that remainder
is whole tiles of the buffer (`last_block_extent`: Mosaic refuses a slice of a VMEM buffer that
is not); the slot's entries past it hold an older block or nothing, past every row's length.
An array whose remainder is not whole tiles takes a BlockSpec instead (`block_spec`: Mosaic's
pipeline copies a last block short into a whole buffer), with the clamped index maps of before
(`clamped_head_and_block`); the others are still fetched here.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.decode_attention_tpu import (
  LANES,
  clamped_block_index,
  last_valid_block,
  sublane_tile_rows,
)
from pallas_kernels.splits import SplitPlan


@dataclasses.dataclass(frozen=True)
class TokenBlockWindow:
  """One array's block at a grid step. The array is [B, H, *shape-like] (with `heads_whole`,
  [B, *shape-like], the first axis of `shape` being every head); its blocks run along axis
  `token_axis` of `shape`, `shape[token_axis]` entries a block (tokens, key groups or GEAR
  blocks), all other axes whole."""

  shape: tuple[int, ...]
  token_axis: int
  heads_whole: bool = False


def fetch_scratch(windows, dtypes) -> list:
  """The scratch a kernel taking `windows` needs, in this order: a VMEM buffer [2, *shape] per
  window (two slots), then one DMA semaphore per slot and window ([2, len(windows)])."""
  buffers = [_compat.tpu_vmem_scratch((2, *w.shape), dtype) for w, dtype in zip(windows, dtypes)]
  return buffers + [_compat.tpu_dma_semaphores((2, len(windows)))]


class StepFetches(NamedTuple):
  """What one grid step (row, split, block `step`, KV head `head`) fetches and waits for."""

  block: jax.Array  # the step's token block
  valid: jax.Array  # whether it holds a token before the length: fetched, waited, attended
  slot: jax.Array  # the per-head windows' slot of the step (0 or 1)
  whole_slot: jax.Array  # the heads-whole windows' slot of the step's block (0 or 1)
  start_this: jax.Array  # the first step of its (row, split): starts its own fetches
  start_next: jax.Array  # starts the next step's, into the other slot
  next_head: jax.Array
  next_block: jax.Array


def step_fetches(*, split, step, head, length, plan: SplitPlan, kv_heads: int) -> StepFetches:
  """The schedule of `TokenBlockFetches.step` (a pure function of the grid indices and the
  row's length, on scalars in a kernel or on Python ints in a test). The heads-whole windows
  are started with the per-head ones at a block's first head and waited for there."""
  block = split * plan.blocks_per_split + step
  flat_step = step * kv_heads + head
  last_head = head == kv_heads - 1
  next_block = block + jnp.where(last_head, 1, 0)
  valid = block * plan.block_tokens < length
  return StepFetches(
    block=block,
    valid=valid,
    slot=flat_step % 2,
    whole_slot=step % 2,
    start_this=(flat_step == 0) & valid,
    start_next=(flat_step + 1 < plan.blocks_per_split * kv_heads)
    & (next_block * plan.block_tokens < length),
    next_head=jnp.where(last_head, 0, head + 1),
    next_block=next_block,
  )


class TokenBlockFetches:
  """The copies of one grid step's blocks: `arrays` the kernel's HBM refs (`hbm_spec`),
  `buffers` and `semaphores` the scratch of `fetch_scratch`."""

  def __init__(self, arrays, buffers, semaphores, windows):
    self.arrays, self.buffers, self.semaphores = list(arrays), list(buffers), semaphores
    self.windows = list(windows)

  def _source(self, index: int, row, head):
    window = self.windows[index]
    return self.arrays[index].at[row] if window.heads_whole else self.arrays[index].at[row, head]

  def _remainder(self, index: int) -> int:
    """Entries of window `index`'s last block when it is short (0 where the blocks tile)."""
    window = self.windows[index]
    total = self.arrays[index].shape[_array_axis(window)]
    return total % window.shape[window.token_axis]

  def _copy(self, index: int, slot, row, head, block, *, short: bool = False):
    """Block `block` of window `index` into `slot`; with `short`, the array's last block, as
    many entries as it holds, into the start of the slot."""
    window = self.windows[index]
    axis = window.token_axis
    extent = window.shape[axis]
    source = self._source(index, row, head)
    source_index = [slice(None)] * len(window.shape)
    target_index = [slice(None)] * len(window.shape)
    size = self._remainder(index) if short else extent
    # One block: the whole axis (an offset block * extent, 0 then, need not be a whole number
    # of tiles, and Mosaic refuses what it cannot prove is).
    if source.shape[axis] != extent:
      source_index[axis] = pl.ds(pl.multiple_of(block * extent, extent), size)
    target = self.buffers[index].at[slot]
    if short:
      target_index[axis] = pl.ds(0, size)
      target = target.at[tuple(target_index)]
    return _compat.tpu_async_copy(
      source.at[tuple(source_index)], target, self.semaphores.at[slot, index]
    )

  def _each(self, action: str, heads_whole: bool, slot, row, head, block) -> None:
    """`action` ("start" or "wait") on the copies of the windows with `heads_whole`: a wait
    names the copy it waits for, so a short last block is waited for as it was started."""
    chosen = [i for i, w in enumerate(self.windows) if w.heads_whole == heads_whole]
    short = [i for i in chosen if self._remainder(i)]
    for index in chosen:
      if index not in short:
        getattr(self._copy(index, slot, row, head, block), action)()
    if not short:
      return
    # Every window's blocks are the same token blocks: one last block for all of them.
    window = self.windows[short[0]]
    last_block = self.arrays[short[0]].shape[_array_axis(window)] // window.shape[window.token_axis]

    @pl.when(block == last_block)
    def _last():
      for index in short:
        getattr(self._copy(index, slot, row, head, block, short=True), action)()

    @pl.when(block != last_block)
    def _whole():
      for index in short:
        getattr(self._copy(index, slot, row, head, block), action)()

  def step(self, *, row, split, step, head, length, plan: SplitPlan, kv_heads: int):
    """Starts the fetches of the next grid step of this (row, split) and waits for this step's
    (`step_fetches`); returns this step's slot of the per-head windows' buffers and of the
    heads-whole windows'."""
    fetches = step_fetches(
      split=split, step=step, head=head, length=length, plan=plan, kv_heads=kv_heads
    )
    has_whole = any(w.heads_whole for w in self.windows)

    @pl.when(fetches.start_this)
    def _first():
      self._each("start", False, fetches.slot, row, head, fetches.block)
      if has_whole:
        self._each("start", True, fetches.whole_slot, row, head, fetches.block)

    @pl.when(fetches.start_next)
    def _next():
      next_slot = 1 - fetches.slot
      self._each("start", False, next_slot, row, fetches.next_head, fetches.next_block)
      if has_whole:

        @pl.when(fetches.next_head == 0)
        def _next_whole():
          next_whole_slot = 1 - fetches.whole_slot
          self._each("start", True, next_whole_slot, row, 0, fetches.next_block)

    @pl.when(fetches.valid)
    def _this():
      self._each("wait", False, fetches.slot, row, head, fetches.block)
      if has_whole:

        @pl.when(head == 0)
        def _this_whole():
          self._each("wait", True, fetches.whole_slot, row, head, fetches.block)

    return fetches.slot, fetches.whole_slot

  def current(self, index: int, slot, whole_slot):
    """The ref of window `index`'s block at this step (after `step`)."""
    chosen = whole_slot if self.windows[index].heads_whole else slot
    return self.buffers[index].at[chosen]


def _array_axis(window: TokenBlockWindow) -> int:
  """The axis of the [B, H, ...] (heads-whole: [B, ...]) array along which `window` runs."""
  return window.token_axis + (1 if window.heads_whole else 2)


def last_block_extent(window: TokenBlockWindow, array_shape, dtype) -> int | None:
  """The entries the kernel copies itself of the last block of an array of `array_shape` and
  `dtype` along `window`'s token axis: the whole window where its blocks tile the array; else
  the remainder, where it is whole tiles of the VMEM buffer (128 lanes on the window's last
  axis, 32 bytes of sublanes on the one before: 8 rows of 32-bit entries, 16 of 16-bit ones;
  any number on a leading axis); None where it is not (a BlockSpec fetches that array)."""
  extent = window.shape[window.token_axis]
  remainder = array_shape[_array_axis(window)] % extent
  if remainder == 0:
    return extent
  from_last = len(window.shape) - 1 - window.token_axis
  tile = {0: LANES, 1: sublane_tile_rows(jnp.dtype(dtype).itemsize)}.get(from_last, 1)
  return remainder if remainder % tile == 0 else None


def last_head_past(split, step, head, last, *, plan: SplitPlan, kv_heads: int):
  """(head, block) a step of the heads-innermost grid (batch, split, block, KV head) reads,
  where blocks past `last` are not read: the step's own, or past `last` block `last` of the
  last head. That is the block the step before had, so Pallas fetches nothing there: with the
  heads innermost, each head's own block `last` would be a new index at every step past it."""
  block = split * plan.blocks_per_split + step
  return jnp.where(block > last, kv_heads - 1, head), jnp.minimum(block, last)


def clamped_head_and_block(row, split, step, head, lengths_ref, *, plan: SplitPlan, kv_heads):
  """`last_head_past` at the row's last valid block (`last_valid_block`): no DMA past a row's
  length."""
  last_valid = last_valid_block(row, lengths_ref, plan=plan)
  return last_head_past(split, step, head, last_valid, plan=plan, kv_heads=kv_heads)


def block_spec(window: TokenBlockWindow, *, plan: SplitPlan, kv_heads: int):
  """`window` as a BlockSpec of the grid (batch, split, block, KV head) with the lengths
  scalar-prefetched, for Mosaic's pipeline to fetch (clamped at the row's last valid block)."""

  def index_map(b, s, i, h, lengths_ref):
    if window.heads_whole:
      heads = ()
      block_index = clamped_block_index(b, s, i, lengths_ref, plan=plan)
    else:
      head, block_index = clamped_head_and_block(
        b, s, i, h, lengths_ref, plan=plan, kv_heads=kv_heads
      )
      heads = (head,)
    return (b, *heads) + tuple(
      block_index if axis == window.token_axis else 0 for axis in range(len(window.shape))
    )

  leading = (None,) if window.heads_whole else (None, None)
  return pl.BlockSpec((*leading, *window.shape), index_map)


def hbm_spec():
  """A pallas_call input kept in HBM, for the kernel's own copies."""
  return pl.BlockSpec(memory_space=_compat.tpu_hbm_memory_space())
