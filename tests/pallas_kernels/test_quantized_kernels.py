"""Fused dequantize-attention kernels (GPU/Triton, all three variants, and TPU/Mosaic) against the
jnp reference: KIVI 2/4/8-bit and GEAR (low rank + outliers), head dims 64/128, query groups
1..8, lengths not multiples of any block, batch with different lengths and an empty row.

Interpret mode on CPU (compiled with KVJAX_NATIVE_KERNELS=1 on a GPU/TPU machine); fresh random
inputs per case; partial outputs poisoned with NaN before the call.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
  code_pair_halves_tpu,
  decode_attention_tpu,
  gear_terms_triton,
  token_block_fetches_tpu,
)
from pallas_kernels import quantized_decode_attention_tpu as tpu_kernel
from pallas_kernels import quantized_decode_attention_triton as triton_kernel
from pallas_kernels.decode_attention_tpu import tokens_on_lanes
from pallas_kernels.gear_terms_xla import gear_value_terms_from_scores
from pallas_kernels.quantized_decode_attention_reference import quantized_decode_attention_reference
from pallas_kernels.random_inputs import random_quantized_segment, random_queries, segment_kwargs
from pallas_kernels.splits import merge_split_partials, next_power_of_two
from tests.pallas_kernels.kernel_checks import (
  assert_all_written,
  assert_matches_reference,
  poison_past_lengths,
  relative_tolerance,
  tpu_interpret,
  triton_interpret,
)

TOKENS, GROUP_SIZE, BATCH, KV_HEADS, SPLITS = 256, 32, 3, 2, 2
GEAR_BLOCK = 64  # the default `block` of the kernels and of `random_quantized_segment`


def _case(
  seed,
  bits,
  head_dim,
  group,
  gear,
  dtype,
  outliers_per_block=20,
  tokens=TOKENS,
  group_size=GROUP_SIZE,
  kv_heads=KV_HEADS,
):
  rng = np.random.default_rng(seed)
  queries = random_queries(rng, BATCH, kv_heads, group, head_dim)
  segment = random_quantized_segment(
    rng,
    BATCH,
    kv_heads,
    tokens,
    head_dim,
    bits=bits,
    group_size=group_size,
    dtype=dtype,
    rank=3 if gear else 0,
    outliers_per_block=outliers_per_block if gear else 0,
  )
  # A full row, a row ending mid-group, an empty row.
  lengths = jnp.asarray([tokens, int(rng.integers(1, tokens)) | 1, 0], jnp.int32)
  kwargs = segment_kwargs(segment, bits=bits, group_size=group_size)
  reference = quantized_decode_attention_reference(queries, *segment[:6], lengths, **kwargs)
  return queries, segment, lengths, kwargs, reference


def _poison(rows, head_dim, kv_heads=KV_HEADS):
  return (
    jnp.full((BATCH, kv_heads, SPLITS, rows, head_dim), jnp.nan, jnp.float32),
    jnp.full((BATCH, kv_heads, SPLITS, rows), jnp.nan, jnp.float32),
  )


def _with_gear_value_terms(out, lse, scores, segment, lengths, *, unwritten_past: bool):
  """`out` plus GEAR's value terms from the scores a kernel wrote (`gear_terms_xla`), after
  checking that every score inside a row's length was written (and, with `unwritten_past`,
  that none past it was: the NaN poison stays)."""
  group, head_dim = lse.shape[-1], out.shape[-1]
  written = np.asarray(scores)[:, :, :group]
  inside = np.arange(written.shape[-1])[None, :] < np.asarray(lengths)[:, None]  # [B, T]
  assert not np.isnan(written[np.broadcast_to(inside[:, None, None], written.shape)]).any()
  if unwritten_past:
    assert np.isnan(written[np.broadcast_to(~inside[:, None, None], written.shape)]).all()
  return out + gear_value_terms_from_scores(
    segment.lowrank, segment.outliers, scores, lse, lengths, block=GEAR_BLOCK, head_dim=head_dim
  )


def _check_triton(
  bits,
  head_dim,
  group,
  gear,
  dtype,
  variant,
  seed,
  outliers_per_block=20,
  tokens=TOKENS,
  group_size=GROUP_SIZE,
  garbage_past_lengths=False,
  **config,
):
  """`garbage_past_lengths`: as `_check_tpu`'s."""
  queries, segment, lengths, kwargs, reference = _case(
    seed, bits, head_dim, group, gear, dtype, outliers_per_block, tokens, group_size
  )
  if garbage_past_lengths:
    segment = poison_past_lengths(segment, lengths, group_size=group_size, block=GEAR_BLOCK)
    kwargs.update(lowrank=segment.lowrank, outliers=segment.outliers)
  interpret = triton_interpret()
  xla_terms = gear and config.get("gear_terms") == "xla"
  poison = _poison(
    triton_kernel.partial_rows(
      group,
      head_dim,
      group_size,
      variant,
      config.get("block_tokens"),
      gear_block=GEAR_BLOCK if gear and not xla_terms else None,
      stack_copies=config.get("stack_copies"),
    ),
    head_dim,
  )
  if xla_terms:  # the kernel's scores too, for GEAR's value terms (gear_terms_xla)
    score_rows = next_power_of_two(group)
    poison += (jnp.full((BATCH, KV_HEADS, score_rows, tokens), jnp.nan, jnp.float32),)
  partials = triton_kernel.quantized_decode_attention_partials_triton(
    queries,
    *segment[:6],
    lengths,
    poison,
    num_splits=SPLITS,
    interpret=interpret,
    variant=variant,
    **kwargs,
    **config,
  )
  out_p, lse_p = partials[:2]
  assert_all_written(out_p, lse_p)
  out, lse = merge_split_partials(out_p, lse_p, group)
  order = triton_kernel.output_channel_order(
    head_dim,
    bits,
    group_size,
    variant,
    triton_kernel.compute_dtype_for(jnp.dtype(dtype)),
    config.get("channel_parts"),
  )
  out = out[..., np.argsort(order)]
  if xla_terms:
    # Every score inside a row's length is written, none past it (the NaN poison stays).
    out = _with_gear_value_terms(out, lse, partials[2], segment, lengths, unwritten_past=True)
  assert_matches_reference(out, lse, *reference, rtol=relative_tolerance(dtype, interpret))


