"""GPU decode attention over a full-precision K/V segment: Pallas with the Mosaic GPU lowering.

The same contract and flash-decoding structure as `decode_attention_triton` (one query position
per row, a KV head's query group as one tile, the sequence split across programs, per-row
lengths, partials merged by log-sum-exp), written for Hopper's asynchronous units, which the
Triton lowering leaves to its compiler:

- K and V blocks arrive by TMA into a ring of `num_stages` shared-memory slots; block i + stages
  - 1 is requested while block i is computed. A program asks for no block past its row's length.
- Both products run on the warpgroup tensor core (wgmma) with the tokens on the M side, so the
  query group only pads N (to 8 or a power of two) instead of M (64): scores^T [block, rows] =
  K . Q^T, then out^T [D, rows] += V^T . P^T, P being stored to shared memory transposed so that
  both of its operands share one 128-byte swizzle.
- The capacity need not be a multiple of the block (the TMA unit fills a box's rows past it with
  zeros), but it must be a multiple of 8: Mosaic GPU tiles the cache in 8-row tiles for the
  swizzled copy. Other capacities are refused (`unsupported_reason`; the dispatch then falls
  back to the jnp reference with a warning).
- Slots past a row's length may hold anything, NaN included: masked scores become -inf, and a
  block that holds such slots has their values zeroed in shared memory before the value product
  (0 x NaN would otherwise poison the sum).

The partial outputs come back as out^T [B, H, S, D, rows] (the accumulator's layout), merged by
`merge_split_partials(..., head_dim_last=False)` without a transpose.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat
from pallas_kernels.base_two_softmax import natural_log_sum_exp
from pallas_kernels.launch_settings import check_launch_settings
from pallas_kernels.splits import (
  SplitPlan,
  merge_split_partials,
  next_power_of_two,
  plan_full_precision_decode,
)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma's 16-bit operands
BLOCK_TOKENS = (64, 128, 256)  # wgmma M is 64; P^T's rows must fill a 128-byte swizzle
NUM_STAGES = (2, 3, 4)
MAX_GROUP = 64
MIN_ROWS = 8  # wgmma N is a multiple of 8
# Hopper's shared memory per block (227 KiB of the SM's 228 KiB can go to one block).
SHARED_MEMORY_BYTES = 227 * 1024
LENGTH_WORDS = 4  # a TMA copy moves at least 16 bytes: lengths are padded to 4 int32
# The TMA copy into the swizzled operand tiles sees the cache as 8-row tiles, so the capacity
# must be a whole number of them (Mosaic GPU refuses a partial last tile).
CAPACITY_MULTIPLE = 8


def tile_rows(group: int) -> int:
  """The wgmma N side: the query group padded to a power of two, at least 8."""
  return max(MIN_ROWS, next_power_of_two(group))


def unsupported_reason(queries, keys) -> str | None:
  """Why this kernel cannot take these shapes (None if it can)."""
  group, head_dim = queries.shape[2], queries.shape[3]
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return f"head_dim={head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
  if group > MAX_GROUP:
    return f"query group {group} > {MAX_GROUP}"
  if keys.dtype not in SUPPORTED_DTYPES:
    return f"cache dtype {keys.dtype} (supported: bfloat16, float16)"
  if keys.shape[2] % CAPACITY_MULTIPLE:
    return f"capacity {keys.shape[2]} (a multiple of {CAPACITY_MULTIPLE} is needed)"
  return None


def shared_memory_bytes(rows: int, head_dim: int, block_tokens: int, num_stages: int, itemsize):
  """Bytes of shared memory one program allocates (the K/V ring dominates)."""
  ring = 2 * num_stages * block_tokens * head_dim * itemsize
  operands = (rows * head_dim + rows * block_tokens) * itemsize  # Q, P
  results = (head_dim * rows + rows) * 4 + LENGTH_WORDS * 4  # out^T, lse (f32); lengths
  return ring + operands + results


def check_settings(*, block_tokens, num_stages, num_splits, block_choices=BLOCK_TOKENS) -> None:
  """ValueError naming a setting outside its allowed values (None: the default); the checks of
  the Mosaic GPU kernels' settings that need no shapes."""
  if block_tokens is not None and block_tokens not in block_choices:
    raise ValueError(f"block_tokens={block_tokens!r} is not supported; allowed: {block_choices}")
  if num_stages is not None and num_stages not in NUM_STAGES:
    raise ValueError(f"num_stages={num_stages!r} is not supported; allowed: {NUM_STAGES}")
  check_launch_settings({"num_splits": num_splits})


