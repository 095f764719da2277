"""GPU decode attention over a full-precision K/V segment: Pallas with the Triton lowering.

One query position per row; all query heads of a KV head (GQA/MQA group) are one tile of
`rows` (the group padded to 16, the smallest tensor-core tile), so K and V are read once per
KV head. The sequence is split across `num_splits` parallel programs (flash-decoding); each
walks its blocks with an online softmax, stops at the row's length (blocks past it are never
loaded: the loop's trip count comes from the length), and writes a normalised partial output
and its log-sum-exp; `merge_split_partials` combines them.

The Triton lowering is deprecated in favour of Mosaic GPU (jax >= 0.11 emits a
DeprecationWarning when it lowers the kernel); `decode_attention_gpu.decode_attention_gpu` is the
one entry point, and picks this kernel or `decode_attention_mosaic_gpu`'s.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _compat
from pallas_kernels.base_two_softmax import natural_log_sum_exp
from pallas_kernels.splits import (
  SplitPlan,
  merge_split_partials,
  next_power_of_two,
  plan_full_precision_decode,
)

TILE_ROWS = 16  # smallest M of a tensor-core dot in Triton
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def unsupported_reason(queries, keys) -> str | None:
  """Why this kernel cannot take these shapes (None if it can)."""
  group, head_dim = queries.shape[2], queries.shape[3]
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return f"head_dim={head_dim} (supported: {SUPPORTED_HEAD_DIMS})"
  if group > 64:
    return f"query group {group} > 64"
  if keys.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    return f"cache dtype {keys.dtype}"
  return None


def tile_rows(group: int) -> int:
  return max(TILE_ROWS, next_power_of_two(group))


def load_token_rows(ref, first, count: int, valid, columns=slice(None)):
  """Rows first .. first + count - 1 of a [tokens, C] ref (`columns`: a slice of its C
  columns, all by default); rows where `valid` [count] is False read no memory and come back
  as 0."""
  return _compat.triton_load(ref.at[pl.ds(first, count), columns], mask=valid[:, None], other=0)


def _dot_nt(a, b):
  """a [M, K] . b [N, K]^T in float32 (tf32 tensor cores for f32 operands on GPU)."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def split_block_range(plan: SplitPlan, length, tokens: int):
  """(start, end, blocks) of this program's split (grid axis 2): its valid tokens are
  start .. end - 1 (end clipped to the row's `length` and the capacity), walked in
  ceil((end - start) / plan.block_tokens) blocks; zero blocks past the row's length."""
  start = pl.program_id(2) * plan.split_tokens
  end = jnp.minimum(jnp.minimum(start + plan.split_tokens, length), tokens)
  return start, end, (jnp.maximum(end - start, 0) + plan.block_tokens - 1) // plan.block_tokens


def softmax_step_numerators(running_max, scores, valid):
  """One block of the online softmax over base-2 scores [rows, block] (`base_two_softmax`)
  without the sum over tokens: (new_max, correction, probs), probs 0 where `valid` [block] is
  False. The caller rescales its accumulators (and its denominator) by `correction` [rows]. The
  first block of a split always holds a valid token, so new_max is finite from then on (no nan
  from -inf - -inf), even for a later block with none (planar's unroll tail)."""
  scores = jnp.where(valid[None, :], scores, -jnp.inf)
  new_max = jnp.maximum(running_max, scores.max(axis=1))
  return new_max, jnp.exp2(running_max - new_max), jnp.exp2(scores - new_max[:, None])


def online_softmax_step(running_max, running_sum, scores, valid):
  """`softmax_step_numerators` and the denominator: (new_max, new_sum, correction, probs)."""
  new_max, correction, probs = softmax_step_numerators(running_max, scores, valid)
  return new_max, running_sum * correction + probs.sum(axis=1), correction, probs


def store_split_partials(out_ref, lse_ref, running_max, running_sum, *accs):
  """Writes a split's partials from its online-softmax state: out = acc / sum (the `accs` are
  consecutive column blocks of out_ref [rows, D], one unless a kernel keeps its accumulator in
  channel groups) and lse = (max + log2(sum)) ln 2, in natural units from the base-2 state. A
  row with no valid token in this split writes out 0 and lse -inf, so it drops out of
  `merge_split_partials`."""
  nonempty = running_sum != 0  # a NaN sum is not empty: the NaN reaches out and lse
  safe_sum = jnp.where(nonempty, running_sum, 1.0)
  if len(accs) == 1:
    out_ref[...] = jnp.where(nonempty[:, None], accs[0] / safe_sum[:, None], 0.0)
  else:
    column = 0
    for acc in accs:
      width = acc.shape[1]
      out_ref[:, pl.ds(column, width)] = jnp.where(nonempty[:, None], acc / safe_sum[:, None], 0.0)
      column += width
  lse_ref[...] = jnp.where(nonempty, natural_log_sum_exp(running_max, safe_sum), -jnp.inf)


