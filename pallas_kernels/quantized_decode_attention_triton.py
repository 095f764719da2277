"""GPU fused dequantize-attention for decoding over a KIVI / GEAR quantized segment (Pallas,
Triton lowering).

Structure (same as `decode_attention_triton`): grid (batch, kv_heads, splits); each program
walks its share of the row's valid blocks with an online softmax and writes a normalised
partial output and its log-sum-exp. Per block of `block_tokens` tokens it reads

  k_codes / v_codes  uint32 [block, D*bits/32]   (planar-packed, `bit_packing`)
  k_scale / k_min    [block/group_size, D]       (keys: per channel, per token group)
  v_scale / v_min    [block, D/group_size]       (values: per token, per channel group)

and dequantizes on chip: the n = 32/bits bit fields of the words are shifted out as a
[block, n, W] tensor whose row-major flattening IS natural channel order (planar layout:
field k holds channels [k*W, (k+1)*W)), converted to float with the 2^23 "magic number"
(OR the code into the mantissa of 2^23, subtract 2^23: two integer ops and one float add
instead of a slow int-to-float conversion), scaled, and fed to tensor-core dots. Scales stay
at their stored granularity in memory and are broadcast in registers.

Four variants (`variant=`): "reshape" as just described, one dot for K and one for V per block;
"joined" has the same one-dot-per-block structure but joins the bit fields with `stack`
(`joined_fields`: no reshape, so no layout conversion through shared memory; channels in a fixed
permutation applied to q and undone on the output), keeps each block's key groups as a leading axis
so their scale rows broadcast in registers, and dequantizes with one FMA per element
(`float_unpacking`). "folded" (`folded_scales_kernel_triton`) dequantizes nothing: key scales are
folded into one copy of q per key group and value scales into one copy of p per value channel group,
the copies stacked along the rows of the same two dots, and 2/4-bit bf16 codes become operands with
one AND per pair as small (subnormal) bf16 bit patterns (`code_operand="subnormal"`,
`subnormal_codes`; "offset" is the older shift, AND-OR and packed subtraction of 128); it reads
q . k_min per key group, computed before the kernel (`key_bias`), instead of k_min.
"planar" folds the scales too, but with one small dot per key group and per value channel
group. Measured on H100 at 32k (KIVI-2, benchmarks/RESULTS.md): folded 296 us (265 us with
`prefetch`, the next block's loads issued one step ahead; 250-262 us with subnormal operands and 2
stages), reshape 470, joined 468, planar 856; so "folded" with prefetch and subnormal operands is
the default of `quantized_decode_attention_triton`, falling back to "joined" and then "reshape"
where it does not apply.

GEAR's low-rank and outlier terms are fused in every variant, one GEAR block per step (so
`block_tokens == block`), by `gear_terms_triton`; or, with the folded setting
`gear_terms="xla"` (the default of `quantized_decode_attention_triton` since it measured twice
as fast on H100, KERNEL_NOTES v13), computed by XLA around the kernel (`gear_terms_xla`: a
dense score bias in, the scores out), so that the kernel walks a GEAR segment as a KIVI one.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.base_two_softmax import base_two_queries
from pallas_kernels.bit_packing import check_bits
from pallas_kernels.decode_attention_triton import (
  _dot_nn,
  _dot_nt,
  load_token_rows,
  online_softmax_step,
  split_block_range,
  store_split_partials,
  tile_rows,
)
from pallas_kernels.float_unpacking import (
  MAGIC_2_23,
  field_at_mantissa_bit,
  magic_dequantization_constants,
)
from pallas_kernels.folded_scales_kernel_triton import (
  CHANNEL_PARTS,
  check_channel_parts,
  folded_channel_order,
  folded_kernel,
  folded_rows,
  folded_supported,
  uses_bf16_pairs,
)
from pallas_kernels.gear_terms_triton import (
  GearRefs,
  gear_kernel_inputs,
  gear_score_terms,
  gear_value_terms,
)
from pallas_kernels.gear_terms_xla import (
  check_gear_terms,
  gear_score_bias,
  gear_value_terms_from_scores,
)
from pallas_kernels.joined_fields import (
  channel_orders,
  join_fields,
  joined_value_order,
)
from pallas_kernels.key_bias import key_bias
from pallas_kernels.launch_settings import is_power_of_two
from pallas_kernels.quantized_decode_attention_reference import check_quantized_inputs
from pallas_kernels.splits import (
  SplitPlan,
  gpu_target_programs,
  merge_split_partials,
  next_power_of_two,
  pad_query_group,
  plan_splits,
)
from pallas_kernels.subnormal_codes import CODE_OPERANDS


def unpack_to_float(words: jax.Array, bits: int) -> jax.Array:
  """uint32 [rows, W] planar words -> float32 codes [rows, W * 32 // bits] in natural order."""
  rows, width = words.shape
  per_word = 32 // bits
  shifts = jnp.arange(per_word, dtype=jnp.uint32) * jnp.uint32(bits)
  fields = jnp.right_shift(words[:, None, :], shifts[None, :, None]) & jnp.uint32(2**bits - 1)
  fields = fields.reshape(rows, per_word * width)
  return jax.lax.bitcast_convert_type(fields | jnp.uint32(MAGIC_2_23), jnp.float32) - 8388608.0


def _broadcast_rows(stats: jax.Array, repeat: int) -> jax.Array:
  """[n, C] -> [n * repeat, C], each row repeated `repeat` times (register broadcast)."""
  if repeat == 1:
    return stats
  n, width = stats.shape
  return jnp.broadcast_to(stats[:, None, :], (n, repeat, width)).reshape(n * repeat, width)


def _broadcast_columns(stats: jax.Array, repeat: int) -> jax.Array:
  """[R, n] -> [R, n * repeat], each column repeated `repeat` times."""
  if repeat == 1:
    return stats
  rows, n = stats.shape
  return jnp.broadcast_to(stats[:, :, None], (rows, n, repeat)).reshape(rows, n * repeat)


def unsupported_reason(
  queries, k_codes, k_scale, v_scale, *, bits, group_size, lowrank, outliers, block
) -> str | None:
  """Why this kernel cannot take these shapes (None if it can)."""
  head_dim = queries.shape[3]
  if head_dim not in (64, 128, 256):
    return f"head_dim={head_dim} (supported: 64, 128, 256)"
  if queries.shape[2] > 64:
    return f"query group {queries.shape[2]} > 64"
  if not is_power_of_two(group_size) or group_size > 256:
    return f"group_size={group_size} (must be a power of two <= 256)"
  if (lowrank is not None or outliers is not None) and (
    not is_power_of_two(block) or block < 16 or block > 256
  ):
    return f"GEAR block={block} (must be a power of two in [16, 256])"
  if k_scale.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    return f"scale dtype {k_scale.dtype}"
  return None


def load_value_group_stats(scale_ref, min_ref, first, count, group, valid):
  """float32 (scale [count], min [count]) of value channel group `group` for tokens
  first .. first + count - 1 (masked lanes read no memory)."""
  return tuple(
    _compat.triton_load(ref.at[pl.ds(first, count), jnp.int32(group)], mask=valid, other=0).astype(
      jnp.float32
    )
    for ref in (scale_ref, min_ref)
  )


def _quantized_decode_kernel(lengths_ref, *refs, joined: bool, **static):
  """One step = one block of `plan.block_tokens` tokens; K and V dequantized whole, one dot each.

  joined=False ("reshape"): bit fields -> [block, n, W] -> reshape to natural channel order.
  joined=True ("joined"): bit fields joined with `join_fields` (register renaming, channels in
  `channel_orders(...)[0]` / `joined_value_order(...)` order, the queries and outputs permuted
  outside), the key groups kept as a leading axis so their scales broadcast in registers.
  `static`: the keyword arguments of `_quantized_decode_block_loop` but the channel orders.
  """
  key_order = value_order = None
  if joined:
    key_order_ref, value_order_ref = refs[:2]
    refs = refs[2:]
    key_order = key_order_ref[...]
    value_order = value_order_ref[...]
  _quantized_decode_block_loop(
    lengths_ref, *refs, key_order=key_order, value_order=value_order, **static
  )


def _quantized_decode_block_loop(
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
  tokens: int,
  bits: int,
  group_size: int,
  has_lowrank: bool,
  has_outliers: bool,
  key_order,
  value_order,
):
  joined = key_order is not None
  out_ref, lse_ref = rest[-2:]
  gear = GearRefs.take(rest[:-2], has_lowrank, has_outliers)

  block = plan.block_tokens
  key_groups = block // group_size  # key quantization groups per block
  start, end, num_blocks = split_block_range(plan, lengths_ref[()], tokens)
  queries = queries_ref[...]  # [rows, D] compute dtype, pre-scaled
  compute_dtype = queries.dtype
  rows, head_dim = queries.shape
  value_group = group_size  # channels per value quantization group
  offsets = jnp.arange(block, dtype=jnp.int32)
  group_offsets = jnp.arange(key_groups, dtype=jnp.int32)
  value_channels = value_order if joined else jnp.arange(head_dim, dtype=jnp.int32)
  num_fields = 32 // bits
  num_value_groups = head_dim // group_size
  per_group = num_fields // num_value_groups  # bit fields per value channel group (joined)
  last_group = tokens // group_size - 1

  def body(i, carry):
    running_max, running_sum, acc = carry
    first = start + i * block
    valid = first + offsets < end  # [block]; masked lanes read no memory
    first_group = first // group_size
    group_valid = (first_group + group_offsets) * group_size < end

    # Keys: K[t, d] = code * k_scale[t // G, d] + k_min[t // G, d], dequantized in registers.
    k_words = load_token_rows(k_codes_ref, first, block, valid)
    if joined:
      # Groups of tokens as a leading axis: the group's scale row broadcasts in registers.
      k_code = join_fields(
        [
          field_at_mantissa_bit(k_words.reshape(key_groups, group_size, -1), bits, f)
          for f in range(num_fields)
        ]
      )  # [groups, G, D] float32 2^23 + code * 2^(23 - bits), key order
      group_rows = jnp.minimum(first_group + group_offsets, last_group)[:, None]
      k_scale = k_scale_ref[group_rows, key_order[None, :]].astype(jnp.float32)
      k_min = k_min_ref[group_rows, key_order[None, :]].astype(jnp.float32)
      step, shifted_min = magic_dequantization_constants(k_scale, k_min, bits)
      keys = (k_code * step[:, None, :] + shifted_min[:, None, :]).reshape(block, head_dim)
    else:
      k_code = unpack_to_float(k_words, bits)
      k_scale, k_min = (
        load_token_rows(ref, first_group, key_groups, group_valid).astype(jnp.float32)
        for ref in (k_scale_ref, k_min_ref)
      )
      keys = k_code * _broadcast_rows(k_scale, group_size) + _broadcast_rows(k_min, group_size)
    scores = _dot_nt(queries, keys.astype(compute_dtype))  # [rows, block]

    if gear.present:  # block_tokens == GEAR block
      scores = scores + gear_score_terms(gear, queries_ref, first // block, first, valid)

    running_max, running_sum, correction, probs = online_softmax_step(
      running_max, running_sum, scores, valid
    )  # probs [rows, block]

    # Values: V[t, d] = code * v_scale[t, d // G] + v_min[t, d // G].
    v_words = load_token_rows(v_codes_ref, first, block, valid)
    if joined:
      # Each channel group's fields joined and scaled by its [block] scale column, then the
      # groups joined: positions in `joined_value_order`.
      value_groups = []
      for c in range(num_value_groups):
        v_scale, v_min = load_value_group_stats(v_scale_ref, v_min_ref, first, block, c, valid)
        v_code = join_fields(
          [
            field_at_mantissa_bit(v_words, bits, f)
            for f in range(c * per_group, (c + 1) * per_group)
          ]
        )
        step, shifted_min = magic_dequantization_constants(v_scale, v_min, bits)
        value_groups.append(v_code * step[:, None] + shifted_min[:, None])
      values = join_fields(value_groups)
    else:
      v_code = unpack_to_float(v_words, bits)
      v_scale = load_token_rows(v_scale_ref, first, block, valid).astype(jnp.float32)
      v_min = load_token_rows(v_min_ref, first, block, valid).astype(jnp.float32)
      values = v_code * _broadcast_columns(v_scale, value_group) + _broadcast_columns(
        v_min, value_group
      )
    probs_c = probs.astype(compute_dtype)
    update = _dot_nn(probs_c, values.astype(compute_dtype))  # [rows, D]
    if gear.present:
      [gear_update] = gear_value_terms(
        gear, probs, first // block, first, valid, [value_channels], compute_dtype
      )
      update = update + gear_update
    return running_max, running_sum, acc * correction[:, None] + update

  init = (
    jnp.full((rows,), -jnp.inf, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
    jnp.zeros((rows, head_dim), jnp.float32),
  )
  running_max, running_sum, acc = jax.lax.fori_loop(0, num_blocks, body, init)
  store_split_partials(out_ref, lse_ref, running_max, running_sum, acc)


def _unpack_field(words, bits, field):
  """Bit field `field` of uint32 words as exact float32 codes (magic-number conversion)."""
  code = jnp.right_shift(words, jnp.uint32(bits * field)) & jnp.uint32(2**bits - 1)
  return jax.lax.bitcast_convert_type(code | jnp.uint32(MAGIC_2_23), jnp.float32) - 8388608.0


def _planar_kernel(
  lengths_ref,
  key_order_ref,
  value_order_ref,
  queries_ref,
  k_codes_ref,
  k_scale_ref,
  k_min_ref,
  v_codes_ref,
  v_scale_ref,
  v_min_ref,
  *rest,
  plan: SplitPlan,
  tokens: int,
  bits: int,
  group_size: int,
  unroll: int,
  gear_block: int,
  has_lowrank: bool,
  has_outliers: bool,
):
  """One fori step = `unroll` key groups of `group_size` tokens (see module doc, "planar")."""
  out_ref, lse_ref = rest[-2:]
  gear = GearRefs.take(rest[:-2], has_lowrank, has_outliers)

  block = group_size  # tokens per sub-step: one key quantization group (one scale row)
  fields = 32 // bits
  start, end, num_steps = split_block_range(plan, lengths_ref[()], tokens)
  queries = queries_ref[...].astype(jnp.float32)  # [rows, D], key channel order, pre-scaled
  rows, head_dim = queries.shape
  compute_dtype = queries_ref.dtype
  value_group = group_size
  num_value_groups = head_dim // value_group
  fields_per_value_group = value_group * fields // head_dim
  key_order = key_order_ref[...]  # [D] int32
  offsets = jnp.arange(block, dtype=jnp.int32)
  last_key_group = tokens // group_size - 1

  def sub_step(first, carry):
    running_max, running_sum, accs = carry
    valid = first + offsets < end  # [block]; masked lanes read no memory
    key_group = jnp.minimum(first // group_size, last_key_group)

    # Scores: (q * k_scale[g]) . codes^T + q . k_min[g]: no per-element dequantization.
    k_words = load_token_rows(k_codes_ref, first, block, valid)
    k_code = join_fields([_unpack_field(k_words, bits, f) for f in range(fields)])  # [block, D]
    k_scale = k_scale_ref[key_group, key_order].astype(jnp.float32)  # [D], key channel order
    k_min = k_min_ref[key_group, key_order].astype(jnp.float32)
    scaled_queries = (queries * k_scale[None, :]).astype(compute_dtype)
    scores = _dot_nt(scaled_queries, k_code.astype(compute_dtype))  # [rows, block]
    scores = scores + jnp.sum(queries * k_min[None, :], axis=1)[:, None]

    if gear.present:
      # unroll tail: stay in bounds
      gear_index = jnp.minimum(first // gear_block, tokens // gear_block - 1)
      offset_in_gear_block = first - gear_index * gear_block
      scores = scores + gear_score_terms(
        gear,
        queries_ref,
        gear_index,
        first,
        valid,
        token_shift=offset_in_gear_block,
      )

    running_max, running_sum, correction, probs = online_softmax_step(
      running_max, running_sum, scores, valid
    )  # probs [rows, block]

    # Values, per channel group c: sum_t (p_t * v_scale[t, c]) codes[t, group c]
    #                               + sum_t p_t * v_min[t, c].
    v_words = load_token_rows(v_codes_ref, first, block, valid)
    if gear.present:  # per value group [rows, value_group], p A_v / p at the outliers once
      gear_updates = gear_value_terms(
        gear,
        probs,
        gear_index,
        first,
        valid,
        [value_order_ref[pl.ds(c * value_group, value_group)] for c in range(num_value_groups)],
        compute_dtype,
        token_shift=offset_in_gear_block,
      )
    new_accs = []
    for c in range(num_value_groups):
      v_scale, v_min = load_value_group_stats(v_scale_ref, v_min_ref, first, block, c, valid)
      first_field = c * fields_per_value_group
      v_code = join_fields(
        [
          _unpack_field(v_words, bits, f)
          for f in range(first_field, first_field + fields_per_value_group)
        ]
      )
      update = _dot_nn(
        (probs * v_scale[None, :]).astype(compute_dtype), v_code.astype(compute_dtype)
      )  # [rows, value_group]
      update = update + jnp.sum(probs * v_min[None, :], axis=1)[:, None]
      if gear.present:
        update = update + gear_updates[c]
      new_accs.append(accs[c] * correction[:, None] + update)
    return running_max, running_sum, tuple(new_accs)

  def body(i, carry):
    for u in range(unroll):
      carry = sub_step(start + (i * unroll + u) * block, carry)
    return carry

  init = (
    jnp.full((rows,), -jnp.inf, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
    tuple(jnp.zeros((rows, value_group), jnp.float32) for _ in range(num_value_groups)),
  )
  running_max, running_sum, accs = jax.lax.fori_loop(0, num_steps, body, init)
  store_split_partials(out_ref, lse_ref, running_max, running_sum, *accs)


def compute_dtype_for(scale_dtype):
  """bf16/f16 caches use 16-bit tensor-core operands; f32 caches use f32 (tf32 on GPU)."""
  return scale_dtype if scale_dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


VARIANTS = ("folded", "joined", "planar", "reshape")
DEFAULT_VARIANT = "folded"  # the fastest measured on H100 (KERNEL_NOTES v8)
DEFAULT_CODE_OPERAND = "subnormal"
# Where the folded kernel's callers get GEAR's terms computed unless they ask: measured on an
# H100 (KERNEL_NOTES v13, batch 8, 8 KV heads, rank 4, 2% outliers) "xla" took 429 / 1085 /
# 4274 us at 8k / 32k / 128k against 609 / 2139 / 8126 us for "kernel".
DEFAULT_GEAR_TERMS = "xla"
# kernel_config keys of variant "folded" only
FOLDED_SETTINGS = ("prefetch", "code_operand", "channel_parts", "gear_terms", "stack_copies")


def check_variant_settings(
  variant: str,
  prefetch: bool | None = None,
  code_operand: str | None = None,
  channel_parts: int | None = None,
  gear_terms: str | None = None,
  stack_copies: bool | None = None,
) -> None:
  """ValueError naming a variant that does not exist, a `prefetch` or `stack_copies` that is
  not a bool, a `code_operand` not in CODE_OPERANDS, a `channel_parts` not in CHANNEL_PARTS, a
  `gear_terms` not in GEAR_TERMS, or any of them given to a variant other than "folded"
  (None: the variant's default)."""
  if variant not in VARIANTS:
    raise ValueError(f"variant={variant!r} is not supported; allowed: {', '.join(VARIANTS)}")
  for name, value in (("prefetch", prefetch), ("stack_copies", stack_copies)):
    if value is not None and not isinstance(value, bool):
      raise ValueError(f"{name}={value!r} must be True, False or None (the variant's default)")
  if code_operand is not None and code_operand not in CODE_OPERANDS:
    raise ValueError(
      f"code_operand={code_operand!r} is not supported; allowed: {', '.join(CODE_OPERANDS)} "
      "or None (the default)"
    )
  if channel_parts is not None and (
    isinstance(channel_parts, bool) or channel_parts not in CHANNEL_PARTS
  ):
    raise ValueError(
      f"channel_parts={channel_parts!r} is not supported; allowed: "
      f"{', '.join(map(str, CHANNEL_PARTS))} or None (1)"
    )
  check_gear_terms(gear_terms)
  settings = (prefetch, code_operand, channel_parts, gear_terms, stack_copies)
  for name, value in zip(FOLDED_SETTINGS, settings):
    if value is not None and variant != "folded":
      raise ValueError(
        f"{name}={value!r} is a setting of variant='folded' only; got variant={variant!r}"
      )


def resolve_code_operand(code_operand: str | None, bits: int, compute_dtype) -> str:
  """The folded kernel's code encoding: "subnormal" applies to bf16 2- and 4-bit codes only
  (ValueError if asked for elsewhere); None picks DEFAULT_CODE_OPERAND where it applies."""
  applies = uses_bf16_pairs(bits, compute_dtype)
  if code_operand == "subnormal" and not applies:
    raise ValueError(
      f"code_operand='subnormal' needs 2- or 4-bit codes with bf16 scales; got bits={bits}, "
      f"scales in {jnp.dtype(compute_dtype).name}. Use 'offset' or None"
    )
  if code_operand is None:
    return DEFAULT_CODE_OPERAND if applies else "offset"
  return code_operand


FOLDED_MAX_GROUP = 8  # query heads per KV head that `quantized_decode_attention_triton` folds


def output_channel_order(
  head_dim: int, bits: int, group_size: int, variant: str, compute_dtype, channel_parts=None
):
  """numpy int32 [D]: channel at each position of the partial outputs' last axis (for "folded"
  it depends on the operand dtype, `compute_dtype_for(scale dtype)`, and on `channel_parts`)."""
  if variant == "folded":
    return folded_channel_order(head_dim, bits, compute_dtype, channel_parts or 1)
  if variant == "reshape":
    return np.arange(head_dim, dtype=np.int32)
  if variant == "joined":
    return joined_value_order(head_dim, bits, group_size)
  return channel_orders(head_dim, bits, group_size)[1]


@functools.partial(
  jax.jit,
  static_argnames=(
    "bits",
    "group_size",
    "sm_scale",
    "block",
    "block_tokens",
    "num_splits",
    "num_warps",
    "num_stages",
    "interpret",
    "variant",
    "unroll",
    "prefetch",
    "code_operand",
    "channel_parts",
    "gear_terms",
    "stack_copies",
  ),
)
def quantized_decode_attention_partials_triton(
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
  num_splits: int | None = None,
  num_warps: int = 4,
  num_stages: int | None = None,
  interpret: bool = False,
  variant: str = "reshape",
  unroll: int = 2,
  prefetch: bool | None = None,
  code_operand: str | None = None,
  channel_parts: int | None = None,
  gear_terms: str | None = None,
  stack_copies: bool | None = None,
):
  """Per-split partials (out f32 [B,H,S,rows,D], lse f32 [B,H,S,rows], rows = `partial_rows`);
  see module doc. With `gear_terms="xla"` and a GEAR segment, also the scores f32 [B,H,R,T]
  (R: the query group padded to a power of two; entries at or past a row's length unwritten),
  and `out` lacks GEAR's value terms (`gear_terms_xla.gear_value_terms_from_scores` adds them
  to the merged output).

  The partial outputs' channels are in `output_channel_order(...)` order (merge the splits
  first, then un-permute the small merged array). `initial_partials` (optional) are the output
  buffers' starting contents (aliased), so tests can poison them.

  variant "reshape" (this function's default; `quantized_decode_attention_triton` defaults to
  "folded"): `block_tokens` (default 128) per step, K and V fully dequantized in registers
  through a broadcast + reshape, one dot each.
  variant "joined": as "reshape" without layout conversions (see the module doc).
  variant "folded": scales folded into stacked q / p, no per-element dequantization (GEAR:
  one GEAR block per step, its terms in an accumulator of their own, unless `gear_terms` is
  "xla"). `prefetch` (folded only; None means on for folded): each step issues the next
  block's loads and carries them.
  `num_stages` None: 2 for "folded", 3 for the others.
  `code_operand` (folded only): how bf16 2- and 4-bit codes become tensor-core operands,
  "subnormal" (one AND per pair, `subnormal_codes`) or "offset" (128 + code, minus 128); None
  means DEFAULT_CODE_OPERAND where it applies, else "offset" (8-bit codes, f16/f32 caches).
  `channel_parts` (folded only; None means 1): unpack and multiply each token's code words in
  that many column slices, for fewer registers per thread (`folded_kernel`).
  `gear_terms` (folded only; None means "kernel" in this function, DEFAULT_GEAR_TERMS in
  `quantized_decode_attention_triton`): "xla" computes GEAR's low-rank and outlier
  terms with XLA around the kernel (`gear_terms_xla`): the key terms as a dense score bias the
  kernel adds, the value terms left to the caller; the kernel then walks `block_tokens` per
  step as for KIVI, with no one-hot dots or rank-r broadcasts.
  `stack_copies` (folded only; None means False): the query group is padded to a power of two
  only, and the stacked operands are repeated until they fill the 16 rows of a tensor-core
  tile, instead of padding the query group with zero rows until they do (`folded_rows`). Only
  query groups of fewer than 16 / stacks heads differ (e.g. 4 heads with 64-token groups, or
  1 and 2 heads with 32-token groups at block 128). Not with GEAR's terms in the kernel
  (`gear_terms="kernel"`), whose own dots take the query rows as their M side.
  variant "planar": one key group of `group_size` tokens per sub-step, `unroll` sub-steps per
  loop step, scales folded into q / p, bit fields joined without layout conversion, one dot
  per value channel group (slower on H100: see benchmarks/KERNEL_NOTES.md).
  """
  check_bits(bits)
  check_variant_settings(variant, prefetch, code_operand, channel_parts, gear_terms, stack_copies)
  if num_stages is None:
    # Measured on H100 at 32k (KERNEL_NOTES v9): folded 250-254 us with 2 stages, 269 with 3.
    num_stages = 2 if variant == "folded" else 3
  # Measured on H100 at 32k (KERNEL_NOTES v8): 265 us with the next block's loads issued one
  # step ahead against 290-302 us without.
  prefetch = variant == "folded" if prefetch is None else prefetch
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
  reason = unsupported_reason(
    queries,
    k_codes,
    k_scale,
    v_scale,
    bits=bits,
    group_size=group_size,
    lowrank=lowrank,
    outliers=outliers,
    block=block,
  )
  if reason is not None:  # the dispatch runs the reference for these; called directly, refused
    raise ValueError(f"the Triton quantized decode-attention kernel does not take {reason}")
  batch, kv_heads, group, head_dim, tokens = sizes[:5]
  gear = lowrank is not None or outliers is not None
  score_io = gear and gear_terms == "xla"  # GEAR's terms around the kernel: it sees a KIVI segment
  gear_block = block if gear and not score_io else None
  step_tokens = tokens_per_step(
    variant, group_size, block_tokens=block_tokens, gear_block=gear_block, unroll=unroll
  )
  compute_dtype = compute_dtype_for(k_scale.dtype)
  if variant == "folded":
    if not folded_supported(head_dim, bits, group_size, step_tokens):
      raise ValueError(
        f"variant='folded' needs block_tokens % group_size == 0 and whole bit fields per value "
        f"group; got head_dim={head_dim}, bits={bits}, group_size={group_size}, "
        f"block_tokens={step_tokens}"
      )
    if stack_copies and gear and not score_io:
      raise ValueError(
        "stack_copies=True needs gear_terms='xla' for a GEAR segment: the kernel's own GEAR "
        "terms take the padded query rows as their dots' M side"
      )
    code_operand = resolve_code_operand(code_operand, bits, compute_dtype)
    channel_parts = channel_parts or 1
    check_channel_parts(channel_parts, head_dim, bits)
  rows = partial_rows(group, head_dim, group_size, variant, block_tokens, gear_block, stack_copies)
  plan = plan_splits(tokens, step_tokens, batch * kv_heads, num_splits, gpu_target_programs())
  scaled_queries = base_two_queries(queries, sm_scale)
  prefix = []
  key_order = np.arange(head_dim, dtype=np.int32)
  if variant == "folded":
    key_order = folded_channel_order(head_dim, bits, compute_dtype, channel_parts)
    prefix = [jnp.asarray(key_order)]
  elif variant != "reshape":
    key_order = channel_orders(head_dim, bits, group_size)[0]
    value_order = output_channel_order(head_dim, bits, group_size, variant, compute_dtype)
    prefix = [jnp.asarray(key_order), jnp.asarray(value_order)]
  natural_queries = pad_query_group(scaled_queries, rows, jnp.float32)
  scaled_queries = scaled_queries[..., key_order]  # the kernel's key channel order
  scaled_queries = pad_query_group(scaled_queries, rows, compute_dtype)

  def row_spec(array):  # this (row, KV head)'s whole slab; the kernel slices blocks itself
    trailing = array.shape[2:]
    return pl.BlockSpec((None, None) + trailing, lambda b, h, s: (b, h) + (0,) * len(trailing))

  def whole_spec(array):  # the same small array for every program
    return pl.BlockSpec(array.shape, lambda b, h, s: (0,) * array.ndim)

  score_rows = next_power_of_two(group)
  # The folded kernel takes q . k_min per key group instead of k_min (`key_bias`).
  key_stats = key_bias(natural_queries, k_min) if variant == "folded" else k_min
  args = [scaled_queries, k_codes, k_scale, key_stats, v_codes, v_scale, v_min]
  if score_io:
    scaled = natural_queries[:, :, :score_rows]
    args.append(gear_score_bias(lowrank, outliers, scaled, tokens=tokens, block=block))
  else:
    args += gear_kernel_inputs(lowrank, outliers, natural_queries, key_order, sizes)
  in_specs = (
    [pl.BlockSpec((None,), lambda b, h, s: (b,))]
    + [whole_spec(x) for x in prefix]
    # [B, H, ...] slabs per program; the [D] channel positions (GEAR outliers) shared by all.
    + [row_spec(x) if x.ndim > 2 else whole_spec(x) for x in args]
  )
  args = [lengths.astype(jnp.int32)] + prefix + args
  out_specs = [
    pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
    pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
  ]
  out_shape = [
    jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows, head_dim), jnp.float32),
    jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows), jnp.float32),
  ]
  if score_io:  # every split writes its own tokens of the row's scores
    out_shape.append(jax.ShapeDtypeStruct((batch, kv_heads, score_rows, tokens), jnp.float32))
    out_specs.append(row_spec(out_shape[-1]))
  aliases = {}
  if initial_partials is not None:
    if len(initial_partials) != len(out_shape):
      raise ValueError(
        f"initial_partials must hold {len(out_shape)} arrays (the outputs), got "
        f"{len(initial_partials)}"
      )
    in_specs += out_specs
    aliases = {len(args) + index: index for index in range(len(out_shape))}
    args += list(initial_partials)
  common = dict(
    plan=plan,
    tokens=tokens,
    bits=bits,
    group_size=group_size,
    has_lowrank=lowrank is not None and not score_io,
    has_outliers=outliers is not None and not score_io,
  )
  if variant == "folded":
    kernel = functools.partial(
      folded_kernel,
      prefetch=prefetch,
      code_operand=code_operand,
      channel_parts=channel_parts,
      score_io=score_io,
      interpret=bool(interpret),
      **common,
    )
  elif variant == "planar":
    kernel = functools.partial(_planar_kernel, unroll=unroll, gear_block=block, **common)
  else:
    kernel = functools.partial(_quantized_decode_kernel, joined=variant == "joined", **common)
  return pl.pallas_call(
    kernel,
    grid=(batch, kv_heads, plan.num_splits),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    input_output_aliases=aliases,
    compiler_params=_compat.triton_compiler_params(num_warps, num_stages),
    interpret=interpret,
    name=f"quantized_decode_attention_{bits}bit_triton",
  )(*args)


def partial_rows(
  group: int,
  head_dim: int,
  group_size: int,
  variant: str,
  block_tokens: int | None = None,
  gear_block: int | None = None,
  stack_copies: bool | None = None,
) -> int:
  """Query rows of the partial outputs of `quantized_decode_attention_partials_triton`
  (`gear_block`: the GEAR block of a GEAR cache whose terms the kernel computes, None for KIVI
  or `gear_terms="xla"`; `stack_copies`: the folded setting)."""
  if variant == "folded":
    step = tokens_per_step(variant, group_size, block_tokens=block_tokens, gear_block=gear_block)
    return folded_rows(group, step, head_dim, group_size, bool(stack_copies))
  return tile_rows(group)


def tokens_per_step(
  variant: str,
  group_size: int,
  *,
  block_tokens: int | None = None,
  gear_block: int | None = None,
  unroll: int = 2,
) -> int:
  """Tokens per loop step: `unroll` key groups for "planar"; otherwise one GEAR block (one
  low-rank factor, one outlier list) for GEAR caches (`block_tokens` does not apply), else
  `block_tokens` (default max(128, group_size)): a power of two, whole key groups."""
  if variant == "planar":
    return group_size * unroll
  if gear_block is not None:
    return gear_block
  if block_tokens is None:
    return max(128, group_size)
  if not is_power_of_two(block_tokens) or block_tokens % group_size:
    raise ValueError(
      f"block_tokens={block_tokens!r} must be a power of two and a multiple of "
      f"group_size={group_size}"
    )
  return block_tokens


def planar_supported(head_dim: int, bits: int, group_size: int) -> bool:
  """The planar variant needs whole bit fields per value group and >= 16-wide dots."""
  return group_size >= 16 and joined_supported(head_dim, bits, group_size)


def joined_supported(head_dim: int, bits: int, group_size: int) -> bool:
  """The joined variant needs whole bit fields per value channel group."""
  return group_size % (head_dim * bits // 32) == 0


def variant_that_runs(
  variant: str,
  *,
  group: int,
  head_dim: int,
  bits: int,
  group_size: int,
  gear_block: int | None,
  config: dict,
) -> tuple[str, str | None]:
  """(the variant `quantized_decode_attention_triton` runs when asked for `variant`, why it is
  another one or None): "folded" gives way to "joined" past FOLDED_MAX_GROUP query heads or
  where `folded_supported` is False, "planar" and "joined" to "reshape" where their fields are
  not whole. `gear_block`: a GEAR segment's block (None: KIVI)."""
  reason = None
  if variant == "folded":
    # Only the folded loop steps by block_tokens here; the other variants step as they do.
    in_kernel_gear = (
      gear_block is not None and config.get("gear_terms", DEFAULT_GEAR_TERMS) != "xla"
    )
    step = tokens_per_step(
      "folded",
      group_size,
      block_tokens=config.get("block_tokens"),
      gear_block=gear_block if in_kernel_gear else None,
    )
    if group > FOLDED_MAX_GROUP:
      variant, reason = "joined", f"{group} query heads per KV head (at most {FOLDED_MAX_GROUP})"
    elif not folded_supported(head_dim, bits, group_size, step):
      variant = "joined"
      reason = (
        f"{bits}-bit codes at head_dim {head_dim}, group_size {group_size}, {step}-token steps"
      )
  if (variant == "planar" and not planar_supported(head_dim, bits, group_size)) or (
    variant == "joined" and not joined_supported(head_dim, bits, group_size)
  ):
    reason = reason or f"{bits}-bit codes at head_dim {head_dim}, group_size {group_size}"
    variant = "reshape"
  return variant, reason


def quantized_decode_attention_triton(
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
  variant=DEFAULT_VARIANT,
  **config,
):
  """(out f32 [B,H,G,D], lse f32 [B,H,G]); same contract as the reference.

  Default variant "folded" with `prefetch` on (the fastest measured on H100; KERNEL_NOTES v8).
  Variants "planar" / "joined" fall back to "reshape" where `planar_supported` /
  `joined_supported` is False; "folded" falls back to "joined" (then "reshape") where
  `folded_supported` is False or the query group exceeds `FOLDED_MAX_GROUP` (its
  stacked accumulator holds value_groups x rows x D floats: 64 registers per thread at 8 rows);
  a fallback variant runs without the folded-only settings (FOLDED_SETTINGS), so it computes
  GEAR's terms itself. `gear_terms` (folded) defaults to DEFAULT_GEAR_TERMS here; with "xla",
  GEAR's value terms are added here, after the split merge, from the scores the kernel wrote
  (`gear_terms_xla`).
  """
  gear = lowrank is not None or outliers is not None
  if gear and variant == "folded" and config.get("gear_terms") is None:
    config["gear_terms"] = DEFAULT_GEAR_TERMS
  variant, _ = variant_that_runs(
    variant,
    group=queries.shape[2],
    head_dim=queries.shape[3],
    bits=bits,
    group_size=group_size,
    gear_block=block if gear else None,
    config=config,
  )
  if variant != "folded":
    for name in FOLDED_SETTINGS:  # the fallback variants have no such loop or operands
      config.pop(name, None)
  partials = quantized_decode_attention_partials_triton(
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
    variant=variant,
    **config,
  )
  out, lse = merge_split_partials(*partials[:2], queries.shape[2])
  order = output_channel_order(
    queries.shape[3],
    bits,
    group_size,
    variant,
    compute_dtype_for(k_scale.dtype),
    config.get("channel_parts"),
  )
  if variant != "reshape":
    out = out[..., _inverse_permutation(order)]
  if len(partials) == 3:  # gear_terms="xla": GEAR's value terms from the kernel's scores
    out = out + gear_value_terms_from_scores(
      lowrank, outliers, partials[2], lse, lengths, block=block, head_dim=queries.shape[3]
    )
  return out, lse


def _inverse_permutation(order):
  inverse = np.empty_like(order)
  inverse[order] = np.arange(len(order), dtype=order.dtype)
  return inverse