# The TPU kernel's blocks are multiples of 128 tokens (its codes' lanes) holding whole tiles of
# key groups (512 tokens for 16-bit statistics at group 32): 1536 tokens make three blocks in
# two splits, which the kernel fetches itself (`token_block_fetches_tpu`). Below 128 channels
# the key groups are lanes too, 128 of them a block (4096 tokens at group 32): 5376 tokens make
# two blocks, the second mostly padding, which Mosaic's pipeline fetches (the blocks do not
# tile the segment): the masks must keep the padding out.
# With GEAR's low-rank factors there, the blocks hold 128 GEAR blocks too (8192 tokens: the B
# factors' lanes): 9472 tokens make two.
TPU_TOKENS = 1536
TPU_LANE_GROUP_TOKENS = 4096 + 1280
TPU_LANE_GEAR_TOKENS = 8192 + 1280


def _garbage_past_lengths(segment, lengths, kwargs, group_size):
  """The segment with garbage past each row's length (`poison_past_lengths`; GEAR's outlier
  indices signed, so that the garbage ones are negative), `kwargs`' GEAR terms updated."""
  if segment.outliers is not None:
    k_index, k_value, v_index, v_value = segment.outliers
    outliers = (k_index.astype(jnp.int32), k_value, v_index.astype(jnp.int32), v_value)
    segment = segment._replace(outliers=outliers)
  segment = poison_past_lengths(segment, lengths, group_size=group_size, block=GEAR_BLOCK)
  kwargs.update(lowrank=segment.lowrank, outliers=segment.outliers)
  return segment


def _check_tpu(
  bits,
  head_dim,
  group,
  gear,
  dtype,
  seed,
  block_tokens=512,
  outliers_per_block=20,
  garbage_past_lengths=False,
  group_size=GROUP_SIZE,
  kv_heads=KV_HEADS,
  tokens=None,
  entry_point_too=True,
):
  """With `garbage_past_lengths`, the kernel reads the segment with NaN and all-ones codes past
  each row's length (`poison_past_lengths`) and must give the clean segment's reference, by the
  entry point too unless not `entry_point_too` (a second compile of the interpreted kernel, half
  such a test's time: `test_tpu_kernel_ignores_garbage_past_lengths` always takes it)."""
  if tokens is None:
    tokens = TPU_TOKENS
    if tokens_on_lanes(head_dim):
      tokens = TPU_LANE_GEAR_TOKENS if gear else TPU_LANE_GROUP_TOKENS
  shape = dict(tokens=tokens, group_size=group_size, kv_heads=kv_heads)
  queries, segment, lengths, kwargs, reference = _case(
    seed, bits, head_dim, group, gear, dtype, outliers_per_block, **shape
  )
  if garbage_past_lengths:
    segment = _garbage_past_lengths(segment, lengths, kwargs, group_size)
  if garbage_past_lengths and entry_point_too:
    out, lse = tpu_kernel.quantized_decode_attention_tpu(
      queries,
      *segment[:6],
      lengths,
      num_splits=SPLITS,
      block_tokens=block_tokens,
      interpret=tpu_interpret(),
      **kwargs,
    )
    assert_matches_reference(out, lse, *reference, rtol=relative_tolerance(dtype, tpu_interpret()))
  interpret = tpu_interpret()
  rows = decode_attention_tpu.tile_rows(group)
  poison = _poison(rows, head_dim, kv_heads)
  partials = tpu_kernel.quantized_decode_attention_partials_tpu(
    queries,
    *segment[:6],
    lengths,
    poison,
    num_splits=SPLITS,
    block_tokens=block_tokens,
    interpret=interpret,
    **kwargs,
  )
  out_p, lse_p = partials
  assert_all_written(out_p, lse_p)
  out, lse = merge_split_partials(out_p, lse_p, group)
  assert_matches_reference(out, lse, *reference, rtol=relative_tolerance(dtype, interpret))


@pytest.mark.parametrize(
  "bits,head_dim,group,gear,dtype",
  [
    (2, 128, 4, False, jnp.bfloat16),
    (4, 64, 1, True, jnp.float32),
    (8, 128, 8, False, jnp.float32),
    (2, 64, 8, True, jnp.bfloat16),
  ],
)
def test_triton_kernel_matches_reference(bits, head_dim, group, gear, dtype):
  """The default ("reshape") variant."""
  _check_triton(
    bits, head_dim, group, gear, dtype, "reshape", seed=bits * head_dim + group, block_tokens=64
  )


@pytest.mark.parametrize(
  "bits,head_dim,group,gear,dtype",
  [
    (2, 64, 4, False, jnp.float32),
    pytest.param(4, 128, 2, True, jnp.bfloat16, marks=pytest.mark.slow),  # the slowest variant
  ],
)
def test_triton_planar_kernel_matches_reference(bits, head_dim, group, gear, dtype):
  _check_triton(bits, head_dim, group, gear, dtype, "planar", seed=bits + head_dim + group)


@pytest.mark.parametrize(
  "bits,head_dim,group,gear,dtype",
  [
    (2, 128, 4, False, jnp.float32),
    (4, 64, 2, True, jnp.bfloat16),
  ],
)
def test_tpu_kernel_matches_reference(bits, head_dim, group, gear, dtype):
  _check_tpu(bits, head_dim, group, gear, dtype, seed=bits * 7 + head_dim + group)


@pytest.mark.parametrize(
  "bits,head_dim,group,gear,dtype,kv_heads",
  [
    (2, 64, 4, True, jnp.bfloat16, 3),  # GEAR's default group of 64: SmolLM2's head_dim
    (4, 128, 1, False, jnp.float32, 2),
  ],
)
def test_tpu_kernel_with_one_value_group_per_token(bits, head_dim, group, gear, dtype, kv_heads):
  """Value groups as wide as the head: the kernel reads a block of every KV head's statistics
  row ([H, block], the layout XLA stores them in) once for the heads' consecutive steps, and
  takes its head's row; an odd number of heads, and garbage past the lengths."""
  _check_tpu(
    bits,
    head_dim,
    group,
    gear,
    dtype,
    seed=bits + head_dim + kv_heads,
    group_size=head_dim,
    kv_heads=kv_heads,
    garbage_past_lengths=True,
    entry_point_too=False,
  )


