"""Smoothing token scores along the sequence, and reducing a KV head's query group to one score."""

import jax
import jax.numpy as jnp

POOLINGS = ("max", "avg")
GQA_REDUCTIONS = ("mean", "max", "sum")


def check_pooling(method: str, pooling: str, kernel: int) -> None:
  if pooling not in POOLINGS:
    raise ValueError(f"{method}: pooling={pooling!r}; allowed: {', '.join(POOLINGS)}")
  if kernel < 1 or kernel % 2 == 0:
    raise ValueError(
      f"{method}: kernel={kernel} must be an odd integer >= 1 (pooling keeps the sequence "
      "length with padding kernel // 2; 1 disables pooling)"
    )


def check_gqa_reduce(method: str, gqa_reduce: str) -> None:
  if gqa_reduce not in GQA_REDUCTIONS:
    raise ValueError(f"{method}: gqa_reduce={gqa_reduce!r}; allowed: {', '.join(GQA_REDUCTIONS)}")


def pool_scores(
  scores: jax.Array,  # float32 [batch, ..., tokens], >= 0
  prefix_lengths: jax.Array,  # int32 [batch]: positions >= this are outside the pooled prefix
  *,
  kernel: int,
  pooling: str,
) -> jax.Array:  # float32 [batch, ..., tokens]
  """1-D pooling with stride 1 and padding kernel // 2 over each row's prefix (SnapKV).

  Matches PyTorch's `max_pool1d` / `avg_pool1d(count_include_pad=True)` applied to the prefix
  alone: positions past the prefix act as padding. Zero is a valid padding for max pooling
  because attention scores are non-negative and every window contains its (valid) centre.
  """
  if kernel == 1:
    return scores
  positions = jnp.arange(scores.shape[-1])
  inside = positions[None, :] < prefix_lengths[:, None]  # [batch, tokens]
  inside = inside.reshape(inside.shape[0], *([1] * (scores.ndim - 2)), inside.shape[1])
  padded = jnp.where(inside, scores, 0.0)
  window = (1,) * (scores.ndim - 1) + (kernel,)
  padding = ((0, 0),) * (scores.ndim - 1) + ((kernel // 2, kernel // 2),)
  if pooling == "max":
    return jax.lax.reduce_window(padded, 0.0, jax.lax.max, window, (1,) * scores.ndim, padding)
  summed = jax.lax.reduce_window(padded, 0.0, jax.lax.add, window, (1,) * scores.ndim, padding)
  return summed / kernel


def reduce_query_group(
  scores: jax.Array,  # [batch, kv_heads, group, tokens]
  gqa_reduce: str,
) -> jax.Array:  # [batch, kv_heads, tokens]
  """One score per KV head from the scores of the query heads that share it."""
  if gqa_reduce == "mean":
    return scores.mean(axis=2)
  if gqa_reduce == "max":
    return scores.max(axis=2)
  return scores.sum(axis=2)
