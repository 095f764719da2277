"""GPU decode attention over a quantized (KIVI) K/V segment: Pallas with the Mosaic GPU lowering.

The structure of `decode_attention_mosaic_gpu` (one warpgroup per row, KV head and split; a ring
of `num_stages` shared-memory slots filled by TMA, block i + stages - 1 requested while block i
is computed; both products on wgmma with the tokens on the M side; partials out^T
[B, H, S, D, rows] merged by log-sum-exp), with the bf16 K/V blocks replaced by what the cache
stores:

- the ring holds each block's packed code words (K and V, [block, D * bits / 32] uint32), its
  key statistics (k_scale, k_min: [block / group_size, D], or one row when a key group spans
  blocks) and its value statistics as one group-major box [2 * D / group_size, block] (scales,
  then minimums): a block is ~96 bytes per token at 2 bits, against 512 for bf16 K + V;
- each step dequantizes its K and V in registers, 64 tokens (one wgmma row tile) at a time: the
  code words are taken in the wgmma register layout, each bit field of the planar packing is
  shifted out, converted and scaled (a field holds `D * bits / 32` consecutive channels, so it
  meets one slice of each key-statistics row and one value group), and the fields, joined in
  channel order, are stored as bf16 (or f16) tiles in the 128-byte-swizzled layout the wgmma
  operands need; the two products then run exactly as in the full-precision kernel.

The cache keeps v_scale / v_min token-major ([B, H, T, D / group_size]: 8 bytes per token at D 128,
group 32), which a TMA copy cannot take (its minor box and every stride must be multiples of 16
bytes), and a [block] column of a token-major tile is a strided view that Mosaic GPU cannot load
into registers. So the wrapper joins and transposes them into [B, H, 2 * D / group_size, T] before
the kernel: one XLA pass over 16 bytes per token (at D 128, group 32) that a group-major cache
layout would remove.

Slots past a row's length may hold anything, NaN included: scores past it become -inf, and the
dequantized values past it are zeroed before they are staged. A block past the capacity arrives
zero-filled from the TMA unit. The capacity must be a multiple of 8 (the swizzled copy's tiles,
and the value-statistics rows' 16-byte strides). GEAR segments (low-rank and outlier terms) are
not taken: `unsupported_reason` says so and the GPU entry point runs the Triton kernel instead.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat
from pallas_kernels import decode_attention_mosaic_gpu as full_precision
from pallas_kernels.base_two_softmax import base_two_queries
from pallas_kernels.bit_packing import check_bits
from pallas_kernels.decode_attention_mosaic_gpu import (
  CAPACITY_MULTIPLE,
  LENGTH_WORDS,
  MAX_GROUP,
  SHARED_MEMORY_BYTES,
  initial_softmax_state,
  online_softmax_step,
  padded_lengths,
  split_bounds,
  swizzled_operand_transforms,
  tile_rows,
  value_product,
  write_partials,
)
from pallas_kernels.splits import (
  SplitPlan,
  gpu_target_programs,
  merge_split_partials,
  pad_query_group,
  plan_splits,
)

SUPPORTED_HEAD_DIMS = (64, 128)
BLOCK_TOKENS = (64, 128)  # wgmma M is 64; P^T's rows must fill a 128-byte swizzle
# Tokens dequantized together: one wgmma row tile. Code words are unpacked in the wgmma register
# layout ([64 k, 8 n] tiles), which also needs a multiple of 8 words per token.
CHUNK_TOKENS = 64
WORDS_MULTIPLE = 8


def staged_dtype_for(scale_dtype) -> jnp.dtype:
  """The staged K / V tiles' dtype: float16 for float16 statistics, bfloat16 otherwise (wgmma
  takes 16-bit operands; unlike the Triton kernels' `compute_dtype_for`, f32 statistics too)."""
  return jnp.dtype(jnp.float16 if jnp.dtype(scale_dtype) == jnp.float16 else jnp.bfloat16)