@pytest.mark.parametrize("bits,dtype", [(2, jnp.float32), (4, jnp.bfloat16)])
def test_tpu_kernel_with_key_groups_across_lane_tiles(bits, dtype):
  """Groups of 48 tokens at head_dim 192: a 128-token lane tile ends inside a key group, so the
  scales folded into the queries are taken per 384 tokens (lcm(128, 48)); taken per 128 a
  tile's last tokens lost their group (relative error 0.6, the review of v56). Two kernel
  blocks of 768 tokens, one row ending inside the second."""
  _check_tpu(
    bits,
    192,
    2,
    False,
    dtype,
    seed=48 + bits,
    group_size=48,
    tokens=1536,
    garbage_past_lengths=True,
    entry_point_too=False,
  )


@pytest.mark.parametrize(
  "bits,head_dim,group,gear,dtype",
  [
    (2, 128, 4, False, jnp.bfloat16),
    (4, 128, 2, True, jnp.float32),
    # 25-35 s in the default run: GEAR-2 at 64 in bfloat16 takes garbage past the lengths there
    # in `test_tpu_kernel_with_one_value_group_per_token`.
    pytest.param(2, 64, 1, True, jnp.bfloat16, marks=pytest.mark.slow),
  ],
)
def test_tpu_kernel_ignores_garbage_past_lengths(bits, head_dim, group, gear, dtype):
  """NaN statistics, factors and outlier values, all-ones codes and outlier indices past their
  block, in every storage unit past a row's length: the clean segment's result."""
  _check_tpu(bits, head_dim, group, gear, dtype, seed=bits + head_dim, garbage_past_lengths=True)


@pytest.mark.parametrize(
  "variant,bits,head_dim,group,gear,dtype,config",
  [
    ("reshape", 2, 128, 4, True, jnp.bfloat16, dict(block_tokens=64)),
    ("folded", 4, 64, 2, True, jnp.bfloat16, dict(block_tokens=64, gear_terms="xla")),
    ("folded", 2, 128, 4, True, jnp.float32, dict(gear_terms="kernel")),
    ("folded", 2, 128, 1, False, jnp.bfloat16, dict(block_tokens=128)),
  ],
)
def test_triton_kernel_ignores_garbage_past_lengths(
  variant, bits, head_dim, group, gear, dtype, config
):
  """As the TPU kernel's test: GEAR's terms in the kernel and by XLA around it."""
  _check_triton(
    bits,
    head_dim,
    group,
    gear,
    dtype,
    variant,
    seed=bits + head_dim + group,
    garbage_past_lengths=True,
    **config,
  )


@pytest.mark.parametrize(
  "bits,head_dim,group,gear,block_tokens,sublane_gathers",
  [
    # two key and two value groups a register of rows (slow: the other sublane-gather cases and
    # the broadcasts' case below run it by default; 9-16 s a case in interpret mode)
    pytest.param(2, 128, 4, False, 2048, True, marks=pytest.mark.slow),
    (2, 128, 4, False, 2048, False),  # the same, the statistics rows by broadcasts (a v4's)
    (4, 128, 1, False, 2048, True),  # MQA: four groups a register, the query row copied 8 times
    (2, 256, 3, False, 2048, True),  # 3 query rows: zero padding, one group a register
    (4, 128, 2, True, 2048, True),  # GEAR's terms beside the pairs (one chunk a block)
    (4, 64, 4, False, 4096, True),  # the key statistics [D, groups] (groups on lanes)
    (2, 64, 4, False, 4096, True),  # the token halves' pairs (`code_pair_halves_tpu`)
    # the same, MQA, the statistics rows by broadcasts (slow: both run above)
    pytest.param(2, 64, 1, False, 8192, False, marks=pytest.mark.slow),
  ],
)
def test_tpu_kernel_with_code_pairs_in_chunks(
  bits, head_dim, group, gear, block_tokens, sublane_gathers
):
  """bfloat16 statistics and codes filling whole registers: the codes as bfloat16 pairs
  (`code_pairs_apply`), blocks in chunks of 1024 tokens, each against its own maximum. Rows:
  whole; ending 300 tokens into the second block (its last chunk wholly past the length: no
  maximum); one token. Garbage past the lengths; partials poisoned."""
  tokens = 2 * block_tokens
  queries, segment, _, kwargs, _ = _case(
    group * 13 + bits, bits, head_dim, group, gear, jnp.bfloat16, tokens=tokens
  )
  assert tpu_kernel.code_pairs_apply(
    bits, head_dim, segment.k_scale.dtype
  ) or code_pair_halves_tpu.applies(bits, head_dim, segment.k_scale.dtype, block_tokens, GROUP_SIZE)
  assert block_tokens % tpu_kernel.CHUNK_TOKENS == 0 and block_tokens > tpu_kernel.CHUNK_TOKENS
  lengths = jnp.asarray([tokens, block_tokens + 300, 1], jnp.int32)
  reference = quantized_decode_attention_reference(queries, *segment[:6], lengths, **kwargs)
  segment = _garbage_past_lengths(segment, lengths, kwargs, GROUP_SIZE)
  rows = decode_attention_tpu.tile_rows(group)
  out_p, lse_p = tpu_kernel.quantized_decode_attention_partials_tpu(
    queries,
    *segment[:6],
    lengths,
    _poison(rows, head_dim),
    num_splits=SPLITS,
    block_tokens=block_tokens,
    interpret=tpu_interpret(),
    sublane_gathers=sublane_gathers,
    **kwargs,
  )
  assert_all_written(out_p, lse_p)
  out, lse = merge_split_partials(out_p, lse_p, group)
  assert_matches_reference(
    out, lse, *reference, rtol=relative_tolerance(jnp.bfloat16, tpu_interpret())
  )


