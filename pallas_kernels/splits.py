"""Flash-decoding bookkeeping shared by the kernels: how the sequence is split across parallel
programs, padding the query group to the kernels' row count, and the log-sum-exp merge."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import _compat
from pallas_kernels.base_two_softmax import base_two_queries
from pallas_kernels.launch_settings import check_launch_settings

# Default flash-decoding split of the GPU kernels: enough programs for ~16 per SM, so rows of
# unequal length and the last wave balance out (H100 run 1: 32 splits beat 9 by 10-15% at batch
# 8 x 8 KV heads).
GPU_TARGET_PROGRAMS_PER_SM = 16


def gpu_target_programs() -> int:
  """Programs the GPU kernels' split planner aims for on this device."""
  return GPU_TARGET_PROGRAMS_PER_SM * _compat.gpu_multiprocessor_count()


class SplitPlan(NamedTuple):
  block_tokens: int  # tokens per inner-loop step (a power of two)
  num_splits: int  # parallel programs along the sequence per (row, KV head)
  blocks_per_split: int

  @property
  def split_tokens(self) -> int:
    return self.block_tokens * self.blocks_per_split


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def next_power_of_two(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def plan_splits(
  tokens: int,
  block_tokens: int,
  rows_times_heads: int,
  num_splits: int | None,
  target_programs: int,
  blocks_multiple: int = 1,
) -> SplitPlan:
  """Splits `tokens` into `num_splits` ranges of whole blocks (None: enough to reach about
  `target_programs` programs in all), each a multiple of `blocks_multiple` blocks (fewer splits
  where that needs them). Trailing empty splits are dropped. A kernel needs something to
  split: `tokens` and `rows_times_heads` >= 1 (the dispatch runs the reference otherwise)."""
  if tokens < 1 or rows_times_heads < 1:
    raise ValueError(
      f"a decode kernel needs at least one token slot and one (row, KV head); got capacity "
      f"{tokens} and batch x kv_heads = {rows_times_heads} (attention_dispatch runs the jnp "
      "reference for such a segment)"
    )
  total_blocks = cdiv(tokens, block_tokens)
  if num_splits is None:
    num_splits = cdiv(target_programs, rows_times_heads)
  else:
    check_launch_settings({"num_splits": num_splits})
  # More splits than blocks would leave splits empty: one block each is the most there are.
  num_splits = max(1, min(int(num_splits), total_blocks))
  blocks_per_split = cdiv(cdiv(total_blocks, num_splits), blocks_multiple) * blocks_multiple
  num_splits = cdiv(total_blocks, blocks_per_split)
  return SplitPlan(block_tokens, num_splits, blocks_per_split)


def plan_full_precision_decode(
  queries: jax.Array,  # [B, H, G, D]
  keys: jax.Array,  # [B, H, T, D]
  *,
  rows: int,
  sm_scale: float,
  block_tokens: int,
  num_splits: int | None,
) -> tuple[SplitPlan, jax.Array]:
  """The split plan of a full-precision segment and its queries, pre-scaled by sm_scale log2(e)
  (the GPU kernels' softmax runs in base 2: `base_two_softmax`) and padded to `rows` in the
  cache dtype (what both GPU full-precision kernels start from)."""
  batch, kv_heads = queries.shape[:2]
  plan = plan_splits(
    keys.shape[2], block_tokens, batch * kv_heads, num_splits, gpu_target_programs()
  )
  scaled_queries = pad_query_group(base_two_queries(queries, sm_scale), rows, keys.dtype)
  return plan, scaled_queries


def pad_query_group(queries: jax.Array, rows: int, dtype) -> jax.Array:
  """[B,H,G,D] -> [B,H,rows,D] in `dtype`, zero rows appended (their outputs are dropped)."""
  group = queries.shape[2]
  queries = queries.astype(dtype)
  if rows == group:
    return queries
  return jnp.pad(queries, ((0, 0), (0, 0), (0, rows - group), (0, 0)))


def merge_split_partials(
  out_partials: jax.Array,  # f32 [B, H, S, rows, D] (or [B, H, S, D, rows]): normalised outputs
  lse_partials: jax.Array,  # f32 [B, H, S, rows]: each split's log-sum-exp (-inf if empty)
  group: int,
  *,
  head_dim_last: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """Exact merge over the splits, keeping the first `group` rows: (out [B,H,G,D], lse [B,H,G]).

  head_dim_last=False takes the outputs transposed, [B, H, S, D, rows] (a kernel that keeps its
  accumulator with the head dim on the tensor core's M side), and merges them without a
  transpose."""
  lse_partials = lse_partials[:, :, :, :group]
  total = jax.nn.logsumexp(lse_partials, axis=2)  # -inf where every split is empty
  # Only an empty split (lse -inf) drops out; a NaN one makes the merge NaN.
  safe_total = jnp.where(total == -jnp.inf, 0.0, total)
  weights = jnp.where(lse_partials == -jnp.inf, 0.0, jnp.exp(lse_partials - safe_total[:, :, None]))
  if head_dim_last:
    out = jnp.einsum("bhsg,bhsgd->bhgd", weights, out_partials[:, :, :, :group])
  else:
    out = jnp.einsum("bhsg,bhsdg->bhgd", weights, out_partials[..., :group])
  return out, total
