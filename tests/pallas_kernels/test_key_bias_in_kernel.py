"""The pieces of the folded Mosaic GPU kernel's own q . k_min (`key_bias_in_kernel`): the query
halves' precision, the chunks and copies a split is cut into, and the split planner's multiple.
The kernel with the setting is checked against the reference and against XLA's bias in
test_quantized_decode_attention_folded_mosaic_gpu.py, and lowered for sm_90 in test_lowering.py.
"""

import functools
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat
from pallas_kernels.base_two_softmax import base_two_queries
from pallas_kernels.decode_attention_mosaic_gpu import padded_lengths, swizzled_operand_transforms
from pallas_kernels.key_bias import key_bias
from pallas_kernels.key_bias_in_kernel import (
  MAX_SPLIT_KEY_GROUPS,
  bias_chunks,
  chunk_copy_groups,
  copies_per_chunk,
  padded_key_groups,
  queries_with_halves,
  query_halves,
  split_blocks_multiple,
  split_key_groups,
  split_key_statistics,
  unsupported_reason,
)
from pallas_kernels.random_inputs import random_quantized_segment, random_queries
from pallas_kernels.softmax_reference_bounds import (
  EXCHANGE,
  key_score_bounds,
  split_softmax_references,
)
from pallas_kernels.splits import plan_splits
from tests.pallas_kernels.kernel_checks import triton_interpret


@settings(deadline=None, max_examples=25)
@given(
  seed=st.integers(0, 2**31 - 1),
  scale=st.sampled_from([1e-3, 1.0, 30.0]),
  groups=st.integers(1, 40),
)
def test_query_halves_carry_the_f32_queries_to_two_to_the_minus_sixteen(seed, scale, groups):
  """hi is the query truncated to bf16 (its low 16 bits cleared); hi + lo is within 2^-16 of it,
  relative (lo is hi's error rounded to bf16, so 8 more bits); and the products of the halves
  with bf16 minimums, summed in f32 as the tensor core sums them, are within 2^-15 of the float64
  bias, relative to the sum of the terms' magnitudes."""
  rng = np.random.default_rng(seed)
  rows, head_dim = 8, 128
  queries = (rng.standard_normal((1, 1, rows, head_dim)) * scale).astype(np.float32)
  halves = np.asarray(query_halves(jnp.asarray(queries)).astype(jnp.float32))
  high, low = halves[..., :rows, :], halves[..., rows:, :]
  np.testing.assert_array_equal(high, (queries.view(np.uint32) & 0xFFFF0000).view(np.float32))
  assert np.all(np.abs(high + low - queries) <= 2.0**-16 * np.abs(queries))
  k_min = np.asarray(
    jnp.asarray(rng.standard_normal((groups, head_dim)) * 4.0, jnp.bfloat16).astype(jnp.float32)
  )
  products = np.einsum("rd,gd->gr", high[0, 0], k_min) + np.einsum("rd,gd->gr", low[0, 0], k_min)
  exact = np.einsum("rd,gd->gr", queries[0, 0].astype(np.float64), k_min.astype(np.float64))
  magnitude = np.einsum("rd,gd->gr", np.abs(queries[0, 0]), np.abs(k_min)).astype(np.float64)
  assert np.all(np.abs(products - exact) <= 2.0**-15 * magnitude)


def test_query_halves_hold_no_bf16_to_f32_round_trip():
  """XLA's GPU compiler drops a f32 -> bf16 -> f32 round trip as excess precision: lo = bf16(q -
  f32(bf16(q))) compiled to bf16(q - q) = 0 there (KERNEL_NOTES v39), while CPU keeps it, so the
  numbers above cannot see it. The lowered program must convert nothing from bf16 back to f32."""
  queries = jax.ShapeDtypeStruct((1, 2, 8, 128), jnp.float32)
  for bounds in (False, True):
    text = jax.jit(functools.partial(query_halves, bounds=bounds)).lower(queries).as_text()
    converts = [line for line in text.splitlines() if "stablehlo.convert" in line]
    assert converts
    assert not [line for line in converts if re.search(r"bf16>\) -> tensor<[0-9x]*f32>", line)]


