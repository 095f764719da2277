"""TPU decode attention over a full-precision K/V segment: Pallas with the Mosaic lowering.

Grid (batch, kv_heads, splits, blocks): the first three are parallel (the sequence split is
flash-decoding across cores), the last walks one split's blocks with an online softmax held in
VMEM scratch. Lengths are scalar-prefetched into SMEM; the K/V index maps clamp the block index
to the row's last valid block, so steps past the length repeat the previous block index and
Pallas issues no DMA for them, and their compute is skipped with `pl.when`. The last step of a
split writes its normalised output and log-sum-exp; `merge_split_partials` combines splits.

A TPU tiles the last two dimensions of an array into (8, 128) tiles. At head_dim 128 the cache
[B, H, T, D] fills them as it is. At head_dim 64 XLA lays a [B, H, T, 64] argument out with T
last (no padding), and a kernel taking [block, 64] tiles made it copy K and V into a row-major
layout padded to 128 lanes at every call (compiled for a TPU v5e without one, KERNEL_NOTES
v49). Below 128 channels the kernel therefore takes K and V as [D, T] (`jnp.swapaxes`: the
layout XLA chose, nothing moves), scores = q . K^T as they come and the value product
contracting the token lanes (`tokens_on_lanes`).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.decode_attention_reference import check_decode_inputs
from pallas_kernels.launch_settings import check_launch_settings
from pallas_kernels.splits import SplitPlan, merge_split_partials, pad_query_group, plan_splits

SUBLANES = 8  # query rows are padded to the f32 sublane tile
LANES = 128
# A grid step costs about 250 bundles besides its block's work (the pipeline's DMA issue and
# waits, the index maps): at 512 tokens a block, head_dim 64, a 32k call issued longer than its
# reads take on a v5e; at 2048, 2.6x fewer cycles (static bundle counts, `tpu_static_cost`,
# KERNEL_NOTES v55).
DEFAULT_BLOCK_TOKENS = 2048


def unsupported_reason(queries, keys, values=None) -> str | None:
  head_dim = queries.shape[3]
  if head_dim % 64 != 0:
    return f"head_dim={head_dim} (must be a multiple of 64)"
  if keys.dtype not in (jnp.float32, jnp.bfloat16):
    return f"cache dtype {keys.dtype} (allowed: float32, bfloat16)"
  if values is not None and values.dtype != keys.dtype:
    return f"values dtype {values.dtype} with keys dtype {keys.dtype} (must be equal)"
  return None


def check_call(queries, keys, values, lengths, *, block_tokens, num_splits) -> None:
  """ValueError naming what a direct call passes that the kernel does not take: shapes that do
  not fit the queries', settings outside `launch_settings`' allowed values, unsupported dtypes
  or head dims (the dispatch runs the reference for those; called directly, refused)."""
  check_decode_inputs(queries, keys, values, lengths)
  check_launch_settings(dict(block_tokens=block_tokens, num_splits=num_splits))
  reason = unsupported_reason(queries, keys, values)
  if reason is not None:
    raise ValueError(f"the TPU decode-attention kernel does not take {reason}")


def sublane_tile_rows(itemsize: int) -> int:
  """Rows of a VMEM tile of `itemsize`-byte entries: 8 of 32-bit ones, 16 of 16-bit, 32 of 8-bit
  (32 bytes of sublanes)."""
  return SUBLANES * 4 // itemsize


def tile_rows(group: int) -> int:
  return -(-group // SUBLANES) * SUBLANES


def last_valid_block(row, lengths_ref, *, plan: SplitPlan):
  """The row's last block holding a token before its length (block 0 for an empty row)."""
  return jnp.maximum((lengths_ref[row] + plan.block_tokens - 1) // plan.block_tokens - 1, 0)


def clamped_block_index(row, split, step, lengths_ref, *, plan: SplitPlan):
  """Block to fetch at this grid step: the step's own block, or the row's last valid block
  once the step is past the length (same index as the previous step: no DMA)."""
  block = split * plan.blocks_per_split + step
  return jnp.minimum(block, last_valid_block(row, lengths_ref, plan=plan))


def valid_token_masks(first, length, block: int) -> tuple[jax.Array, jax.Array]:
  """bool ([1, block], [block, 1]): which of tokens first .. first + block - 1 lie before
  `length`, as a row (for scores [rows, block]) and as a column (for values [block, D]).

  Built as two 2-D iotas: Mosaic cannot lay out a 1-D mask's reshape to [1, block] or
  [block, 1] ("infer-vector-layout: unsupported shape cast", compiled for a TPU v5e)."""
  row = first + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1) < length
  column = first + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0) < length
  return row, column


