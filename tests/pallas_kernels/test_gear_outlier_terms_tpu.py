"""GEAR's outlier terms as the TPU kernel computes them (`gear_outlier_terms_tpu.GearOutlierBlock`,
run here as plain jnp over the kernel's blocks): equal to the outlier parts of the dense cache (a
segment of rank 0, so that GEAR's parts are its outliers alone), bfloat16 operands giving exact
products; garbage past a row's length (NaN values, indices anywhere) adds nothing."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gear_outlier_terms_tpu import (
  GearOutlierBlock,
  outlier_slots_read,
  outlier_span,
  stored_outlier_slots,
)
from tests.pallas_kernels.kernel_checks import poison_past_lengths
from tests.pallas_kernels.test_gear_terms_xla import BATCH, KV_HEADS, _gear_parts, _segment

HIGHEST = jax.lax.Precision.HIGHEST


def _terms_by_blocks(segment, queries, probs, lengths, *, gear_block, kernel_block, dtype):
  """(scores [B, H, R, T], value terms [B, H, R, D]) of the outliers, the segment walked in
  kernel blocks of `kernel_block` tokens (the last one shorter where the segment ends)."""
  batch, kv_heads, _, tokens = probs.shape
  head_dim = queries.shape[-1]
  scores, values = [], []
  for b in range(batch):
    for h in range(kv_heads):
      row_scores, row_values = [], 0.0
      for first in range(0, tokens, kernel_block):
        last = min(first + kernel_block, tokens)
        outliers = [x[b, h, first // gear_block : last // gear_block] for x in segment.outliers]
        block = GearOutlierBlock(
          *outliers,
          first=first,
          length=lengths[b],
          gear_block=gear_block,
          head_dim=head_dim,
          operand_dtype=dtype,
        )
        row_scores.append(block.score_term(queries[b, h]))
        row_values = row_values + block.value_term(probs[b, h, :, first:last])
      scores.append(jnp.concatenate(row_scores, axis=1))
      values.append(row_values)
  shape = (batch, kv_heads) + scores[0].shape
  return jnp.stack(scores).reshape(shape), jnp.stack(values).reshape(batch, kv_heads, -1, head_dim)


@hypothesis.settings(max_examples=6, deadline=None)
@hypothesis.given(
  seed=st.integers(0, 2**16),
  outliers_per_block=st.integers(1, 24),
  head_dim=st.sampled_from([64, 128]),
  gear_block=st.sampled_from([16, 64, 256]),
  blocks=st.integers(1, 9),
  spans_per_kernel_block=st.integers(1, 2),
  group=st.integers(1, 8),
  dtype=st.sampled_from([jnp.bfloat16, jnp.float32]),
)
def test_outlier_terms_are_the_outlier_parts_of_the_dense_cache(
  seed, outliers_per_block, head_dim, gear_block, blocks, spans_per_kernel_block, group, dtype
):
  """Over every token before each row's length (a full row and one ending anywhere), with
  garbage stored past it; float32 queries and probabilities, as the kernel gives them, with
  bfloat16 outlier values (products exact to 2^-16 by bfloat16 halves) or float32 ones
  (HIGHEST precision)."""
  tokens = blocks * gear_block
  rng, segment = _segment(seed, 0, outliers_per_block, tokens, head_dim, gear_block)
  key_part, value_part = _gear_parts(segment, gear_block)
  lengths = np.asarray([tokens, rng.integers(0, tokens + 1)], np.int32)
  queries = jnp.asarray(rng.normal(size=(BATCH, KV_HEADS, group, head_dim)), jnp.float32)
  live = (np.arange(tokens)[None, :] < lengths[:, None])[:, None, None, :]
  probs = np.where(live, rng.random((BATCH, KV_HEADS, group, tokens)), 0.0)
  probs = jnp.asarray(probs, jnp.float32)
  if dtype == jnp.float32:
    k_index, k_value, v_index, v_value = segment.outliers
    outliers = (k_index, k_value.astype(dtype), v_index, v_value.astype(dtype))
    segment = segment._replace(outliers=outliers)
  poisoned = poison_past_lengths(segment, lengths, group_size=16, block=gear_block)
  scores, values = _terms_by_blocks(
    poisoned,
    queries,
    probs,
    jnp.asarray(lengths),
    gear_block=gear_block,
    kernel_block=spans_per_kernel_block * outlier_span(gear_block),
    dtype=dtype,
  )
  expected_scores = jnp.einsum("bhgd,bhtd->bhgt", queries, key_part, precision=HIGHEST)
  expected_values = jnp.einsum("bhgt,bhtd->bhgd", probs, value_part, precision=HIGHEST)
  live = np.broadcast_to(live, scores.shape)
  np.testing.assert_allclose(
    np.asarray(scores)[live], np.asarray(expected_scores)[live], rtol=5e-5, atol=5e-5
  )
  assert np.all(np.isfinite(np.asarray(values)))
  np.testing.assert_allclose(np.asarray(values), np.asarray(expected_values), rtol=5e-5, atol=5e-5)


@pytest.mark.parametrize("gear_block", [64, 256])
def test_each_outlier_lands_on_its_own_token_and_channel(gear_block):
  """One outlier a GEAR block, at a known position, value 2: the score term is 2 q[c] at its
  token and 0 elsewhere, the value term 2 p[t] on its channel; one GEAR block past the length
  (row length = 1.5 GEAR blocks) holds a NaN value and a negative index, and adds nothing."""
  head_dim, blocks = 64, 4
  span = outlier_span(gear_block)
  positions = [(3, 5), (gear_block - 1, 63), (0, 0), (7, 17)]  # (token in block, channel)
  index = jnp.asarray([[t * head_dim + c] for t, c in positions], jnp.int32)
  value = jnp.full((blocks, 1), 2.0, jnp.bfloat16)
  length = gear_block * 3 // 2  # block 2 starts past it: its outlier is garbage
  index = index.at[2, 0].set(-5)
  value = value.at[2, 0].set(jnp.nan)
  queries = jnp.arange(1, head_dim + 1, dtype=jnp.bfloat16)[None, :]  # q[c] = c + 1
  probs = jnp.arange(1, blocks * gear_block + 1, dtype=jnp.float32)[None, :] / 1024
  probs = jnp.where(jnp.arange(blocks * gear_block) < length, probs, 0.0).astype(jnp.bfloat16)
  block = GearOutlierBlock(
    index,
    value,
    index,
    value,
    first=0,
    length=length,
    gear_block=gear_block,
    head_dim=head_dim,
    operand_dtype=jnp.bfloat16,
  )
  scores = np.asarray(block.score_term(queries))[0]
  values = np.asarray(block.value_term(probs))[0]
  expected_scores = np.zeros(blocks * gear_block, np.float32)
  expected_values = np.zeros(head_dim, np.float32)
  for j, (t, c) in enumerate(positions):
    token = j * gear_block + t
    if token < length:
      expected_scores[token] += 2 * (c + 1)
      expected_values[c] += 2 * float(probs[0, token])
  assert scores.shape == (blocks * gear_block,) and span >= gear_block
  np.testing.assert_array_equal(scores[:length], expected_scores[:length])
  np.testing.assert_allclose(values, expected_values, rtol=1e-6)


@pytest.mark.parametrize("gear_block, count", [(64, 82), (64, 20), (16, 5), (256, 1)])
def test_slots_past_the_count_add_nothing(gear_block, count):
  """Outlier rows stored in whole lane tiles (`stored_outlier_slots`), the slots past the first
  `count` holding garbage (NaN values, indices anywhere): read in whole tiles with `count`
  given, the terms of the first `count` slots alone, to the last bit."""
  rng = np.random.default_rng(count)
  head_dim, blocks = 64, 4
  slots = stored_outlier_slots(count)
  index = rng.integers(-9, gear_block * head_dim + 9, (blocks, slots)).astype(np.int32)
  value = np.full((blocks, slots), np.nan, np.float32)
  index[:, :count] = rng.integers(0, gear_block * head_dim, (blocks, count))
  value[:, :count] = rng.normal(size=(blocks, count))
  index, value = jnp.asarray(index), jnp.asarray(value, jnp.bfloat16)
  queries = jnp.asarray(rng.normal(size=(3, head_dim)), jnp.float32)
  probs = jnp.asarray(rng.random((3, blocks * gear_block)), jnp.float32)
  common = dict(first=0, length=blocks * gear_block, gear_block=gear_block, head_dim=head_dim)
  common.update(operand_dtype=jnp.bfloat16)
  few = GearOutlierBlock(*[index[:, :count], value[:, :count]] * 2, **common)
  read = outlier_slots_read(count, slots, gear_block)
  padded = GearOutlierBlock(*[index[:, :read], value[:, :read]] * 2, count=count, **common)
  for term, operand in (("score_term", queries), ("value_term", probs)):
    expected = np.asarray(getattr(few, term)(operand))
    np.testing.assert_array_equal(np.asarray(getattr(padded, term)(operand)), expected)
    assert np.isfinite(expected).all()


def test_whole_tiles_are_read_where_they_add_no_tile_to_a_spans_row():
  """Two GEAR blocks of 64 a span: 82 outliers (head_dim 64) side by side fill 2 tiles, and so
  do 128 slots; 164 (head_dim 128) fill 3, 256 slots 4. One GEAR block of 128 a span: whole
  tiles always; none past the stored slots."""
  assert outlier_slots_read(82, 128, 64) == 128
  assert outlier_slots_read(164, 256, 64) == 164
  assert outlier_slots_read(164, 256, 128) == 256
  assert outlier_slots_read(82, 82, 64) == 82  # stored unpadded
  assert outlier_slots_read(20, 128, 16) == 20  # 8 GEAR blocks a span: 160 lanes, 2 tiles, not 8