@pytest.mark.parametrize(
  "block_tokens,group_size,expected",
  [(64, 32, 4), (64, 16, 2), (64, 8, 1), (128, 32, 2), (128, 64, 4), (64, 64, 8), (128, 16, 1)],
)
def test_split_blocks_multiple_is_the_fewest_blocks_of_whole_eight_group_tiles(
  block_tokens, group_size, expected
):
  multiple = split_blocks_multiple(block_tokens, group_size)
  assert multiple == expected
  groups_per_block = block_tokens // group_size
  assert multiple * groups_per_block % 8 == 0
  assert all(m * groups_per_block % 8 for m in range(1, multiple))


@settings(deadline=None, max_examples=60)
@given(
  total_blocks=st.integers(1, 600),
  rows_times_heads=st.integers(1, 128),
  num_splits=st.one_of(st.none(), st.integers(1, 64)),
  multiple=st.sampled_from([1, 2, 4, 8]),
)
def test_planned_splits_are_multiples_and_cover_every_block(
  total_blocks, rows_times_heads, num_splits, multiple
):
  plan = plan_splits(total_blocks * 64, 64, rows_times_heads, num_splits, 528, multiple)
  assert plan.blocks_per_split % multiple == 0
  assert plan.num_splits * plan.blocks_per_split >= total_blocks  # every block in a split
  assert (plan.num_splits - 1) * plan.blocks_per_split < total_blocks  # no split empty
  unconstrained = plan_splits(total_blocks * 64, 64, rows_times_heads, num_splits, 528)
  assert plan.num_splits <= unconstrained.num_splits


@pytest.mark.parametrize("split_groups", [8, 32, 64, 72, 128, 200, 256])
@pytest.mark.parametrize("chunk_groups", [64, 128])
def test_chunk_copies_tile_the_split_exactly(split_groups, chunk_groups):
  """Each chunk's copy starts at c * chunk_groups, brings whole 8-row tiles, and the copies
  together bring the split's groups and none past them."""
  chunks = bias_chunks(split_groups, chunk_groups)
  copies = [chunk_copy_groups(split_groups, chunk_groups, c) for c in range(chunks)]
  assert all(0 < n <= chunk_groups and n % 8 == 0 for n in copies)
  assert sum(copies) == split_groups
  assert all(n == chunk_groups for n in copies[:-1])


def test_splits_longer_than_the_bias_buffer_are_refused_with_the_setting_named():
  assert split_key_groups(8192, 32) == MAX_SPLIT_KEY_GROUPS
  assert unsupported_reason(8192, 32) is None
  reason = unsupported_reason(8192 + 64, 32)
  assert reason is not None and "key_bias_source='kernel'" in reason and "num_splits" in reason


@pytest.mark.parametrize("bounds", [False, True])
def test_queries_with_halves_put_the_halves_then_the_code_queries_in_one_array(bounds):
  """One bf16 array per (row, head): the `query_halves` rows, then the key product's queries
  [D, rows] transposed to [rows, D] and rounded to bf16."""
  rng = np.random.default_rng(5)
  queries = jnp.asarray(rng.standard_normal((2, 3, 8, 64)), jnp.float32)
  code_queries = jnp.asarray(rng.standard_normal((2, 3, 64, 8)), jnp.float32)
  combined = queries_with_halves(code_queries, queries, bounds=bounds)
  halves_rows = (4 if bounds else 2) * 8
  assert combined.dtype == jnp.bfloat16 and combined.shape == (2, 3, halves_rows + 8, 64)
  np.testing.assert_array_equal(
    np.asarray(combined[:, :, :halves_rows]), np.asarray(query_halves(queries, bounds=bounds))
  )
  np.testing.assert_array_equal(
    np.asarray(combined[:, :, halves_rows:]),
    np.asarray(jnp.swapaxes(code_queries, 2, 3).astype(jnp.bfloat16)),
  )