# Most capacities are not a multiple of the kernel's block. At 1792 tokens in 512-token blocks
# the last block holds 256 tokens: whole tiles of the codes' and value statistics' lanes and of
# float32 key statistics' rows (8 groups), which the kernel copies short itself
# (`token_block_fetches_tpu.last_block_extent`); not of bfloat16 key statistics (16 rows a tile)
# or GEAR's 16-bit outliers (4 GEAR blocks), which come by BlockSpecs beside them.
# (`TPU_LANE_GROUP_TOKENS` above does the same below 128 channels: codes short, groups by
# BlockSpecs.) Past the short block the slot holds an older block, or NaN in interpret mode.
# The float32 cases run under -m slow; the race detector's test below runs the first of them.
@pytest.mark.parametrize(
  "bits,head_dim,group,gear,dtype,garbage",
  [
    (2, 128, 4, False, jnp.bfloat16, True),
    (4, 128, 2, True, jnp.bfloat16, False),
    pytest.param(2, 128, 4, False, jnp.float32, False, marks=pytest.mark.slow),
    pytest.param(2, 128, 1, True, jnp.float32, True, marks=pytest.mark.slow),
  ],
)
def test_tpu_kernel_with_a_short_last_block(bits, head_dim, group, gear, dtype, garbage):
  _check_tpu(
    bits, head_dim, group, gear, dtype, seed=bits + group, tokens=1792, garbage_past_lengths=garbage
  )


@pytest.mark.parametrize(
  "bits,head_dim,group,gear,dtype,tokens",
  [
    (2, 128, 4, False, jnp.bfloat16, 1792),
    pytest.param(4, 64, 1, True, jnp.float32, None, marks=pytest.mark.slow),
  ],
)
def test_tpu_kernel_fetches_without_races_on_two_cores(
  tpu_races, bits, head_dim, group, gear, dtype, tokens
):
  """The kernel's own double-buffered copies (short last blocks, BlockSpecs beside them) under
  the interpreter's race detector, the grid's (row, split) pairs split over two TensorCores."""
  _check_tpu(bits, head_dim, group, gear, dtype, seed=5 + bits, tokens=tokens)
  assert not tpu_races()


def test_the_race_detector_sees_a_block_read_before_its_copy_is_waited_for(tpu_races, monkeypatch):
  """The check above can fail: with the per-head windows' waits left out, the copies still land
  (eagerly) but the reads are not ordered after them."""
  each = token_block_fetches_tpu.TokenBlockFetches._each

  def without_waits(self, action, heads_whole, *args):
    if not (action == "wait" and not heads_whole):
      each(self, action, heads_whole, *args)

  monkeypatch.setattr(token_block_fetches_tpu.TokenBlockFetches, "_each", without_waits)
  _check_tpu(2, 128, 4, False, jnp.float32, seed=1, tokens=1792)
  assert tpu_races()


@pytest.mark.parametrize("head_dim, dtype", [(128, jnp.bfloat16), (64, jnp.float32)])
def test_tpu_kernel_matches_reference_for_gear_without_outliers(head_dim, dtype):
  """GEAR-L: the low-rank terms, all the kernel's own, with no score bias or scores."""
  _check_tpu(2, head_dim, 4, True, dtype, seed=11 + head_dim, outliers_per_block=0)


@pytest.mark.parametrize(
  "bits,head_dim,group,gear,dtype",
  [
    (2, 128, 4, False, jnp.bfloat16),
    (4, 64, 1, True, jnp.float32),
    (8, 128, 8, False, jnp.float32),
    (2, 64, 3, True, jnp.bfloat16),
  ],
)
def test_triton_joined_kernel_matches_reference(bits, head_dim, group, gear, dtype):
  _check_triton(
    bits, head_dim, group, gear, dtype, "joined", seed=bits * head_dim + group + 1, block_tokens=64
  )


@pytest.mark.parametrize(
  "bits,head_dim,group,gear,dtype,block_tokens,prefetch,code_operand,channel_parts,gear_terms",
  [
    (2, 128, 4, False, jnp.bfloat16, 128, False, None, None, None),
    (2, 128, 4, False, jnp.bfloat16, 128, True, "offset", None, None),
    # 2 blocks per split: the last prefetch is past it
    (2, 128, 4, False, jnp.bfloat16, 64, True, "subnormal", None, None),
    (4, 64, 1, False, jnp.bfloat16, 64, False, None, None, None),
    (4, 128, 2, False, jnp.bfloat16, 128, True, "offset", None, None),
    (8, 128, 8, False, jnp.bfloat16, 128, True, None, None, None),
    (2, 64, 3, False, jnp.float32, 64, False, "offset", None, None),
    (2, 128, 4, True, jnp.bfloat16, None, False, None, None, None),  # one GEAR block per step
    (4, 64, 2, True, jnp.bfloat16, None, True, "offset", None, None),
    (4, 64, 2, True, jnp.float32, None, True, None, None, "kernel"),
    # Each token's words in column slices (`channel_parts`)
    (2, 128, 4, False, jnp.bfloat16, 64, True, "subnormal", 2, None),
    pytest.param(
      2, 128, 4, False, jnp.bfloat16, 64, False, "offset", 4, None, marks=pytest.mark.slow
    ),
    (4, 64, 2, False, jnp.bfloat16, 64, True, None, 2, None),
    pytest.param(8, 128, 1, False, jnp.float32, 64, False, None, 2, None, marks=pytest.mark.slow),
    (2, 128, 4, True, jnp.bfloat16, None, True, None, 2, None),  # GEAR's value terms per part
    (2, 64, 8, False, jnp.bfloat16, 64, False, None, 4, None),  # one word per part
    # GEAR's terms by XLA around the kernel (`gear_terms_xla`): block_tokens as for KIVI
    (2, 128, 4, True, jnp.bfloat16, 128, True, None, None, "xla"),
    (4, 64, 3, True, jnp.float32, 64, False, None, None, "xla"),
    pytest.param(
      2, 64, 1, True, jnp.bfloat16, None, True, "offset", 2, "xla", marks=pytest.mark.slow
    ),
    pytest.param(
      8, 128, 8, True, jnp.bfloat16, 32, True, None, None, "xla", marks=pytest.mark.slow
    ),
    (2, 128, 4, False, jnp.bfloat16, 128, True, None, None, "xla"),  # KIVI: nothing to do
  ],
)
def test_triton_folded_kernel_matches_reference(
  bits,
  head_dim,
  group,
  gear,
  dtype,
  block_tokens,
  prefetch,
  code_operand,
  channel_parts,
  gear_terms,
):
  """None: the default code operand ("subnormal" for bf16 2- and 4-bit codes), one part, GEAR's
  terms in the kernel."""
  _check_triton(
    bits,
    head_dim,
    group,
    gear,
    dtype,
    "folded",
    seed=bits * head_dim + group + 2 + prefetch + (code_operand == "offset") + (channel_parts or 1),
    block_tokens=block_tokens,
    prefetch=prefetch,
    code_operand=code_operand,
    channel_parts=channel_parts,
    gear_terms=gear_terms,
  )