def check_config(rows, head_dim, itemsize, *, block_tokens, num_stages, num_splits):
  """ValueError naming the setting and its allowed values; raised before anything is traced."""
  check_settings(block_tokens=block_tokens, num_stages=num_stages, num_splits=num_splits)
  needed = shared_memory_bytes(rows, head_dim, block_tokens, num_stages, itemsize)
  if needed > SHARED_MEMORY_BYTES:
    raise ValueError(
      f"block_tokens={block_tokens} with num_stages={num_stages} needs {needed} bytes of shared "
      f"memory at head_dim={head_dim}; at most {SHARED_MEMORY_BYTES} fit: lower either"
    )


def swizzled_operand_transforms(width: int, dtype):
  """Shared-memory tiling and swizzle of a [rows, width] wgmma operand."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(width * bits, "decode attention operand")
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def padded_lengths(lengths: jax.Array) -> jax.Array:
  """int32 lengths padded with zeros to a multiple of LENGTH_WORDS (one TMA copy's minimum)."""
  batch = lengths.shape[0]
  padded = jnp.zeros((-(-batch // LENGTH_WORDS) * LENGTH_WORDS,), jnp.int32)
  return padded.at[:batch].set(lengths.astype(jnp.int32))


def split_bounds(lengths_smem, row, split, plan: SplitPlan, tokens: int):
  """(start, end, number of blocks) of this program's split: its tokens [start, end) are the
  split's range cut at the row's length and the capacity."""
  start = split * plan.split_tokens
  end = jnp.minimum(jnp.minimum(start + plan.split_tokens, lengths_smem[row]), tokens)
  num_blocks = (jnp.maximum(end - start, 0) + plan.block_tokens - 1) // plan.block_tokens
  return start, end, num_blocks


def initial_softmax_state(rows: int, head_dim: int):
  """(acc^T [D, rows] zeros, running max [rows] -inf, running sum [rows] zeros) in the wgmma
  accumulator's layouts: the carry of `online_softmax_step`."""
  running_max = plgpu.layout_cast(
    jnp.full((rows,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(0)
  )
  running_sum = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(0))
  acc = plgpu.layout_cast(jnp.zeros((head_dim, rows), jnp.float32), plgpu.Layout.WGMMA)
  return acc, running_max, running_sum


def softmax_step_numerators(scores, valid, running_max, max_over_tokens=None):
  """One block of the online softmax over base-2 scores^T [block, rows] (`base_two_softmax`),
  masked where not `valid`, without the sum over tokens: (new_max, correction, probs) [rows],
  [rows], [block, rows]. The caller rescales what it carries by `correction`.
  `max_over_tokens`: the max over axis 0 (default jnp's; a kernel of several warpgroups a program
  passes `warpgroup_reductions.reduce_rows`)."""
  scores = jnp.where(valid, scores, -jnp.inf)
  # A split's first block holds a valid token, so the max is finite from then on.
  block_max = scores.max(axis=0) if max_over_tokens is None else max_over_tokens(scores)
  new_max = jnp.maximum(running_max, block_max)
  correction = jnp.exp2(running_max - new_max)
  probs = jnp.exp2(scores - lax.broadcast_in_dim(new_max, scores.shape, [1]))
  return new_max, correction, probs


def online_softmax_step(scores, valid, state, probs_smem):
  """`softmax_step_numerators`, then the denominator; rescales the state's accumulator to the
  new running max and stores P^T to `probs_smem` (transposed, [rows, block], not yet committed).
  Returns the updated state."""
  acc, running_max, running_sum = state
  new_max, correction, probs = softmax_step_numerators(scores, valid, running_max)
  running_sum = running_sum * correction + probs.sum(axis=0)
  acc = acc * lax.broadcast_in_dim(correction, acc.shape, [1])
  probs_smem.T[...] = probs.astype(probs_smem.dtype)
  return acc, new_max, running_sum


def value_product(values_tile, probs_smem, acc):
  """acc + V^T . P^T on wgmma (V [block, D] and P [rows, block] in shared memory, committed)."""

  def product(acc_ref):
    plgpu.wgmma(acc_ref, values_tile.T, probs_smem.T)
    return acc_ref[...]

  return acc + pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))


def normalised_partials(state) -> tuple[jax.Array, jax.Array]:
  """(out^T [D, rows] / each row's sum, lse [rows] in natural units) from the base-2 state
  (acc, running max, running sum). A split with no valid token gives out 0 and lse -inf (it
  drops out of the merge); a NaN sum is not empty, its NaN reaches out and lse."""
  acc, running_max, running_sum = state
  nonempty = running_sum != 0
  safe_sum = jnp.where(nonempty, running_sum, 1.0)
  out = acc / lax.broadcast_in_dim(safe_sum, acc.shape, [1])
  return out, jnp.where(nonempty, natural_log_sum_exp(running_max, safe_sum), -jnp.inf)


def send_partials(out_smem, lse_smem, out_gmem, lse_gmem):
  """The split's partials, stored to `out_smem` / `lse_smem` by every thread, copied to
  `out_gmem` / `lse_gmem` (the program's slices) once the stores are visible."""
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, out_gmem)
  plgpu.copy_smem_to_gmem(lse_smem, lse_gmem)
  plgpu.wait_smem_to_gmem(0)


def write_partials(state, out_smem, lse_smem, out_gmem, lse_gmem):
  """The split's normalised out^T and lse (`normalised_partials`), through shared memory to
  `out_gmem` / `lse_gmem` (the program's slices)."""
  out, lse = normalised_partials(state)
  out_smem[...] = out
  lse_smem[...] = lse
  send_partials(out_smem, lse_smem, out_gmem, lse_gmem)


def _decode_kernel(
  lengths_gmem,  # int32 [>= B] (padded to LENGTH_WORDS)
  queries_gmem,  # [B, H, rows, D], pre-scaled by sm_scale log2(e), cache dtype
  keys_gmem,  # [B, H, T, D]
  values_gmem,  # [B, H, T, D]
  out_gmem,  # f32 [B, H, S, D, rows]: each split's normalised output, transposed
  lse_gmem,  # f32 [B, H, S, rows]
  lengths_smem,
  queries_smem,  # [rows, D]
  keys_smem,  # [stages, block, D]
  values_smem,  # [stages, block, D]
  probs_smem,  # [rows, block]: P, so that P^T is a transposed view like Q^T
  out_smem,  # f32 [D, rows]
  lse_smem,  # f32 [rows]
  barriers,
  *,
  plan: SplitPlan,
  tokens: int,
  num_stages: int,
):
  row, head, split = lax.axis_index("row"), lax.axis_index("head"), lax.axis_index("split")
  lengths_barrier, queries_barrier, keys_barriers, values_barriers = barriers
  block = plan.block_tokens
  rows, head_dim = queries_smem.shape
  dtype = keys_smem.dtype

  plgpu.copy_gmem_to_smem(lengths_gmem, lengths_smem, lengths_barrier)
  plgpu.copy_gmem_to_smem(queries_gmem.at[row, head], queries_smem, queries_barrier)
  plgpu.barrier_wait(lengths_barrier)
  start, end, num_blocks = split_bounds(lengths_smem, row, split, plan, tokens)

  def fetch(i):
    slot = lax.rem(i, num_stages)
    # A box that runs past the capacity is cut by the TMA unit: the rows past it arrive as 0.
    source = (row, head, pl.ds(start + i * block, block))
    plgpu.copy_gmem_to_smem(keys_gmem.at[source], keys_smem.at[slot], keys_barriers.at[slot])
    plgpu.copy_gmem_to_smem(values_gmem.at[source], values_smem.at[slot], values_barriers.at[slot])

  for i in range(num_stages - 1):
    pl.when(i < num_blocks)(functools.partial(fetch, i))
  plgpu.barrier_wait(queries_barrier)

  def body(i, state):
    slot = lax.rem(i, num_stages)
    # Slot of block i - 1, whose products completed in the previous step.
    pl.when(i + num_stages - 1 < num_blocks)(functools.partial(fetch, i + num_stages - 1))
    first = start + i * block

    plgpu.barrier_wait(keys_barriers.at[slot])

    def scores_product(acc_ref):
      plgpu.wgmma(acc_ref, keys_smem.at[slot], queries_smem.T)
      return acc_ref[...]

    scores = pl.run_scoped(scores_product, plgpu.ACC((block, rows), jnp.float32))
    token = plgpu.broadcasted_iota(jnp.int32, (block, rows), 0, layout=plgpu.Layout.WGMMA)
    acc, running_max, running_sum = online_softmax_step(
      scores, token + first < end, state, probs_smem
    )

    plgpu.barrier_wait(values_barriers.at[slot])

    @pl.when(first + block > end)
    def _zero_values_past_end():
      token_rows = plgpu.broadcasted_iota(
        jnp.int32, (block, head_dim), 0, layout=plgpu.Layout.WGMMA
      )
      before_end = token_rows + first < end
      values_smem[slot] = jnp.where(before_end, values_smem[slot], jnp.zeros((), dtype))

    plgpu.commit_smem()  # P (and zeroed values) visible to the tensor core
    return value_product(values_smem.at[slot], probs_smem, acc), running_max, running_sum

  state = lax.fori_loop(0, num_blocks, body, initial_softmax_state(rows, head_dim))
  write_partials(
    state, out_smem, lse_smem, out_gmem.at[row, head, split], lse_gmem.at[row, head, split]
  )


@functools.partial(
  jax.jit,
  static_argnames=("sm_scale", "block_tokens", "num_splits", "num_stages", "interpret"),
)
def _decode_attention_partials(
  queries, keys, values, lengths, *, sm_scale, block_tokens, num_splits, num_stages, interpret
):
  batch, kv_heads, group, head_dim = queries.shape
  tokens = keys.shape[2]
  rows = tile_rows(group)
  plan, scaled_queries = plan_full_precision_decode(
    queries,
    keys,
    rows=rows,
    sm_scale=sm_scale,
    block_tokens=block_tokens,
    num_splits=num_splits,
  )
  lengths = padded_lengths(lengths)
  dtype = keys.dtype
  operand = functools.partial(swizzled_operand_transforms, dtype=dtype)
  kernel = plgpu.kernel(
    functools.partial(_decode_kernel, plan=plan, tokens=tokens, num_stages=num_stages),
    out_type=(
      jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, head_dim, rows), jnp.float32),
      jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows), jnp.float32),
    ),
    grid=(batch, kv_heads, plan.num_splits),
    grid_names=("row", "head", "split"),
    scratch_types=dict(
      lengths_smem=plgpu.SMEM(lengths.shape, jnp.int32),
      queries_smem=plgpu.SMEM((rows, head_dim), dtype, transforms=operand(head_dim)),
      keys_smem=plgpu.SMEM(
        (num_stages, block_tokens, head_dim), dtype, transforms=operand(head_dim)
      ),
      values_smem=plgpu.SMEM(
        (num_stages, block_tokens, head_dim), dtype, transforms=operand(head_dim)
      ),
      probs_smem=plgpu.SMEM((rows, block_tokens), dtype, transforms=operand(block_tokens)),
      out_smem=plgpu.SMEM((head_dim, rows), jnp.float32),
      lse_smem=plgpu.SMEM((rows,), jnp.float32),
      barriers=(
        plgpu.Barrier(),
        plgpu.Barrier(),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
      ),
    ),
    compiler_params=_compat.mosaic_gpu_compiler_params(),
    interpret=_compat.mosaic_gpu_interpret_params() if interpret else None,
  )
  return kernel(lengths, scaled_queries, keys, values)