def _prologue_outputs(k_min, k_scale, halves, lengths, *, split_tokens, group_size, bits, bounds):
  """Runs `split_key_statistics` alone in a Mosaic GPU kernel, one program per (row, head,
  split) as the folded kernel runs it: (bias f32 [B, H, S, chunks * 64, rows], references f32
  [B, H, S, rows] or None)."""
  batch, heads, groups, head_dim = k_min.shape
  rows = halves.shape[2] // (4 if bounds else 2)
  tokens = groups * group_size
  num_splits = -(-tokens // split_tokens)
  split_groups = split_key_groups(split_tokens, group_size)
  chunk_groups = 64
  chunks = bias_chunks(split_groups, chunk_groups)
  lengths = padded_lengths(lengths)
  # zeros appended as the folded kernel's caller appends them (whole 8-row tiles for TMA)
  short = padded_key_groups(groups, chunk_copy_groups(split_groups, chunk_groups, 0)) - groups
  k_min, k_scale = (jnp.pad(a, ((0, 0), (0, 0), (0, short), (0, 0))) for a in (k_min, k_scale))
  interpret = triton_interpret()
  native = not interpret

  def body(lengths_gmem, k_min_gmem, k_scale_gmem, halves_gmem, bias_gmem, references_gmem, **s):
    row, head, split = lax.axis_index("row"), lax.axis_index("head"), lax.axis_index("split")
    inputs_barrier, chunk_barriers = s["barriers"]
    plgpu.copy_gmem_to_smem(lengths_gmem, s["lengths_smem"], inputs_barrier)
    plgpu.copy_gmem_to_smem(halves_gmem.at[row, head], s["halves_smem"], inputs_barrier)
    plgpu.barrier_wait(inputs_barrier)
    start = split * split_tokens
    end = jnp.minimum(jnp.minimum(start + split_tokens, s["lengths_smem"][row]), tokens)
    split_key_statistics(
      k_min_gmem,
      k_scale_gmem,
      s["halves_smem"],
      s["tile_smem"],
      s["bias_smem"],
      s["references_smem"] if bounds else None,
      chunk_barriers,
      row=row,
      head=head,
      first_group=start // group_size,
      groups_used=(end - start + group_size - 1) // group_size,
      split_groups=split_groups,
      bits=bits,
    )
    plgpu.copy_smem_to_gmem(s["bias_smem"], bias_gmem.at[row, head, split])
    plgpu.copy_smem_to_gmem(s["references_smem"], references_gmem.at[row, head, split])
    plgpu.wait_smem_to_gmem(0)

  operand = swizzled_operand_transforms(head_dim, jnp.bfloat16)
  kernel = plgpu.kernel(
    body,
    out_type=(
      jax.ShapeDtypeStruct((batch, heads, num_splits, chunks * chunk_groups, rows), jnp.float32),
      jax.ShapeDtypeStruct((batch, heads, num_splits, rows), jnp.float32),
    ),
    grid=(batch, heads, num_splits),
    grid_names=("row", "head", "split"),
    scratch_types=dict(
      lengths_smem=plgpu.SMEM(lengths.shape, jnp.int32),
      halves_smem=plgpu.SMEM(halves.shape[2:], jnp.bfloat16, transforms=operand),
      tile_smem=plgpu.SMEM((chunk_groups, head_dim), jnp.bfloat16, transforms=operand),
      bias_smem=plgpu.SMEM((chunks * chunk_groups, rows), jnp.float32),
      references_smem=plgpu.SMEM((rows,), jnp.float32),
      barriers=(
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_barriers=chunks * copies_per_chunk(bounds)),
      ),
    ),
    compiler_params=_compat.mosaic_gpu_compiler_params(unsafe_no_auto_barriers=True),
    interpret=None if native else _compat.mosaic_gpu_interpret_params(),
  )
  bias, references = kernel(lengths, k_min, k_scale, halves)
  return bias, (references if bounds else None)