@pytest.mark.parametrize(
  "bits,head_dim,group,gear,dtype,block_tokens,group_size,prefetch,channel_parts",
  [
    # 32-token groups at block 128: 4 key and 4 value stacks of 1 and 2 rows -> 4 and 2 copies
    (2, 128, 1, False, jnp.bfloat16, 128, 32, True, None),
    (2, 128, 2, False, jnp.bfloat16, 128, 32, False, None),
    # GEAR's 64-token groups (terms by XLA): 2 stacks of 4 rows -> 2 copies of each operand
    (2, 128, 4, True, jnp.bfloat16, 128, 64, True, None),
    (4, 128, 3, True, jnp.bfloat16, 128, 64, False, None),
    # D 64, block 64: 2 key and 2 value stacks of 2 rows -> 4 copies; f32 operands
    (4, 64, 2, False, jnp.float32, 64, 32, True, None),
    # 8-bit codes, one head, group 64: 2 stacks of 1 row -> 8 copies
    (8, 128, 1, False, jnp.bfloat16, 128, 64, True, None),
    # Each part's value product and the summed key scores from their own copies
    (2, 128, 1, False, jnp.bfloat16, 128, 32, True, 2),
    # 8 rows at 4 stacks already fill the tile: one copy, the padding rows' layout
    (2, 128, 8, False, jnp.bfloat16, 128, 32, True, None),
  ],
)
def test_triton_folded_stack_copies_match_reference(
  bits, head_dim, group, gear, dtype, block_tokens, group_size, prefetch, channel_parts
):
  """`stack_copies`: the query group padded to a power of two only, the stacked operands
  repeated to fill the tensor-core tile and one copy's product kept."""
  _check_triton(
    bits,
    head_dim,
    group,
    gear,
    dtype,
    "folded",
    seed=bits * head_dim + group + block_tokens + group_size,
    group_size=group_size,
    block_tokens=block_tokens,
    prefetch=prefetch,
    channel_parts=channel_parts,
    gear_terms="xla" if gear else None,
    stack_copies=True,
  )


def test_stack_copies_is_a_folded_switch_and_leaves_the_query_rows_unpadded():
  call = triton_kernel.quantized_decode_attention_partials_triton
  queries, segment, lengths, kwargs, _ = _case(9, 2, 64, 2, True, jnp.bfloat16)
  with pytest.raises(ValueError, match="stack_copies=True is a setting of variant='folded'"):
    call(queries, *segment[:6], lengths, variant="joined", stack_copies=True, **kwargs)
  with pytest.raises(ValueError, match="stack_copies=1 must be True, False or None"):
    call(queries, *segment[:6], lengths, variant="folded", stack_copies=1, **kwargs)
  with pytest.raises(ValueError, match="stack_copies=True needs gear_terms='xla'"):
    call(
      queries,
      *segment[:6],
      lengths,
      variant="folded",
      stack_copies=True,
      gear_terms="kernel",
      **kwargs,
    )
  for group, padded in ((1, 4), (2, 4), (3, 4), (4, 4), (8, 8)):
    for stack_copies, rows in ((None, padded), (True, next_power_of_two(group))):
      assert (
        triton_kernel.partial_rows(group, 128, 32, "folded", 128, stack_copies=stack_copies) == rows
      )
  # GEAR group 64 at block 128: 2 stacks, so 8 rows padded, 4 with copies.
  assert triton_kernel.partial_rows(4, 128, 64, "folded", 128) == 8
  assert triton_kernel.partial_rows(4, 128, 64, "folded", 128, stack_copies=True) == 4


def test_gear_terms_by_xla_where_the_blocks_overhang_the_capacity():
  """192 tokens (three GEAR blocks) in 128-token steps: the last step's loads and score stores
  run past the capacity, masked."""
  _check_triton(
    2, 128, 4, True, jnp.bfloat16, "folded", seed=5, tokens=192, block_tokens=128, gear_terms="xla"
  )


def test_gear_terms_is_a_folded_setting():
  call = triton_kernel.quantized_decode_attention_partials_triton
  queries, segment, lengths, kwargs, reference = _case(9, 2, 64, 2, True, jnp.bfloat16)
  with pytest.raises(ValueError, match="gear_terms='xla' is a setting of variant='folded'"):
    call(queries, *segment[:6], lengths, variant="joined", gear_terms="xla", **kwargs)
  with pytest.raises(ValueError, match="gear_terms='XLA' is not supported; allowed: kernel, xla"):
    call(queries, *segment[:6], lengths, variant="folded", gear_terms="XLA", **kwargs)
  # Where "folded" falls back (16 query heads per KV head), the fallback computes the terms.
  queries, segment, lengths, kwargs, reference = _case(6, 2, 64, 16, True, jnp.bfloat16)
  out, lse = triton_kernel.quantized_decode_attention_triton(
    queries, *segment[:6], lengths, gear_terms="xla", interpret=triton_interpret(), **kwargs
  )
  assert_matches_reference(out, lse, *reference, rtol=relative_tolerance(jnp.bfloat16, True))


