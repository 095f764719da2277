"""The schedule of a TPU kernel's own token-block fetches (`token_block_fetches_tpu`), walked
over the grid of (split, block, KV head) steps of one row as the kernel runs them; the copies
themselves run in the quantized kernel's interpret-mode tests (`test_quantized_kernels.py`)."""

import itertools

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import pytest

from pallas_kernels.splits import plan_splits
from pallas_kernels.token_block_fetches_tpu import (
  TokenBlockWindow,
  block_spec,
  clamped_head_and_block,
  fetch_scratch,
  last_block_extent,
  last_head_past,
  step_fetches,
)


def _walk(length: int, tokens: int, block_tokens: int, num_splits: int, kv_heads: int):
  """Runs the schedule over one row's steps, keeping what each slot holds; returns the copies
  started (head, block) and the per-head and heads-whole blocks each attending step read."""
  plan = plan_splits(tokens, block_tokens, kv_heads, num_splits, target_programs=1)
  started, read = [], []
  for split in range(plan.num_splits):
    in_flight, held = {}, {}  # slot -> (head, block): started, not waited for; waited for
    whole_in_flight, whole_held = {}, {}
    for step, head in itertools.product(range(plan.blocks_per_split), range(kv_heads)):
      f = step_fetches(
        split=split, step=step, head=head, length=length, plan=plan, kv_heads=kv_heads
      )
      block, slot, whole_slot = int(f.block), int(f.slot), int(f.whole_slot)

      def start(slot, head, block, split=split, in_flight=in_flight, whole=whole_in_flight):
        # A slot is refilled only after its copy was waited for, and never past the length;
        # the heads-whole windows with a block's first head, into the slot of its parity.
        assert slot not in in_flight and block * plan.block_tokens < length
        in_flight[slot] = (head, block)
        started.append((head, block))
        if head == 0:
          whole_slot = (block - split * plan.blocks_per_split) % 2
          assert whole_slot not in whole
          whole[whole_slot] = block

      if bool(f.start_this):
        assert step == 0 and head == 0
        start(slot, head, block)
      if bool(f.start_next):
        start(1 - slot, int(f.next_head), int(f.next_block))
      if bool(f.valid):
        held[slot] = in_flight.pop(slot)
        if head == 0:
          whole_held[whole_slot] = whole_in_flight.pop(whole_slot)
        read.append((held[slot], whole_held[whole_slot]))
        assert held[slot] == (head, block) and whole_held[whole_slot] == block
      else:
        assert block * plan.block_tokens >= length
    assert not in_flight and not whole_in_flight  # nothing left in flight past a split's end
  return started, read, plan