def key_groups_per_block(block_tokens: int, group_size: int) -> int:
  """Rows of key statistics a ring slot holds: the block's key groups, or the one spanning it."""
  return max(1, block_tokens // group_size)


def wgmma_layout(array):
  """`array` pinned to the wgmma register layout (left to Mosaic GPU's layout inference, the
  unpacking's layouts took over 10 minutes to search)."""
  return plgpu.layout_cast(array, plgpu.Layout.WGMMA)


def wgmma_row_vector(vector):
  """[n] -> f32 in the layout of a [n, m] wgmma array's per-row values."""
  return plgpu.layout_cast(vector.astype(jnp.float32), plgpu.Layout.WGMMA.reduce(1))


def unsupported_reason(
  queries,
  k_codes,
  k_scale,
  v_scale,
  *,
  bits,
  group_size,
  lowrank=None,
  outliers=None,
  words_multiple=WORDS_MULTIPLE,
  **_,
) -> str | None:
  """Why this kernel cannot take this segment (None if it can). Block-size constraints are
  checked per configuration by `check_config`. `words_multiple`: what the code words of a token
  must be a multiple of (this kernel's whole 8-word wgmma column groups; the per-warp products
  of the "warp" variant also take 4, one word a lane)."""
  del v_scale
  check_bits(bits)
  group, head_dim = queries.shape[2], queries.shape[3]
  if lowrank is not None or outliers is not None:
    return "GEAR's low-rank and outlier terms (KIVI segments only)"
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return f"head_dim={head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
  if group > MAX_GROUP:
    return f"query group {group} > {MAX_GROUP}"
  if k_codes.shape[2] % CAPACITY_MULTIPLE:
    return f"capacity {k_codes.shape[2]} (a multiple of {CAPACITY_MULTIPLE} is needed)"
  words = head_dim * bits // 32
  if group_size % words:
    return (
      f"group_size={group_size} with {words}-channel bit fields (a value group must hold whole "
      "fields)"
    )
  if words % words_multiple:
    return (
      f"{words} code words per token (head_dim * bits / 32 must be a multiple of {words_multiple})"
    )
  if jnp.dtype(k_scale.dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
    return f"statistics dtype {k_scale.dtype} (supported: bfloat16, float16, float32)"
  return None


def shared_memory_bytes(
  rows, head_dim, bits, group_size, block_tokens, num_stages, stat_itemsize, compute_itemsize
):
  """Bytes of shared memory one program allocates."""
  words = head_dim * bits // 32
  key_groups = key_groups_per_block(block_tokens, group_size)
  value_groups = head_dim // group_size
  slot = (
    2 * block_tokens * words * 4
    + 2 * key_groups * head_dim * stat_itemsize
    + 2 * value_groups * block_tokens * stat_itemsize
  )
  staged = 2 * block_tokens * head_dim * compute_itemsize  # dequantized K and V tiles
  operands = (rows * head_dim + rows * block_tokens) * compute_itemsize  # Q, P
  results = (head_dim * rows + rows) * 4 + LENGTH_WORDS * 4
  return num_stages * slot + staged + operands + results


def check_settings(*, block_tokens=None, num_splits=None, num_stages=None) -> None:
  """ValueError naming a setting outside its allowed values (None: the default); the checks
  that need no shapes."""
  full_precision.check_settings(
    block_tokens=block_tokens,
    num_stages=num_stages,
    num_splits=num_splits,
    block_choices=BLOCK_TOKENS,
  )


def check_config(
  rows,
  head_dim,
  bits,
  group_size,
  stat_itemsize,
  compute_itemsize,
  *,
  block_tokens,
  num_stages,
  num_splits,
):
  """ValueError naming the setting and its allowed values; raised before anything is traced."""
  check_settings(block_tokens=block_tokens, num_splits=num_splits, num_stages=num_stages)
  needed = shared_memory_bytes(
    rows, head_dim, bits, group_size, block_tokens, num_stages, stat_itemsize, compute_itemsize
  )
  if needed > SHARED_MEMORY_BYTES:
    raise ValueError(
      f"block_tokens={block_tokens} with num_stages={num_stages} needs {needed} bytes of shared "
      f"memory; at most {SHARED_MEMORY_BYTES} fit: lower either"
    )


def group_major_value_stats(v_scale: jax.Array, v_min: jax.Array) -> jax.Array:
  """[B, H, T, D/g] scale and minimum -> [B, H, 2 * D/g, T] (scales, then minimums)."""
  return jnp.swapaxes(jnp.concatenate([v_scale, v_min], axis=-1), 2, 3)


def _key_statistic(stats_smem, field, *, slot, chunk, token, group_size):
  """[64, W] f32: a key statistic (k_scale or k_min, [stages, key_groups, D] in shared memory)
  of field `field`'s channels for every token of 64-token chunk `chunk` of the block."""
  words = token.shape[1]
  key_groups = stats_smem.shape[1]
  first_group = chunk * CHUNK_TOKENS // group_size % key_groups
  stat = None
  for j in range(max(1, CHUNK_TOKENS // group_size)):  # the key groups the chunk meets
    vector = stats_smem[slot, first_group + j, pl.ds(field * words, words)].astype(jnp.float32)
    tile = lax.broadcast_in_dim(
      plgpu.layout_cast(vector, plgpu.Layout.WGMMA.reduce(0)), token.shape, [1]
    )
    stat = tile if stat is None else jnp.where(token >= j * group_size, tile, stat)
  return stat


def _value_statistic(stats_smem, offset, field, *, slot, chunk, words, group_size):
  """[64, W] f32: a value statistic (row `offset` + group of the group-major
  [stages, 2 * value_groups, block] tile: offset 0 the scales, value_groups the minimums) of
  field `field`'s value group, per token of 64-token chunk `chunk`."""
  group = field * words // group_size
  vector = stats_smem[slot, offset + group, pl.ds(chunk * CHUNK_TOKENS, CHUNK_TOKENS)]
  return lax.broadcast_in_dim(wgmma_row_vector(vector), (CHUNK_TOKENS, words), [0])


def _dequantize_chunk(words, bits, scale_of_field, minimum_of_field, dtype, valid=None):
  """[chunk, W] code words -> [chunk, D] dequantized, channel order (field f holds channels
  [f W, (f + 1) W)); `scale_of_field(f)` / `minimum_of_field(f)` broadcast to [chunk, W]."""
  mask = (1 << bits) - 1
  fields = []
  for field in range(32 // bits):
    codes = (lax.shift_right_logical(words, jnp.uint32(bits * field)) & jnp.uint32(mask)).astype(
      jnp.int32
    )
    value = codes.astype(jnp.float32) * scale_of_field(field) + minimum_of_field(field)
    if valid is not None:
      value = jnp.where(valid, value, 0.0)
    fields.append(value.astype(dtype))
  return jnp.concatenate(fields, axis=1)


def fetch_block(
  sources,
  destinations,
  barriers,
  i,
  *,
  row,
  head,
  start,
  block,
  group_size,
  num_stages,
  group_streams=2,
  issue=None,
):
  """Starts the TMA copies of block i of this program's split into ring slot i % num_stages:
  `sources` (k codes, `group_streams` arrays per key group: k_scale, and k_min or the folded
  kernel's key bias unless that kernel computes the bias itself; v codes, then one or more
  arrays of group-major value statistics in global memory), their ring `destinations` and one
  barrier array per stream. `issue(stream, start_copy)`, if given, decides who starts stream
  `stream`'s copy (e.g. one warp per stream); by default the caller's threads do."""
  slot = lax.rem(i, num_stages)
  first = start + i * block
  groups = destinations[1].shape[1]  # key groups per block
  token_box = pl.ds(first, block)
  group_box = pl.ds(first // group_size, groups)
  statistics = destinations[2 + group_streams :]
  boxes = (
    (row, head, token_box),
    *[(row, head, group_box)] * group_streams,
    (row, head, token_box),
    *[(row, head, slice(None), token_box)] * len(statistics),
  )
  # Rows each stream's box copies per block. A ring slot may hold more (the folded kernel pads
  # its key-bias slots to 128 bytes for TMA): the copy fills the slot's first rows.
  box_rows = (block, *[groups] * group_streams, block, *[ring.shape[1] for ring in statistics])
  streams = zip(sources, destinations, boxes, box_rows, barriers, strict=True)
  for stream, (source, destination, box, rows, barrier) in enumerate(streams):
    padded = destination.shape[1] > rows
    view = destination.at[slot, pl.ds(0, rows)] if padded else destination.at[slot]
    start_copy = functools.partial(plgpu.copy_gmem_to_smem, source.at[box], view, barrier.at[slot])
    if issue is None:
      start_copy()
    else:
      issue(stream, start_copy)


def _quantized_decode_kernel(
  lengths_gmem,  # int32 [>= B] (padded to LENGTH_WORDS)
  queries_gmem,  # [B, H, rows, D], pre-scaled by sm_scale log2(e), compute dtype
  k_codes_gmem,  # uint32 [B, H, T, W]
  k_scale_gmem,  # [B, H, T / group_size, D]
  k_min_gmem,
  v_codes_gmem,  # uint32 [B, H, T, W]
  v_stats_gmem,  # [B, H, 2 * D / group_size, T]: value scales, then minimums
  out_gmem,  # f32 [B, H, S, D, rows]
  lse_gmem,  # f32 [B, H, S, rows]
  lengths_smem,
  queries_smem,  # [rows, D]
  k_words_smem,  # [stages, block, W]
  k_scale_smem,  # [stages, key_groups, D]
  k_min_smem,
  v_words_smem,  # [stages, block, W]
  v_stats_smem,  # [stages, 2 * value_groups, block]
  keys_smem,  # [block, D]: this step's dequantized keys
  values_smem,  # [block, D]
  probs_smem,  # [rows, block]
  out_smem,  # f32 [D, rows]
  lse_smem,  # f32 [rows]
  barriers,
  *,
  plan: SplitPlan,
  tokens: int,
  num_stages: int,
  bits: int,
  group_size: int,
):
  row, head, split = lax.axis_index("row"), lax.axis_index("head"), lax.axis_index("split")
  lengths_barrier, queries_barrier, stream_barriers = barriers
  block = plan.block_tokens
  rows, head_dim = queries_smem.shape
  words = k_words_smem.shape[2]
  value_groups = v_stats_smem.shape[1] // 2
  dtype = keys_smem.dtype

  plgpu.copy_gmem_to_smem(lengths_gmem, lengths_smem, lengths_barrier)
  plgpu.copy_gmem_to_smem(queries_gmem.at[row, head], queries_smem, queries_barrier)
  plgpu.barrier_wait(lengths_barrier)
  start, end, num_blocks = split_bounds(lengths_smem, row, split, plan, tokens)

  fetch = functools.partial(
    fetch_block,
    (k_codes_gmem, k_scale_gmem, k_min_gmem, v_codes_gmem, v_stats_gmem),
    (k_words_smem, k_scale_smem, k_min_smem, v_words_smem, v_stats_smem),
    stream_barriers,
    row=row,
    head=head,
    start=start,
    block=block,
    group_size=group_size,
    num_stages=num_stages,
  )

  for i in range(num_stages - 1):
    pl.when(i < num_blocks)(functools.partial(fetch, i))
  plgpu.barrier_wait(queries_barrier)

  def body(i, state):  # state: acc^T [D, rows], running max [rows], running sum [rows]
    slot = lax.rem(i, num_stages)
    # Slot of block i - 1, whose products completed in the previous step.
    pl.when(i + num_stages - 1 < num_blocks)(functools.partial(fetch, i + num_stages - 1))
    first = start + i * block
    for barrier in stream_barriers:
      plgpu.barrier_wait(barrier.at[slot])

    for c in range(block // CHUNK_TOKENS):
      chunk_rows = pl.ds(c * CHUNK_TOKENS, CHUNK_TOKENS)
      token = plgpu.broadcasted_iota(jnp.int32, (CHUNK_TOKENS, words), 0, layout=plgpu.Layout.WGMMA)
      key_stat = functools.partial(
        _key_statistic, slot=slot, chunk=c, token=token, group_size=group_size
      )
      keys_smem[chunk_rows, :] = _dequantize_chunk(
        wgmma_layout(k_words_smem[slot, chunk_rows, :]),
        bits,
        functools.partial(key_stat, k_scale_smem),
        functools.partial(key_stat, k_min_smem),
        dtype,
      )
      value_stat = functools.partial(
        _value_statistic, v_stats_smem, slot=slot, chunk=c, words=words, group_size=group_size
      )
      values_smem[chunk_rows, :] = _dequantize_chunk(
        wgmma_layout(v_words_smem[slot, chunk_rows, :]),
        bits,
        functools.partial(value_stat, 0),
        functools.partial(value_stat, value_groups),
        dtype,
        valid=token + (first + c * CHUNK_TOKENS) < end,
      )
    plgpu.commit_smem()  # the staged K and V visible to the tensor core

    def scores_product(acc_ref):
      plgpu.wgmma(acc_ref, keys_smem, queries_smem.T)
      return acc_ref[...]

    scores = pl.run_scoped(scores_product, plgpu.ACC((block, rows), jnp.float32))
    token = plgpu.broadcasted_iota(jnp.int32, (block, rows), 0, layout=plgpu.Layout.WGMMA)
    acc, running_max, running_sum = online_softmax_step(
      scores, token + first < end, state, probs_smem
    )
    plgpu.commit_smem()  # P visible to the tensor core
    return value_product(values_smem, probs_smem, acc), running_max, running_sum

  state = lax.fori_loop(0, num_blocks, body, initial_softmax_state(rows, head_dim))
  write_partials(
    state, out_smem, lse_smem, out_gmem.at[row, head, split], lse_gmem.at[row, head, split]
  )


@functools.partial(
  jax.jit,
  static_argnames=(
    "bits",
    "group_size",
    "sm_scale",
    "block_tokens",
    "num_splits",
    "num_stages",
    "interpret",
  ),
)
def _quantized_decode_attention_partials(
  queries,
  k_codes,
  k_scale,
  k_min,
  v_codes,
  v_scale,
  v_min,
  lengths,
  *,
  bits,
  group_size,
  sm_scale,
  block_tokens,
  num_splits,
  num_stages,
  interpret,
):
  batch, kv_heads, group, head_dim = queries.shape
  tokens, words = k_codes.shape[2], k_codes.shape[3]
  rows = tile_rows(group)
  dtype = staged_dtype_for(k_scale.dtype)
  stat_dtype = k_scale.dtype
  plan = plan_splits(tokens, block_tokens, batch * kv_heads, num_splits, gpu_target_programs())
  scaled_queries = pad_query_group(base_two_queries(queries, sm_scale), rows, dtype)
  v_stats = group_major_value_stats(v_scale, v_min)
  lengths = padded_lengths(lengths)
  key_groups = key_groups_per_block(block_tokens, group_size)
  value_groups = head_dim // group_size
  operand = functools.partial(swizzled_operand_transforms, dtype=dtype)
  kernel = plgpu.kernel(
    functools.partial(
      _quantized_decode_kernel,
      plan=plan,
      tokens=tokens,
      num_stages=num_stages,
      bits=bits,
      group_size=group_size,
    ),
    out_type=(
      jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, head_dim, rows), jnp.float32),
      jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows), jnp.float32),
    ),
    grid=(batch, kv_heads, plan.num_splits),
    grid_names=("row", "head", "split"),
    scratch_types=dict(
      lengths_smem=plgpu.SMEM(lengths.shape, jnp.int32),
      queries_smem=plgpu.SMEM((rows, head_dim), dtype, transforms=operand(head_dim)),
      k_words_smem=plgpu.SMEM((num_stages, block_tokens, words), jnp.uint32),
      k_scale_smem=plgpu.SMEM((num_stages, key_groups, head_dim), stat_dtype),
      k_min_smem=plgpu.SMEM((num_stages, key_groups, head_dim), stat_dtype),
      v_words_smem=plgpu.SMEM((num_stages, block_tokens, words), jnp.uint32),
      v_stats_smem=plgpu.SMEM((num_stages, 2 * value_groups, block_tokens), stat_dtype),
      keys_smem=plgpu.SMEM((block_tokens, head_dim), dtype, transforms=operand(head_dim)),
      values_smem=plgpu.SMEM((block_tokens, head_dim), dtype, transforms=operand(head_dim)),
      probs_smem=plgpu.SMEM((rows, block_tokens), dtype, transforms=operand(block_tokens)),
      out_smem=plgpu.SMEM((head_dim, rows), jnp.float32),
      lse_smem=plgpu.SMEM((rows,), jnp.float32),
      barriers=(
        plgpu.Barrier(),
        plgpu.Barrier(),
        tuple(plgpu.Barrier(num_barriers=num_stages) for _ in range(5)),
      ),
    ),
    compiler_params=_compat.mosaic_gpu_compiler_params(),
    interpret=_compat.mosaic_gpu_interpret_params() if interpret else None,
  )
  return kernel(lengths, scaled_queries, k_codes, k_scale, k_min, v_codes, v_stats)


def quantized_decode_attention_partials_mosaic_gpu(
  queries: jax.Array,  # [B, H, G, D]
  k_codes: jax.Array,  # uint32 [B, H, T, D * bits / 32]
  k_scale: jax.Array,  # [B, H, T / group_size, D]
  k_min: jax.Array,
  v_codes: jax.Array,  # uint32 [B, H, T, D * bits / 32]
  v_scale: jax.Array,  # [B, H, T, D / group_size]
  v_min: jax.Array,
  lengths: jax.Array,  # int32 [B]
  *,
  bits: int,
  group_size: int,
  sm_scale: float,
  block_tokens: int = 64,
  num_splits: int | None = None,
  num_stages: int = 3,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Per-split partials (out^T f32 [B,H,S,D,rows], lse f32 [B,H,S,rows]). Settings and shapes
  are checked (ValueError) before anything is traced."""
  reason = unsupported_reason(queries, k_codes, k_scale, v_scale, bits=bits, group_size=group_size)
  if reason is not None:
    raise ValueError(f"the Mosaic GPU quantized decode-attention kernel does not support {reason}")
  check_config(
    tile_rows(queries.shape[2]),
    queries.shape[3],
    bits,
    group_size,
    jnp.dtype(k_scale.dtype).itemsize,
    staged_dtype_for(k_scale.dtype).itemsize,
    block_tokens=block_tokens,
    num_stages=num_stages,
    num_splits=num_splits,
  )
  outputs = _quantized_decode_attention_partials(
    queries,
    k_codes,
    k_scale,
    k_min,
    v_codes,
    v_scale,
    v_min,
    lengths,
    bits=bits,
    group_size=group_size,
    sm_scale=sm_scale,
    block_tokens=block_tokens,
    num_splits=num_splits,
    num_stages=num_stages,
    interpret=interpret,
  )
  return _compat.finished_if_interpreted(outputs, interpret)


def quantized_decode_attention_mosaic_gpu(*arrays, **settings):
  """(out f32 [B,H,G,D], lse f32 [B,H,G]); same contract as the jnp reference (KIVI segments)."""
  out, lse = quantized_decode_attention_partials_mosaic_gpu(*arrays, **settings)
  return merge_split_partials(out, lse, arrays[0].shape[2], head_dim_last=False)