@pytest.mark.parametrize(
  "gear,config,expected",
  [
    (True, {}, "xla"),  # DEFAULT_GEAR_TERMS, measured faster on H100 (KERNEL_NOTES v13)
    (True, {"gear_terms": "kernel"}, "kernel"),
    (True, {"gear_terms": "xla"}, "xla"),
    (False, {}, None),  # KIVI: nothing to place
    (True, {"variant": "joined"}, None),  # not a setting of the other variants
  ],
)
def test_gear_terms_default_and_choice_reach_the_partials(gear, config, expected, monkeypatch):
  """What quantized_decode_attention_triton asks of the partials function (stopped there: the
  kernels themselves are checked against the reference above)."""
  seen = []

  class Stop(Exception):
    pass

  def record(*args, **kwargs):
    seen.append(kwargs.get("gear_terms"))
    raise Stop

  monkeypatch.setattr(triton_kernel, "quantized_decode_attention_partials_triton", record)
  queries, segment, lengths, kwargs, _ = _case(4, 2, 64, 2, gear, jnp.bfloat16)
  with pytest.raises(Stop):
    triton_kernel.quantized_decode_attention_triton(
      queries, *segment[:6], lengths, interpret=triton_interpret(), **kwargs, **config
    )
  assert seen == [expected]


def test_channel_parts_is_a_folded_setting_that_divides_the_words():
  call = triton_kernel.quantized_decode_attention_partials_triton
  queries, segment, lengths, kwargs, reference = _case(9, 2, 64, 2, False, jnp.bfloat16)
  with pytest.raises(ValueError, match="channel_parts=2 is a setting of variant='folded'"):
    call(queries, *segment[:6], lengths, variant="joined", channel_parts=2, **kwargs)
  for bad in (3, 0, True, "2"):
    with pytest.raises(
      ValueError, match=f"channel_parts={bad!r} is not supported; allowed: 1, 2, 4"
    ):
      call(queries, *segment[:6], lengths, variant="folded", channel_parts=bad, **kwargs)
  # 8-bit codes at D 32 would leave 8 channels per part: refused before tracing.
  with pytest.raises(ValueError, match="channel_parts=4 must be one of"):
    triton_kernel.check_channel_parts(4, 32, 8)
  # Where "folded" falls back (16 query heads per KV head), the fallback runs without it.
  queries, segment, lengths, kwargs, reference = _case(6, 2, 64, 16, False, jnp.bfloat16)
  out, lse = triton_kernel.quantized_decode_attention_triton(
    queries, *segment[:6], lengths, channel_parts=2, interpret=triton_interpret(), **kwargs
  )
  assert_matches_reference(out, lse, *reference, rtol=relative_tolerance(jnp.bfloat16, True))


def test_code_operand_is_a_folded_setting_for_bf16_pairs():
  queries, segment, lengths, kwargs, reference = _case(9, 2, 64, 2, False, jnp.bfloat16)
  call = triton_kernel.quantized_decode_attention_partials_triton
  for variant in ("reshape", "joined", "planar"):
    with pytest.raises(ValueError, match="code_operand='offset' is a setting of variant='folded'"):
      call(queries, *segment[:6], lengths, variant=variant, code_operand="offset", **kwargs)
  with pytest.raises(ValueError, match="code_operand='magic' is not supported; allowed: subnormal"):
    call(queries, *segment[:6], lengths, variant="folded", code_operand="magic", **kwargs)
  for bits, dtype in ((8, jnp.bfloat16), (2, jnp.float32)):
    queries, segment, lengths, kwargs, reference = _case(9, bits, 64, 2, False, dtype)
    with pytest.raises(ValueError, match="code_operand='subnormal' needs 2- or 4-bit codes"):
      call(queries, *segment[:6], lengths, variant="folded", code_operand="subnormal", **kwargs)


def test_prefetch_is_a_folded_setting():
  queries, segment, lengths, kwargs, reference = _case(9, 2, 64, 2, False, jnp.bfloat16)
  for variant in ("reshape", "joined", "planar"):
    for prefetch in (True, False):
      with pytest.raises(ValueError, match=f"prefetch={prefetch} is a setting of variant='folded'"):
        triton_kernel.quantized_decode_attention_partials_triton(
          queries, *segment[:6], lengths, variant=variant, prefetch=prefetch, **kwargs
        )
  with pytest.raises(ValueError, match="prefetch=1 must be True, False or None"):
    triton_kernel.quantized_decode_attention_partials_triton(
      queries, *segment[:6], lengths, variant="folded", prefetch=1, **kwargs
    )
  # Where "folded" falls back (16 query heads per KV head), the fallback runs without it.
  queries, segment, lengths, kwargs, reference = _case(6, 2, 64, 16, False, jnp.bfloat16)
  out, lse = triton_kernel.quantized_decode_attention_triton(
    queries, *segment[:6], lengths, prefetch=True, interpret=triton_interpret(), **kwargs
  )
  assert_matches_reference(out, lse, *reference, rtol=relative_tolerance(jnp.bfloat16, True))


@pytest.mark.parametrize(
  "variant",
  [
    "folded",
    # The other variants share gear_terms_triton's chunking; slow since GEAR's default became
    # terms by XLA around folded (KERNEL_NOTES v13).
    pytest.param("reshape", marks=pytest.mark.slow),
    pytest.param("joined", marks=pytest.mark.slow),
    pytest.param("planar", marks=pytest.mark.slow),
  ],
)
def test_gear_outliers_in_several_one_hot_chunks(variant):
  """164 outliers per GEAR block (GEAR's 2% of 64 x 128) are taken in 3 chunks of 64."""
  assert gear_terms_triton.padded_outlier_count(164) == 192
  _check_triton(2, 128, 4, True, jnp.bfloat16, variant, seed=11, outliers_per_block=164)