def decode_attention_partials_mosaic_gpu(
  queries: jax.Array,  # [B, H, G, D]
  keys: jax.Array,  # [B, H, T, D], bf16 or f16
  values: jax.Array,  # [B, H, T, D]
  lengths: jax.Array,  # int32 [B]
  *,
  sm_scale: float,
  block_tokens: int = 64,
  num_splits: int | None = None,
  num_stages: int = 2,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Per-split partials (out^T f32 [B,H,S,D,rows], lse f32 [B,H,S,rows]). Settings and shapes
  are checked (ValueError) before anything is traced."""
  rows, head_dim = tile_rows(queries.shape[2]), queries.shape[3]
  check_config(
    rows,
    head_dim,
    jnp.dtype(keys.dtype).itemsize,
    block_tokens=block_tokens,
    num_stages=num_stages,
    num_splits=num_splits,
  )
  reason = unsupported_reason(queries, keys)
  if reason is not None:
    raise ValueError(f"the Mosaic GPU decode-attention kernel does not support {reason}")
  outputs = _decode_attention_partials(
    queries,
    keys,
    values,
    lengths,
    sm_scale=sm_scale,
    block_tokens=block_tokens,
    num_splits=num_splits,
    num_stages=num_stages,
    interpret=interpret,
  )
  return _compat.finished_if_interpreted(outputs, interpret)


def decode_attention_mosaic_gpu(queries, keys, values, lengths, *, sm_scale: float, **config):
  """(out f32 [B,H,G,D], lse f32 [B,H,G]); same contract as `decode_attention_reference`."""
  out, lse = decode_attention_partials_mosaic_gpu(
    queries, keys, values, lengths, sm_scale=sm_scale, **config
  )
  return merge_split_partials(out, lse, queries.shape[2], head_dim_last=False)