@pytest.mark.parametrize(
  "group_size,split_tokens,tokens,bounds",
  [
    (32, 256, 480, True),  # 8 groups per split, the last split's copy past the cache's end
    (8, 576, 576, True),  # 72 groups: two chunks, the second of 8
    (16, 512, 512, False),  # the bias alone
  ],
)
def test_the_prologue_gives_xlas_bias_and_softmax_references(
  group_size, split_tokens, tokens, bounds
):
  """Against `key_bias`, `key_score_bounds` and `split_softmax_references` (f32, before the
  kernel, what row_max="bound" with key_bias_source="xla" uses): the bias of every valid group
  within 1e-5 of its terms' magnitudes; the references EXCHANGE in the same splits, elsewhere
  within 1e-3. Rows: a full one, one ending mid-split, an empty one, one whose key scales in
  head 1 make the bounds too loose (so its splits there exchange), NaN statistics past each
  row's length."""
  rng = np.random.default_rng(group_size + tokens)
  batch, heads, head_dim, rows, bits = 4, 2, 128, 8, 2
  segment = random_quantized_segment(
    rng, batch, heads, tokens, head_dim, bits=bits, group_size=group_size, dtype=jnp.bfloat16
  )
  queries = base_two_queries(random_queries(rng, batch, heads, rows, head_dim), 128**-0.5)
  lengths = jnp.asarray([tokens, split_tokens + 40, 0, tokens], jnp.int32)
  k_scale = segment.k_scale.at[3, 1, :, 5].set(200.0)
  queries = queries.at[3, 1, :, 5].set(2.0)
  group_past = (
    jnp.arange(0, tokens, group_size)[None, None, :, None] >= lengths[:, None, None, None]
  )
  k_min = jnp.where(group_past, jnp.nan, segment.k_min)
  k_scale = jnp.where(group_past, jnp.nan, k_scale)
  halves = query_halves(queries, bounds=bounds)
  bias, references = _prologue_outputs(
    k_min,
    k_scale,
    halves,
    lengths,
    split_tokens=split_tokens,
    group_size=group_size,
    bits=bits,
    bounds=bounds,
  )
  # f32 products at full precision: on a GPU XLA's default takes tf32 tensor cores (~2^-11)
  with jax.default_matmul_precision("highest"):
    expected_bias = key_bias(queries, segment.k_min)  # [B, H, G, rows]
    magnitude = np.asarray(key_bias(jnp.abs(queries), jnp.abs(segment.k_min)))
  groups = tokens // group_size
  split_groups = split_tokens // group_size
  num_splits = bias.shape[2]
  flat = bias[:, :, :, :split_groups].reshape(batch, heads, num_splits * split_groups, rows)
  valid = np.asarray(~group_past[:, :, :, 0])[..., None].repeat(rows, axis=-1)
  difference = np.abs(np.asarray(flat[:, :, :groups]) - np.asarray(expected_bias))
  assert np.all(np.where(valid, difference <= 1e-5 * magnitude + 1e-30, True))
  if not bounds:
    return
  with jax.default_matmul_precision("highest"):
    bounds_terms = key_score_bounds(queries, k_scale, expected_bias, bits=bits)
  expected = np.asarray(
    split_softmax_references(
      *bounds_terms,
      lengths,
      group_size=group_size,
      split_tokens=split_tokens,
      num_splits=num_splits,
    )
  )
  exchange = np.asarray(references == EXCHANGE).any(axis=-1)
  np.testing.assert_array_equal(exchange, (expected == EXCHANGE).all(axis=-1))
  assert exchange[3, 1].all() and exchange[2].all() and not exchange[0].any()
  served = ~exchange
  np.testing.assert_allclose(np.asarray(references)[served], expected[served], rtol=0, atol=1e-3)