@pytest.mark.parametrize("code_operand", ["offset", "subnormal"])
def test_folded_zero_codes_make_zero_keys_exactly(code_operand):
  """All codes 0 and all minimums 0 make every key exactly 0, so attention is uniform and the
  output is the mean of the values. The "offset" bf16-pair operands are built as 128 + code
  and must come out as the code itself: any 128 left in them (or taken out through a rounded
  bias) would put 128 x sum(q * k_scale) into the scores, which with scales x10 moves lse far
  from log(T). The "subnormal" ones must be 0 whatever their scale."""
  rng = np.random.default_rng(7)
  head_dim, group = 128, 4
  queries = random_queries(rng, BATCH, KV_HEADS, group, head_dim) * 3.0
  segment = random_quantized_segment(
    rng, BATCH, KV_HEADS, TOKENS, head_dim, bits=2, group_size=GROUP_SIZE, dtype=jnp.bfloat16
  )
  k_codes = jnp.zeros_like(segment.k_codes)
  k_min = jnp.zeros_like(segment.k_min)
  lengths = jnp.full((BATCH,), TOKENS, jnp.int32)
  kwargs = dict(bits=2, group_size=GROUP_SIZE, sm_scale=head_dim**-0.5)
  arrays = (k_codes, segment.k_scale * 10.0, k_min) + tuple(segment[3:6])
  out, lse = triton_kernel.quantized_decode_attention_triton(
    queries,
    *arrays,
    lengths,
    variant="folded",
    code_operand=code_operand,
    interpret=triton_interpret(),
    **kwargs,
  )
  ref_out, ref_lse = quantized_decode_attention_reference(queries, *arrays, lengths, **kwargs)
  np.testing.assert_allclose(np.asarray(lse), np.log(TOKENS), rtol=0, atol=1e-4)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-2, atol=2e-3)


def test_folded_falls_back_for_wide_groups_and_every_variant_rejects_a_bad_block():
  wide_group = _case(6, 2, 64, 16, False, jnp.bfloat16)  # 16 query heads per KV head
  queries, segment, lengths, kwargs, reference = wide_group
  out, lse = triton_kernel.quantized_decode_attention_triton(
    queries, *segment[:6], lengths, variant="folded", interpret=triton_interpret(), **kwargs
  )  # runs as "joined"
  assert_matches_reference(out, lse, *reference, rtol=relative_tolerance(jnp.bfloat16, True))
  assert not triton_kernel.folded_supported(128, 2, 32, block_tokens=48)
  assert not triton_kernel.folded_supported(256, 8, 32, block_tokens=128)
  assert triton_kernel.folded_supported(128, 2, 32, block_tokens=128)
  queries, segment, lengths, kwargs, _ = _case(8, 2, 64, 2, False, jnp.bfloat16)
  for variant in ("folded", "joined", "reshape"):
    for block_tokens in (48, 16):  # not a power of two; less than one key group of 32
      with pytest.raises(ValueError, match=f"block_tokens={block_tokens} must be a power of two"):
        triton_kernel.quantized_decode_attention_triton(
          queries, *segment[:6], lengths, variant=variant, block_tokens=block_tokens, **kwargs
        )


def test_planar_steps_by_key_groups_whatever_block_tokens_says():
  queries, segment, lengths, kwargs, reference = _case(9, 2, 64, 2, False, jnp.float32)
  out, lse = triton_kernel.quantized_decode_attention_triton(
    queries,
    *segment[:6],
    lengths,
    variant="planar",
    block_tokens=16,  # the folded loop would refuse it: less than one key group of 32
    interpret=triton_interpret(),
    **kwargs,
  )
  assert_matches_reference(
    out, lse, *reference, rtol=relative_tolerance(jnp.float32, triton_interpret())
  )


def test_joined_falls_back_where_a_value_group_splits_a_bit_field():
  # head_dim 256 at 8 bits: 64-channel bit fields, 32-channel value groups.
  assert not triton_kernel.joined_supported(256, 8, 32)
  assert triton_kernel.joined_supported(128, 8, 32)


