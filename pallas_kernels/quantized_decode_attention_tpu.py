"""TPU fused dequantize-attention for decoding over a KIVI / GEAR quantized segment (Mosaic).

Same grid as `decode_attention_tpu`: (batch, kv_heads, splits, blocks), lengths
scalar-prefetched, index maps clamped to the row's last valid block (no DMA past the length),
compute skipped there with `pl.when`, online softmax in VMEM scratch.

Dequantization works on the planar bit fields directly (no lane concatenation, which
Mosaic handles poorly): field k of the packed words holds channels [k*W, (k+1)*W), so

  scores   = sum_k q[:, kW:(k+1)W] . (field_k * k_scale_k + k_min_k)^T
  out_k    = p . (field_k * v_scale[:, group(k)] + v_min[:, group(k)])  (acc scratch [n, rows, W])

with the query pre-split as [n, rows, W] and the key statistics viewed (free reshape) as
[T/G, n, W]. Output slices are re-joined to [rows, D] outside the kernel (a tiny array).
GEAR terms are fused per GEAR block (`block_tokens == block`): low rank with small dots, outliers
with one-hot dots (token one-hot [block, s], channel one-hot per field [W, s]).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.bit_packing import check_bits
from pallas_kernels.decode_attention_tpu import clamped_block_index, tile_rows
from pallas_kernels.quantized_decode_attention_reference import check_quantized_inputs
from pallas_kernels.splits import SplitPlan, merge_split_partials, plan_splits


def unsupported_reason(
  queries, k_codes, k_scale, v_scale, *, bits, group_size, lowrank, outliers, block
) -> str | None:
  head_dim = queries.shape[3]
  if head_dim % 64 != 0:
    return f"head_dim={head_dim} (must be a multiple of 64)"
  words = head_dim * bits // 32
  if group_size % words != 0 and words % group_size != 0:
    return f"group_size={group_size} with {words}-channel bit fields"
  if (lowrank is not None or outliers is not None) and block % 8 != 0:
    return f"GEAR block={block} (must be a multiple of 8)"
  if head_dim & (head_dim - 1):
    return f"head_dim={head_dim} (outlier indices need a power of two)"
  if k_scale.dtype not in (jnp.float32, jnp.bfloat16):
    return f"scale dtype {k_scale.dtype}"
  return None


def _repeat_rows(stats, repeat):  # [n, C] -> [n * repeat, C]
  if repeat == 1:
    return stats
  n, width = stats.shape
  return jnp.broadcast_to(stats[:, None, :], (n, repeat, width)).reshape(n * repeat, width)


def _field_value_stats(stats, field, width, value_group):
  """Per-token value statistics [T, D/G] -> the [T, W] columns of bit field `field`."""
  first_channel = field * width
  if value_group % width == 0:  # the field lies inside one channel group
    column = first_channel // value_group
    return stats[:, column : column + 1]
  groups = width // value_group  # the field spans several whole channel groups
  first = first_channel // value_group
  columns = stats[:, first : first + groups]
  tokens = columns.shape[0]
  return jnp.broadcast_to(columns[:, :, None], (tokens, groups, value_group)).reshape(tokens, width)


def _dot(a, b, contract_a, contract_b):
  return jax.lax.dot_general(
    a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32
  )


def _quantized_kernel(
  lengths_ref,
  queries_ref,
  k_codes_ref,
  k_scale_ref,
  k_min_ref,
  v_codes_ref,
  v_scale_ref,
  v_min_ref,
  *rest,
  plan: SplitPlan,
  bits: int,
  group_size: int,
  has_lowrank: bool,
  has_outliers: bool,
  head_dim: int,
):
  out_ref, lse_ref, max_ref, sum_ref, acc_ref = rest[-5:]
  extra = list(rest[:-5])
  if has_lowrank:
    k_a_ref, k_b_ref, v_a_ref, v_b_ref = extra[:4]
    extra = extra[4:]
  if has_outliers:
    k_index_ref, k_value_ref, v_index_ref, v_value_ref = extra[:4]
  row, split, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
  block = plan.block_tokens
  fields, rows, width = queries_ref.shape  # [n, rows, W]
  mask = jnp.uint32(2**bits - 1)

  @pl.when(step == 0)
  def _init():
    max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
    sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  length = lengths_ref[row]
  first = (split * plan.blocks_per_split + step) * block

  @pl.when(first < length)
  def _attend():
    valid = first + jax.lax.broadcasted_iota(jnp.int32, (block,), 0) < length
    compute_dtype = queries_ref.dtype
    k_words = k_codes_ref[...]  # uint32 [block, W]
    k_scale = k_scale_ref[...].astype(jnp.float32)  # [block/G, n, W]
    k_min = k_min_ref[...].astype(jnp.float32)
    scores = jnp.zeros((rows, block), jnp.float32)
    for field in range(fields):
      code = ((k_words >> jnp.uint32(bits * field)) & mask).astype(jnp.float32)
      keys = code * _repeat_rows(k_scale[:, field, :], group_size) + _repeat_rows(
        k_min[:, field, :], group_size
      )
      scores += _dot(queries_ref[field], keys.astype(compute_dtype), 1, 1)

    if has_lowrank:
      q_b = sum(
        _dot(queries_ref[field].astype(jnp.float32), k_b_ref[field].astype(jnp.float32), 1, 0)
        for field in range(fields)
      )  # [rows, r]
      scores += _dot(q_b, k_a_ref[...].astype(jnp.float32), 1, 1)
    if has_outliers:
      log2_head_dim = int(math.log2(head_dim))
      token_ids = jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
      k_index = k_index_ref[...]  # [1, s]
      k_token_hot = (token_ids == (k_index >> log2_head_dim)).astype(jnp.float32)  # [block, s]
      k_channel = k_index & (head_dim - 1)
      q_at_outlier = sum(
        _dot(
          queries_ref[field].astype(jnp.float32),
          (jax.lax.broadcasted_iota(jnp.int32, (width, 1), 0) + field * width == k_channel).astype(
            jnp.float32
          ),
          1,
          0,
        )
        for field in range(fields)
      )  # [rows, s]
      scores += _dot(q_at_outlier * k_value_ref[...].astype(jnp.float32), k_token_hot, 1, 1)

    scores = jnp.where(valid[None, :], scores, -jnp.inf)
    previous_max = max_ref[...]
    new_max = jnp.maximum(previous_max, scores.max(axis=1, keepdims=True))
    correction = jnp.exp(previous_max - new_max)
    probs = jnp.exp(scores - new_max)  # [rows, block]; 0 past the length
    sum_ref[...] = sum_ref[...] * correction + probs.sum(axis=1, keepdims=True)
    max_ref[...] = new_max
    probs_c = probs.astype(compute_dtype)

    v_words = v_codes_ref[...]
    v_scale = v_scale_ref[...].astype(jnp.float32)  # [block, D/G]
    v_min = v_min_ref[...].astype(jnp.float32)
    if has_lowrank:
      p_a = _dot(probs, v_a_ref[...].astype(jnp.float32), 1, 0)  # [rows, r]
    if has_outliers:
      v_index = v_index_ref[...]
      v_token_hot = (token_ids == (v_index >> log2_head_dim)).astype(jnp.float32)
      weighted = _dot(probs, v_token_hot, 1, 0) * v_value_ref[...].astype(jnp.float32)  # [rows, s]
      v_channel = v_index & (head_dim - 1)
    for field in range(fields):
      code = ((v_words >> jnp.uint32(bits * field)) & mask).astype(jnp.float32)
      values = code * _field_value_stats(v_scale, field, width, group_size) + _field_value_stats(
        v_min, field, width, group_size
      )
      # Slots past the length may hold anything: zero them so 0 * NaN cannot leak.
      values = jnp.where(valid[:, None], values, 0.0)
      update = _dot(probs_c, values.astype(compute_dtype), 1, 0)  # [rows, W]
      if has_lowrank:
        update += _dot(p_a, v_b_ref[field].astype(jnp.float32), 1, 1)
      if has_outliers:
        channel_hot = (
          jax.lax.broadcasted_iota(jnp.int32, (width, 1), 0) + field * width == v_channel
        ).astype(jnp.float32)  # [W, s]
        update += _dot(weighted, channel_hot, 1, 1)
      acc_ref[field] = acc_ref[field] * correction + update

  @pl.when(step == plan.blocks_per_split - 1)
  def _write():
    total = sum_ref[...]
    nonempty = total != 0  # a NaN sum is not empty: the NaN reaches out and lse
    safe_total = jnp.where(nonempty, total, 1.0)
    for field in range(fields):
      out_ref[field] = jnp.where(nonempty, acc_ref[field] / safe_total, 0.0)
    lse_ref[...] = jnp.where(nonempty, max_ref[...] + jnp.log(safe_total), -jnp.inf)


@_compat.waits_when_interpreted  # the jax 0.11.2 interpreter hang: `finished_if_interpreted`
@functools.partial(
  jax.jit,
  static_argnames=(
    "bits",
    "group_size",
    "sm_scale",
    "block",
    "block_tokens",
    "num_splits",
    "interpret",
  ),
)
def quantized_decode_attention_partials_tpu(
  queries,
  k_codes,
  k_scale,
  k_min,
  v_codes,
  v_scale,
  v_min,
  lengths,
  initial_partials=None,
  *,
  bits: int,
  group_size: int,
  sm_scale: float,
  lowrank=None,
  outliers=None,
  block: int = 64,
  block_tokens: int | None = None,
  num_splits: int | None = 2,
  interpret: bool = False,
):
  """Per-split partials (out f32 [B,H,S,rows,D], lse f32 [B,H,S,rows]). Interpreted, the outputs
  are waited for before this returns (`_compat.finished_if_interpreted`)."""
  check_bits(bits)
  sizes = check_quantized_inputs(
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
    lowrank=lowrank,
    outliers=outliers,
    block=block,
  )
  batch, kv_heads, group, head_dim, tokens, width = sizes[:6]
  fields = 32 // bits
  gear = lowrank is not None or outliers is not None
  if gear:
    block_tokens = block
  elif block_tokens is None:
    block_tokens = max(512, group_size)
  block_tokens = -(-max(block_tokens, group_size) // group_size) * group_size
  block_tokens = min(block_tokens, tokens)
  rows = tile_rows(group)
  plan = plan_splits(tokens, block_tokens, batch * kv_heads, num_splits, target_programs=1)
  compute_dtype = k_scale.dtype if k_scale.dtype == jnp.bfloat16 else jnp.float32
  scaled = queries.astype(jnp.float32) * sm_scale
  scaled = jnp.pad(scaled, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
  # [B, H, rows, D] -> [B, H, n, rows, W]: field k's channels as its own tile (tiny array).
  split_queries = jnp.moveaxis(scaled.reshape(batch, kv_heads, rows, fields, width), 3, 2)
  split_queries = split_queries.astype(compute_dtype)
  key_groups = block_tokens // group_size

  def block_index(b, h, s, i, lengths_ref):
    return clamped_block_index(b, s, i, lengths_ref, plan=plan)

  def token_spec(trailing):  # blocks of block_tokens along the token axis
    return pl.BlockSpec(
      (None, None, block_tokens) + trailing,
      lambda b, h, s, i, lens: (b, h, block_index(b, h, s, i, lens)) + (0,) * len(trailing),
    )

  def per_block_spec(trailing):  # one entry per GEAR block (block_tokens == block)
    return pl.BlockSpec(
      (None, None, None) + trailing,
      lambda b, h, s, i, lens: (b, h, block_index(b, h, s, i, lens)) + (0,) * len(trailing),
    )

  key_stat_shape = (batch, kv_heads, tokens // group_size, fields, width)
  args = [
    split_queries,
    k_codes,
    k_scale.reshape(key_stat_shape),
    k_min.reshape(key_stat_shape),
    v_codes,
    v_scale,
    v_min,
  ]
  key_stat_spec = pl.BlockSpec(
    (None, None, key_groups, fields, width),
    lambda b, h, s, i, lens: (b, h, block_index(b, h, s, i, lens), 0, 0),
  )
  in_specs = [
    pl.BlockSpec((None, None, fields, rows, width), lambda b, h, s, i, lens: (b, h, 0, 0, 0)),
    token_spec((width,)),
    key_stat_spec,
    key_stat_spec,
    token_spec((width,)),
    token_spec((head_dim // group_size,)),
    token_spec((head_dim // group_size,)),
  ]
  if lowrank is not None:
    k_a, k_b, v_a, v_b = lowrank
    rank = sizes.rank
    factor_shape = (batch, kv_heads, tokens // block, fields, width, rank)
    args += [k_a, k_b.reshape(factor_shape), v_a, v_b.reshape(factor_shape)]
    in_specs += [token_spec((rank,)), per_block_spec((fields, width, rank))] * 2
  if outliers is not None:
    count = sizes.outliers_per_block
    as_rows = lambda x: x.reshape(batch, kv_heads, tokens // block, 1, count)
    k_index, k_value, v_index, v_value = outliers
    # The caches store the indices as uint16; they are widened here, by XLA, because 16-bit
    # integer vectors in a Mosaic TPU kernel have not been compiled on a TPU for this project.
    # That costs a pass over the indices (2 bytes read, 4 written per outlier) per call.
    args += [
      as_rows(k_index.astype(jnp.int32)),
      as_rows(k_value),
      as_rows(v_index.astype(jnp.int32)),
      as_rows(v_value),
    ]
    in_specs += [per_block_spec((1, count))] * 4
  out_specs = [
    pl.BlockSpec(
      (None, None, None, fields, rows, width), lambda b, h, s, i, lens: (b, h, s, 0, 0, 0)
    ),
    pl.BlockSpec((None, None, None, rows, 1), lambda b, h, s, i, lens: (b, h, s, 0, 0)),
  ]
  out_shape = [
    jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, fields, rows, width), jnp.float32),
    jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows, 1), jnp.float32),
  ]
  aliases = {}
  if initial_partials is not None:
    in_specs += out_specs
    aliases = {1 + len(args): 0, 2 + len(args): 1}
    out_init, lse_init = initial_partials  # [B,H,S,rows,D], [B,H,S,rows]
    out_init = jnp.moveaxis(out_init.reshape(*out_init.shape[:4], fields, width), 4, 3)
    args += [out_init, lse_init[..., None]]
  grid_spec = _compat.prefetch_scalar_grid_spec(
    num_scalar_prefetch=1,
    grid=(batch, kv_heads, plan.num_splits, plan.blocks_per_split),
    in_specs=in_specs,
    out_specs=out_specs,
    scratch_shapes=[
      _compat.tpu_vmem_scratch((rows, 1), jnp.float32),
      _compat.tpu_vmem_scratch((rows, 1), jnp.float32),
      _compat.tpu_vmem_scratch((fields, rows, width), jnp.float32),
    ],
  )
  kernel = functools.partial(
    _quantized_kernel,
    plan=plan,
    bits=bits,
    group_size=group_size,
    has_lowrank=lowrank is not None,
    has_outliers=outliers is not None,
    head_dim=head_dim,
  )
  out, lse = pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=out_shape,
    input_output_aliases=aliases,
    compiler_params=_compat.tpu_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
    interpret=_compat.tpu_interpret_params() if interpret else False,
    name=f"quantized_decode_attention_{bits}bit_tpu",
  )(lengths.astype(jnp.int32), *args)
  # [B, H, S, n, rows, W] -> [B, H, S, rows, D]
  out = jnp.moveaxis(out, 3, 4).reshape(batch, kv_heads, plan.num_splits, rows, head_dim)
  return out, lse[..., 0]


def quantized_decode_attention_tpu(
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
  lowrank=None,
  outliers=None,
  block=64,
  **config,
):
  """(out f32 [B,H,G,D], lse f32 [B,H,G]); same contract as the reference."""
  out, lse = quantized_decode_attention_partials_tpu(
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
    lowrank=lowrank,
    outliers=outliers,
    block=block,
    **config,
  )
  return merge_split_partials(out, lse, queries.shape[2])