def tokens_on_lanes(head_dim: int) -> bool:
  """Whether the kernel takes K and V as [D, T] (head_dim below a lane tile) or [T, D]."""
  return head_dim < LANES


def cache_token_granule(head_dim: int) -> int:
  """Tokens a [B, H, T, D] cache's capacity is best a multiple of for this kernel to read it in
  a TPU's default layout: 128 below 128 channels (the tokens on lanes), 16 from 128 (the
  sublanes of a 16-bit tile). At other capacities the default layout of that shape is not the
  one the kernel reads (the heads second-minor at 128 channels; at 64 the one-token write
  went through a channels-minor layout too), and a decode step jitted alone, the cache passed
  in that layout, copied all of K and V at every call: 665 MB at 20100 tokens, batch 8, 8 KV
  heads, head_dim 128, 992 MB at 64 (compiled for a v5e, KERNEL_NOTES v64)."""
  return LANES if tokens_on_lanes(head_dim) else 16


def online_softmax_update(
  scores, values, valid_tokens, max_ref, sum_ref, acc_ref, *, values_transposed=False
):
  """One block's update of the (max, sum, acc) scratch; scores [rows, T], values [T, D] (or
  [D, T] with values_transposed); valid_tokens: `valid_token_masks`' (row [1, T], column
  [T, 1])."""
  valid_row, valid_column = valid_tokens
  scores = jnp.where(valid_row, scores, -jnp.inf)
  previous_max = max_ref[...]  # [rows, 1]
  new_max = jnp.maximum(previous_max, scores.max(axis=1, keepdims=True))
  correction = jnp.exp(previous_max - new_max)  # 0 on the first block (max was -inf)
  probs = jnp.exp(scores - new_max)
  sum_ref[...] = sum_ref[...] * correction + probs.sum(axis=1, keepdims=True)
  max_ref[...] = new_max
  # Slots past the length may hold anything (NaN included): zero them so 0 * NaN cannot leak.
  values = jnp.where(valid_row if values_transposed else valid_column, values, 0).astype(
    values.dtype
  )
  token_axis = 1 if values_transposed else 0
  acc_ref[...] = acc_ref[...] * correction + jax.lax.dot_general(
    probs.astype(values.dtype),
    values,
    (((1,), (token_axis,)), ((), ())),
    preferred_element_type=jnp.float32,
  )
  return probs, correction


def finalize(max_ref, sum_ref, acc, out_ref, lse_ref):
  total = sum_ref[...]  # [rows, 1]
  nonempty = total != 0  # a NaN sum is not empty: the NaN reaches out and lse
  safe_total = jnp.where(nonempty, total, 1.0)
  out_ref[...] = jnp.where(nonempty, acc / safe_total, 0.0).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(nonempty, max_ref[...] + jnp.log(safe_total), -jnp.inf)


def _decode_kernel(
  lengths_ref, queries_ref, keys_ref, values_ref, *rest, plan: SplitPlan, transposed: bool
):
  out_ref, lse_ref, max_ref, sum_ref, acc_ref = rest[-5:]
  row, split, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  block = plan.block_tokens

  @pl.when(step == 0)
  def _init():
    max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
    sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  length = lengths_ref[row]
  first = (split * plan.blocks_per_split + step) * block

  @pl.when(first < length)
  def _attend():
    valid = valid_token_masks(first, length, block)
    key_channel_axis = 0 if transposed else 1  # keys [D, block] or [block, D]
    scores = jax.lax.dot_general(
      queries_ref[...],
      keys_ref[...],
      (((1,), (key_channel_axis,)), ((), ())),
      preferred_element_type=jnp.float32,
    )  # [rows, block]
    online_softmax_update(
      scores, values_ref[...], valid, max_ref, sum_ref, acc_ref, values_transposed=transposed
    )

  @pl.when(step == plan.blocks_per_split - 1)
  def _write():
    finalize(max_ref, sum_ref, acc_ref[...], out_ref, lse_ref)