def test_channel_orders_are_permutations():
  for head_dim, bits in itertools.product((64, 128), (2, 4, 8)):
    key_order, value_order = triton_kernel.channel_orders(head_dim, bits, GROUP_SIZE)
    np.testing.assert_array_equal(np.sort(key_order), np.arange(head_dim))
    np.testing.assert_array_equal(np.sort(value_order), np.arange(head_dim))
    # Each value group's channels occupy its own contiguous block of positions.
    groups = value_order.reshape(-1, GROUP_SIZE) // GROUP_SIZE
    np.testing.assert_array_equal(
      groups, np.broadcast_to(np.arange(head_dim // GROUP_SIZE)[:, None], groups.shape)
    )
    joined = triton_kernel.joined_value_order(head_dim, bits, GROUP_SIZE)
    np.testing.assert_array_equal(np.sort(joined), np.arange(head_dim))


@pytest.mark.slow
@pytest.mark.parametrize(
  "variant,first_block,bits,head_dim,group,gear",
  [
    (variant, first_block, *shape)
    for variant, first_block in (("reshape", 128), ("joined", 64), ("folded", 128))
    for shape in itertools.product((2, 4, 8), (64, 128), (1, 2, 4, 8), (False, True))
  ],
)
def test_triton_kernel_grid(variant, first_block, bits, head_dim, group, gear):
  """The one-dot-per-block variants; the joined ones with the opposite storage dtypes."""
  joined = variant == "joined"
  dtype = jnp.float32 if (bits + group + joined) % 2 else jnp.bfloat16
  _check_triton(
    bits,
    head_dim,
    group,
    gear,
    dtype,
    variant,
    seed=bits + (5 + 2 * joined) * head_dim + group,
    block_tokens=32 if gear else first_block,
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "bits,head_dim,group,gear",
  list(itertools.product((2, 4, 8), (64, 128), (1, 2, 4, 8), (False, True))),
)
def test_triton_planar_kernel_grid(bits, head_dim, group, gear):
  dtype = jnp.bfloat16 if (bits + group) % 2 else jnp.float32
  _check_triton(
    bits, head_dim, group, gear, dtype, "planar", seed=bits + 3 * head_dim + group, unroll=1 + gear
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "bits,head_dim,group,gear",
  list(itertools.product((2, 4, 8), (64, 128), (1, 4, 8), (False, True))),
)
def test_tpu_kernel_grid(bits, head_dim, group, gear):
  dtype = jnp.float32 if (bits + group) % 2 else jnp.bfloat16
  _check_tpu(bits, head_dim, group, gear, dtype, seed=bits + 5 * head_dim + group)


def test_the_triton_kernel_called_directly_refuses_what_it_does_not_take():
  queries, segment, lengths, kwargs, _ = _case(3, 2, 64, 4, False, jnp.float32)
  queries = jnp.concatenate([queries] * 17, axis=2)  # 68 query heads per KV head
  with pytest.raises(ValueError, match="does not take query group 68 > 64"):
    triton_kernel.quantized_decode_attention_triton(queries, *segment[:6], lengths, **kwargs)


def test_the_tpu_kernel_called_directly_refuses_what_it_does_not_take():
  """By name, before tracing: settings outside their allowed values (block_tokens=0 gave a
  ZeroDivisionError, a negative one was rounded up), what `unsupported_reason` names."""
  queries, segment, lengths, kwargs, _ = _case(4, 2, 128, 4, False, jnp.float32)
  call = functools.partial(
    tpu_kernel.quantized_decode_attention_tpu, queries, *segment[:6], lengths, **kwargs
  )
  for block_tokens in (0, -512, 3.5):
    with pytest.raises(ValueError, match=rf"block_tokens={block_tokens!r} is not supported"):
      call(block_tokens=block_tokens)
  with pytest.raises(ValueError, match="num_splits=0 is not supported"):
    call(num_splits=0)
  with pytest.raises(ValueError, match=r"lengths must have shape \(3,\)"):
    tpu_kernel.quantized_decode_attention_tpu(queries, *segment[:6], lengths[:1], **kwargs)
  stats = [array.astype(jnp.float16) for array in segment[1:3]]
  with pytest.raises(ValueError, match="does not take scale dtype float16"):
    tpu_kernel.quantized_decode_attention_tpu(
      queries, segment.k_codes, *stats, *segment[3:6], lengths, **kwargs
    )


@pytest.mark.parametrize("gear", [False, True])
def test_a_length_past_the_capacity_counts_as_the_capacity(gear):
  """As in the reference. The TPU kernel read a block past the capacity before (out of
  bounds, interpreted)."""
  tokens = TPU_TOKENS
  queries, segment, _, kwargs, _ = _case(8 + gear, 2, 128, 4, gear, jnp.float32, tokens=tokens)
  full = jnp.full((BATCH,), tokens, jnp.int32)
  reference = quantized_decode_attention_reference(queries, *segment[:6], full, **kwargs)
  past = jnp.asarray([tokens + 1, tokens + 300, 2**30], jnp.int32)
  results = [
    tpu_kernel.quantized_decode_attention_tpu(
      queries, *segment[:6], past, num_splits=SPLITS, interpret=tpu_interpret(), **kwargs
    ),
    triton_kernel.quantized_decode_attention_triton(
      queries, *segment[:6], past, num_splits=SPLITS, interpret=triton_interpret(), **kwargs
    ),
  ]
  for out, lse in results:
    assert_matches_reference(out, lse, *reference, rtol=relative_tolerance(jnp.float32, False))


@pytest.mark.parametrize("groups_axis", [0, 1])
def test_the_key_minimums_scores_are_spread_exactly(groups_axis):
  """q . k_min per key group spread over the group's tokens, taken from bf16 queries as two
  bf16 halves of the f32 sums: within 2^-16 of the sums (a single bf16 spread would be off by
  up to 2^-9), each token its own group's."""
  rng = np.random.default_rng(5)
  rows, head_dim, groups, group_size = 8, 64, 16, 32
  queries = jnp.asarray(rng.standard_normal((rows, head_dim)) * 3, jnp.bfloat16)
  k_min = jnp.asarray(rng.standard_normal((groups, head_dim)), jnp.bfloat16)
  stored = k_min if groups_axis == 0 else k_min.T
  scores = tpu_kernel._key_minimum_scores(
    queries, stored, group_size, groups * group_size, groups_axis
  )
  per_group = np.asarray(queries, np.float64) @ np.asarray(k_min, np.float64).T
  expected = np.repeat(per_group, group_size, axis=1)
  np.testing.assert_allclose(np.asarray(scores), expected, rtol=2.0**-16, atol=1e-5)


@pytest.mark.parametrize(
  "bits,head_dim,stats_dtype,expected",
  [
    (2, 128, jnp.bfloat16, tpu_kernel.CODE_PAIR_BLOCK_TOKENS),
    (4, 64, jnp.bfloat16, tpu_kernel.CODE_PAIR_BLOCK_TOKENS),
    (2, 64, jnp.bfloat16, tpu_kernel.TOKEN_HALVES_BLOCK_TOKENS),
    (2, 64, jnp.float32, tpu_kernel.TOKEN_HALVES_BLOCK_TOKENS),
    (4, 128, jnp.float32, tpu_kernel.DEFAULT_BLOCK_TOKENS),
    (8, 128, jnp.bfloat16, tpu_kernel.DEFAULT_BLOCK_TOKENS),
  ],
)
def test_the_tpu_kernel_default_blocks_follow_the_path_the_codes_take(
  bits, head_dim, stats_dtype, expected
):
  """The static counts' choices (KERNEL_NOTES v57, v58); a shorter segment is one block."""
  block = tpu_kernel.block_tokens_for(32768, 32, stats_dtype, None, head_dim, bits=bits)
  assert block == expected
  assert tpu_kernel.block_tokens_for(1000, 32, stats_dtype, None, head_dim, bits=bits) == 1000


def test_the_tpu_generation_decides_the_sublane_gathers():
  kinds = {"TPU v4": 4, "TPU v5 lite": 5, "TPU v5e": 5, "TPU v5p": 5, "TPU v6e": 6, "TPU7x": 1000}
  for kind, generation in kinds.items():
    assert tpu_kernel.tpu_generation(kind) == generation, kind
  assert tpu_kernel.sublane_gathers_lower()  # no TPU here: interpret mode takes them
  with jax.default_device(jax.devices("cpu")[0]):
    assert tpu_kernel.sublane_gathers_lower()


def test_the_tpu_kernel_refuses_a_sublane_gathers_setting_that_is_not_a_bool():
  queries, segment, lengths, kwargs, _ = _case(3, 2, 128, 4, False, jnp.bfloat16)
  with pytest.raises(ValueError, match="sublane_gathers='yes'; allowed: None, True, False"):
    tpu_kernel.quantized_decode_attention_partials_tpu(
      queries, *segment[:6], lengths, sublane_gathers="yes", interpret=True, **kwargs
    )