@pytest.mark.parametrize("kv_heads", [1, 2, 3])
@pytest.mark.parametrize(
  "tokens,block_tokens,num_splits", [(1280, 512, 2), (4096, 512, 3), (512, 512, 1)]
)
def test_each_valid_block_of_each_head_is_fetched_once_and_read_after_its_wait(
  kv_heads, tokens, block_tokens, num_splits
):
  # The kernel clamps the lengths to the capacity before the grid.
  for length in sorted({0, 1, block_tokens, min(block_tokens + 1, tokens), tokens - 1, tokens}):
    started, read, plan = _walk(length, tokens, block_tokens, num_splits, kv_heads)
    blocks = -(-length // block_tokens)
    expected = list(itertools.product(range(kv_heads), range(blocks)))
    assert sorted(started) == sorted(expected), length
    assert sorted(head_block for head_block, _ in read) == sorted(expected)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
  blocks=st.integers(1, 9),
  num_splits=st.integers(1, 4),
  kv_heads=st.integers(1, 5),
  length_fraction=st.floats(0, 1),
)
def test_the_schedule_over_random_grids(blocks, num_splits, kv_heads, length_fraction):
  block_tokens = 128
  tokens = blocks * block_tokens - 64  # a short last block
  length = round(length_fraction * tokens)
  started, read, _ = _walk(length, tokens, block_tokens, num_splits, kv_heads)
  assert len(started) == len(set(started)) == kv_heads * -(-length // block_tokens)
  assert len(read) == len(started)


def test_the_scratch_holds_two_slots_of_each_window_and_a_semaphore_per_slot_and_window():
  windows = [TokenBlockWindow((8, 512), 1), TokenBlockWindow((3, 512), 1, heads_whole=True)]
  scratch = fetch_scratch(windows, [jnp.uint32, jnp.bfloat16])
  assert [tuple(s.shape) for s in scratch] == [(2, 8, 512), (2, 3, 512), (2, 2)]
  assert [s.dtype for s in scratch[:2]] == [jnp.uint32, jnp.bfloat16]


@pytest.mark.parametrize("kv_heads", [1, 3])
@pytest.mark.parametrize("tokens,block_tokens,num_splits", [(1280, 512, 2), (4096, 512, 3)])
def test_the_block_specs_index_maps_fetch_each_valid_block_of_each_head_once(
  kv_heads, tokens, block_tokens, num_splits
):
  """Where Mosaic's pipeline fetches the blocks (`block_spec`), the heads-innermost grid's
  index maps (`clamped_head_and_block`, and `last_head_past` at the segment's last block): a
  step before a row's length reads its head's own block; a step past it repeats the step
  before's index, so Pallas fetches nothing there, and over the grid each valid (head, block)
  is a new index once."""
  plan = plan_splits(tokens, block_tokens, 3 * kv_heads, num_splits, target_programs=1)
  blocks = -(-tokens // block_tokens)
  lengths = jnp.asarray([tokens, block_tokens + 1, 0, block_tokens * plan.blocks_per_split])
  for row in range(lengths.shape[0]):
    last_valid = max(-(-int(lengths[row]) // block_tokens) - 1, 0)
    for last, index_of in [
      (
        last_valid,
        lambda s, i, h, row=row: clamped_head_and_block(
          row, s, i, h, lengths, plan=plan, kv_heads=kv_heads
        ),
      ),
      (
        blocks - 1,
        lambda s, i, h: last_head_past(s, i, h, blocks - 1, plan=plan, kv_heads=kv_heads),
      ),
    ]:
      previous, new_indices = None, []
      for s, i, h in itertools.product(
        range(plan.num_splits), range(plan.blocks_per_split), range(kv_heads)
      ):
        index = tuple(int(x) for x in index_of(s, i, h))
        if s * plan.blocks_per_split + i <= last:
          assert index == (h, s * plan.blocks_per_split + i)
        else:
          assert index == previous, (row, s, i, h)
        if index != previous:
          new_indices.append(index)
        previous = index
      assert sorted(new_indices) == sorted(itertools.product(range(kv_heads), range(last + 1)))


def test_a_block_spec_puts_the_clamped_block_on_the_window_token_axis():
  plan = plan_splits(1280, 512, 6, 2, target_programs=1)
  lengths = jnp.asarray([1280, 513, 0])
  per_head = block_spec(TokenBlockWindow((8, 512), 1), plan=plan, kv_heads=2)
  whole = block_spec(TokenBlockWindow((2, 512), 1, heads_whole=True), plan=plan, kv_heads=2)
  groups_first = block_spec(TokenBlockWindow((16, 128), 0), plan=plan, kv_heads=2)
  assert per_head.block_shape == (None, None, 8, 512)
  assert whole.block_shape == (None, 2, 512)
  index = lambda spec, *grid: tuple(int(x) for x in spec.index_map(*grid, lengths))
  assert index(per_head, 0, 1, 0, 1) == (0, 1, 0, 2)  # row 0, split 1, step 0, head 1: block 2
  assert index(per_head, 1, 1, 0, 0) == (1, 1, 0, 1)  # past row 1's last block 1: the last head's
  assert index(whole, 1, 1, 0, 0) == (1, 0, 1)
  assert index(groups_first, 0, 0, 1, 0) == (0, 0, 1, 0)
  assert index(groups_first, 2, 0, 1, 1) == (2, 1, 0, 0)  # an empty row: block 0


def test_the_kernel_copies_a_short_last_block_only_where_it_is_whole_tiles():
  lanes = TokenBlockWindow((8, 512), 1)
  assert last_block_extent(lanes, (3, 2, 8, 1536), jnp.uint32) == 512  # the blocks tile it
  assert last_block_extent(lanes, (3, 2, 8, 1280), jnp.uint32) == 256
  assert last_block_extent(lanes, (3, 2, 8, 1088), jnp.uint32) is None  # 64 of 128 lanes
  rows = TokenBlockWindow((16, 128), 0)
  assert last_block_extent(rows, (3, 2, 48, 128), jnp.bfloat16) == 16
  assert last_block_extent(rows, (3, 2, 40, 128), jnp.float32) == 8
  assert last_block_extent(rows, (3, 2, 40, 128), jnp.bfloat16) is None  # 8 of 16 rows
  assert last_block_extent(rows, (3, 2, 36, 128), jnp.float32) is None
  leading = TokenBlockWindow((4, 3, 128), 0)  # GEAR blocks of B factors: not a tiled axis
  assert last_block_extent(leading, (3, 2, 9, 3, 128), jnp.bfloat16) == 1
  whole = TokenBlockWindow((2, 512), 1, heads_whole=True)
  assert last_block_extent(whole, (3, 2, 1024), jnp.bfloat16) == 512
  assert last_block_extent(whole, (3, 2, 1152), jnp.bfloat16) == 128