def _decode_kernel(
  lengths_ref,  # int32 [] (this row's length)
  queries_ref,  # [rows, D], pre-scaled by sm_scale log2(e), cache dtype
  keys_ref,  # [T, D] (this row and KV head)
  values_ref,  # [T, D]
  *rest,  # (unused aliased output buffers,) out_ref [rows, D] f32, lse_ref [rows] f32
  plan: SplitPlan,
  tokens: int,
):
  out_ref, lse_ref = rest[-2:]
  block = plan.block_tokens
  start, end, num_blocks = split_block_range(plan, lengths_ref[()], tokens)
  queries = queries_ref[...]
  rows, head_dim = queries.shape
  offsets = jnp.arange(block, dtype=jnp.int32)

  def body(i, carry):
    running_max, running_sum, acc = carry
    first = start + i * block
    valid = first + offsets < end  # [block]; masked lanes read no memory
    keys = load_token_rows(keys_ref, first, block, valid)
    scores = _dot_nt(queries, keys)  # [rows, block]
    running_max, running_sum, correction, probs = online_softmax_step(
      running_max, running_sum, scores, valid
    )
    values = load_token_rows(values_ref, first, block, valid)
    acc = acc * correction[:, None] + _dot_nn(probs.astype(values.dtype), values)
    return running_max, running_sum, acc

  init = (
    jnp.full((rows,), -jnp.inf, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
    jnp.zeros((rows, head_dim), jnp.float32),
  )
  running_max, running_sum, acc = jax.lax.fori_loop(0, num_blocks, body, init)
  store_split_partials(out_ref, lse_ref, running_max, running_sum, acc)


@functools.partial(
  jax.jit,
  static_argnames=(
    "sm_scale",
    "block_tokens",
    "num_splits",
    "num_warps",
    "num_stages",
    "interpret",
  ),
)
def decode_attention_partials_triton(
  queries: jax.Array,  # [B, H, G, D]
  keys: jax.Array,  # [B, H, T, D]
  values: jax.Array,  # [B, H, T, D]
  lengths: jax.Array,  # int32 [B]
  initial_partials: tuple[jax.Array, jax.Array] | None = None,
  *,
  sm_scale: float,
  block_tokens: int = 64,
  num_splits: int | None = None,
  num_warps: int = 4,
  num_stages: int = 2,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Per-split partials (out f32 [B,H,S,rows,D], lse f32 [B,H,S,rows]).

  `initial_partials`, if given, are the output buffers' starting contents (aliased): tests fill
  them with NaN to prove that the kernel writes every element.
  """
  reason = unsupported_reason(queries, keys)
  if reason is not None:  # the dispatch runs the reference for these; called directly, refused
    raise ValueError(f"the Triton decode-attention kernel does not take {reason}")
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
  row_spec = lambda *block: pl.BlockSpec(block, lambda b, h, s: (b, h) + (0,) * (len(block) - 2))
  in_specs = [
    pl.BlockSpec((None,), lambda b, h, s: (b,)),
    row_spec(None, None, rows, head_dim),
    row_spec(None, None, tokens, head_dim),
    row_spec(None, None, tokens, head_dim),
  ]
  out_specs = [
    pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
    pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
  ]
  out_shape = [
    jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows, head_dim), jnp.float32),
    jax.ShapeDtypeStruct((batch, kv_heads, plan.num_splits, rows), jnp.float32),
  ]
  args = [lengths.astype(jnp.int32), scaled_queries, keys, values]
  aliases = {}
  if initial_partials is not None:
    in_specs += out_specs
    aliases = {len(args): 0, len(args) + 1: 1}
    args += list(initial_partials)
  kernel = functools.partial(_decode_kernel, plan=plan, tokens=tokens)
  out, lse = pl.pallas_call(
    kernel,
    grid=(batch, kv_heads, plan.num_splits),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    input_output_aliases=aliases,
    compiler_params=_compat.triton_compiler_params(num_warps, num_stages),
    interpret=interpret,
    name="decode_attention_triton",
  )(*args)
  return out, lse


def decode_attention_triton(queries, keys, values, lengths, *, sm_scale: float, **config):
  """(out f32 [B,H,G,D], lse f32 [B,H,G]); same contract as `decode_attention_reference`."""
  out, lse = decode_attention_partials_triton(
    queries, keys, values, lengths, sm_scale=sm_scale, **config
  )
  return merge_split_partials(out, lse, queries.shape[2])