@_compat.waits_when_interpreted  # the jax 0.11.2 interpreter hang: `finished_if_interpreted`
@functools.partial(jax.jit, static_argnames=("sm_scale", "block_tokens", "num_splits", "interpret"))
def decode_attention_partials_tpu(
  queries,
  keys,
  values,
  lengths,
  initial_partials=None,
  *,
  sm_scale: float,
  block_tokens: int = DEFAULT_BLOCK_TOKENS,
  num_splits: int | None = 2,
  interpret: bool = False,
):
  """Per-split partials (out f32 [B,H,S,rows,D], lse f32 [B,H,S,rows]). Interpreted, the outputs
  are waited for before this returns (`_compat.finished_if_interpreted`). A length past the
  capacity counts as the capacity, as in the reference."""
  check_call(queries, keys, values, lengths, block_tokens=block_tokens, num_splits=num_splits)
  batch, kv_heads, group, head_dim = queries.shape
  tokens = keys.shape[2]
  # The index maps clamp blocks to the row's last valid one: past the capacity it would not
  # exist (an out-of-bounds block read).
  lengths = jnp.minimum(lengths.astype(jnp.int32), tokens)
  rows = tile_rows(group)
  transposed = tokens_on_lanes(head_dim)
  # A token block is a multiple of a lane tile when tokens are lanes, of a sublane tile when
  # they are rows; or the whole segment.
  unit = LANES if transposed else SUBLANES
  block_tokens = -(-block_tokens // unit) * unit
  block_tokens = tokens if tokens <= block_tokens else block_tokens
  plan = plan_splits(tokens, block_tokens, batch * kv_heads, num_splits, target_programs=1)
  scaled_queries = pad_query_group(queries.astype(jnp.float32) * sm_scale, rows, keys.dtype)
  if transposed:
    keys, values = jnp.swapaxes(keys, 2, 3), jnp.swapaxes(values, 2, 3)
    kv_block = (None, None, head_dim, block_tokens)
    kv_index = lambda b, h, s, i, lengths_ref: (
      b,
      h,
      0,
      clamped_block_index(b, s, i, lengths_ref, plan=plan),
    )
  else:
    kv_block = (None, None, block_tokens, head_dim)
    kv_index = lambda b, h, s, i, lengths_ref: (
      b,
      h,
      clamped_block_index(b, s, i, lengths_ref, plan=plan),
      0,
    )
  in_specs = [
    pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s, i, lengths_ref: (b, h, 0, 0)),
    pl.BlockSpec(kv_block, kv_index),
    pl.BlockSpec(kv_block, kv_index),
  ]
  out_specs = [
    pl.BlockSpec(
      (None, None, None, rows, head_dim), lambda b, h, s, i, lengths_ref: (b, h, s, 0, 0)
    ),
    pl.BlockSpec((None, None, None, rows, 1), lambda b, h, s, i, lengths_ref: (b, h, s, 0, 0)),
  ]
  out_shape = [
    jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows, head_dim), jnp.float32),
    jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows, 1), jnp.float32),
  ]
  args = [scaled_queries, keys, values]
  aliases = {}
  if initial_partials is not None:
    in_specs += out_specs
    # Operand numbering counts the scalar-prefetch operand first.
    aliases = {1 + len(args): 0, 2 + len(args): 1}
    args += [initial_partials[0], initial_partials[1][..., None]]
  grid_spec = _compat.prefetch_scalar_grid_spec(
    num_scalar_prefetch=1,
    grid=(batch, kv_heads, plan.num_splits, plan.blocks_per_split),
    in_specs=in_specs,
    out_specs=out_specs,
    scratch_shapes=[
      _compat.tpu_vmem_scratch((rows, 1), jnp.float32),
      _compat.tpu_vmem_scratch((rows, 1), jnp.float32),
      _compat.tpu_vmem_scratch((rows, head_dim), jnp.float32),
    ],
  )
  out, lse = pl.pallas_call(
    functools.partial(_decode_kernel, plan=plan, transposed=transposed),
    grid_spec=grid_spec,
    out_shape=out_shape,
    input_output_aliases=aliases,
    compiler_params=_compat.tpu_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
    interpret=_compat.tpu_interpret_params() if interpret else False,
    name="decode_attention_tpu",
  )(lengths, *args)
  return out, lse[..., 0]


def decode_attention_tpu(queries, keys, values, lengths, *, sm_scale: float, **config):
  """(out f32 [B,H,G,D], lse f32 [B,H,G]); same contract as `decode_attention_reference`."""
  out, lse = decode_attention_partials_tpu(
    queries, keys, values, lengths, sm_scale=sm_scale, **config
  )
  return merge_split_partials(out, lse, queries.shape[2])
