"""GEAR's low-rank and outlier terms computed by XLA around the decode kernel, not inside it.

Inside the kernel (`gear_terms_triton`, `gear_terms="kernel"`) every step is one GEAR block
of 64 tokens that builds one-hot [s, block] / [s, D] tiles for the outliers, stages them
through shared memory and multiplies them, and broadcasts the rank-r products: statically
3831 instructions and 70 barriers per 64 tokens for the folded GEAR-2 kernel, against 872
and 16 per 128 tokens for KIVI-2 (benchmarks/KERNEL_NOTES.md, v11). With `gear_terms="xla"`
the kernel sees only the quantized codes, as for a KIVI segment, and the rest goes around it:

  before: gear_score_bias  bias[g, t] = q[g] . (A_k[t] B_k[j(t)]^T + key outliers of token t),
          a dense [B, H, R, T] float32 that the kernel adds to its scores;
  after:  gear_value_terms_from_scores  out[g] += sum_t p[g, t] (A_v[t] B_v[j(t)]^T + value
          outliers of token t), p = exp2(s - lse log2(e)) from the base-2 scores s the kernel
          wrote (its softmax runs in base 2: `base_two_softmax`) and the segment's natural
          log-sum-exp.

Both are exact rewrites of the reference's terms (`quantized_decode_attention_reference`): the
terms are linear in q and in the normalised probabilities. The kernel reads the bias and
writes the scores, 16 bytes each per token and KV head at a query group of 4.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.base_two_softmax import LOG2_E

GEAR_TERMS = ("kernel", "xla")  # where GEAR's low-rank and outlier terms are computed

# The value outliers are summed into this many partial [D, G] accumulators per KV head (GEAR
# block j adds into j mod OUTLIER_SLOTS), then the partials are added. With one accumulator all
# of a head's outliers meet on D addresses, and the atomic adds of the scatter serialise. On an
# H100 at 32k (batch 8, 8 KV heads, query group 4, 2% outliers; benchmarks/gear_terms_parts.py,
# KERNEL_NOTES v13): one scalar per outlier and query row into one accumulator 1366 us, into 32
# accumulators 390 us; one G-window per outlier into 32 accumulators (this) 347 us.
OUTLIER_SLOTS = 32


def check_gear_terms(gear_terms) -> None:
  """ValueError unless `gear_terms` is one of GEAR_TERMS or None (the default, "kernel")."""
  if gear_terms is not None and gear_terms not in GEAR_TERMS:
    raise ValueError(
      f"gear_terms={gear_terms!r} is not supported; allowed: {', '.join(GEAR_TERMS)} "
      "or None (kernel)"
    )


def outlier_tokens_and_channels(index: jax.Array, block: int, head_dim: int):
  """int32 [B, H, J, s] token and channel of each outlier of the stored [B, H, J, s] flat
  indices (t_local * D + c within GEAR block j). An index outside its block (storage past a
  row's length may hold anything) is clipped into it: a negative one would otherwise name a
  token of an earlier block, inside the length."""
  index = jnp.clip(index.astype(jnp.int32), 0, block * head_dim - 1)
  block_start = (jnp.arange(index.shape[2], dtype=jnp.int32) * block)[:, None]
  return block_start + index // head_dim, index % head_dim


def _outlier_positions(index: jax.Array, block: int, head_dim: int):
  """int32 [B, H, J * s] token and channel of each outlier, GEAR blocks flattened with them."""
  flat = lambda x: x.reshape(*x.shape[:2], -1)
  token, channel = outlier_tokens_and_channels(index, block, head_dim)
  return flat(token), flat(channel)


def gear_score_bias(
  lowrank, outliers, scaled_queries: jax.Array, *, tokens: int, block: int
) -> jax.Array:
  """float32 [B, H, R, tokens]: GEAR's addition to the scores (low rank, then key outliers;
  either may be None).

  scaled_queries float32 [B, H, R, D]: the queries times sm_scale (times log2(e) for the GPU
  kernels' base-2 scores; the bias is linear in them) in natural channel order (padding rows
  give padding rows); lowrank / outliers as the reference takes them."""
  batch, kv_heads, rows, _ = scaled_queries.shape
  blocks = tokens // block
  bias = jnp.zeros((batch, kv_heads, rows, tokens), jnp.float32)
  if lowrank is not None:
    k_a, k_b = lowrank[0], lowrank[1]  # [B, H, T, r], [B, H, J, D, r]
    rank = k_a.shape[-1]
    # Products and sums, not einsums: XLA's GPU backend turns these contractions (over r = 4,
    # and over D for r = 4 outputs) into batched GEMMs of a few rows, with the bias written
    # token-minor then transposed and B_k transposed first; as reductions they are two
    # fusions that read each array once (benchmarks/xla_kernel_bytes.py, KERNEL_NOTES v21).
    q_b = jnp.sum(
      scaled_queries[:, :, :, None, :, None] * k_b.astype(jnp.float32)[:, :, None], axis=4
    )  # [B, H, R, J, r]
    k_a = k_a.astype(jnp.float32).reshape(batch, kv_heads, 1, blocks, block, rank)
    bias = sum(q_b[..., None, i] * k_a[..., i] for i in range(rank)).reshape(bias.shape)
  if outliers is not None:
    token, contribution = key_outlier_contributions(outliers, scaled_queries, block=block)
    b, h, g = jnp.ogrid[:batch, :kv_heads, :rows]
    bias = bias.at[b[..., None], h[..., None], g[..., None], token[:, :, None, :]].add(contribution)
  return bias


def key_outlier_contributions(outliers, scaled_queries: jax.Array, *, block: int):
  """(token int32 [B, H, N], contribution float32 [B, H, R, N]) of the N key outliers: where
  each sits, and what it adds to that token's score in every query row, q[r, channel] * value."""
  token, channel = _outlier_positions(outliers[0], block, scaled_queries.shape[-1])
  q_at_channel = jnp.take_along_axis(scaled_queries, channel[:, :, None, :], axis=-1)
  value = outliers[1].astype(jnp.float32).reshape(token.shape)[:, :, None, :]
  return token, q_at_channel * value


def value_outlier_terms(
  outliers,
  probs: jax.Array,
  lengths: jax.Array,
  *,
  block: int,
  head_dim: int,
  slots: int | None = None,
) -> jax.Array:
  """float32 [B, H, G, D]: sum over value outliers i of p[g, token_i] * value_i at channel_i.

  probs float32 [B, H, G, T]; lengths int32 [B]: outliers at or past a row's length add
  nothing, whatever they hold (a GEAR block past the length may hold NaN values and indices
  pointing anywhere, and p = 0 times NaN is NaN). Each outlier adds one G-vector: the
  probabilities are gathered and scattered as windows of G contiguous floats ([B, H, T, G] and
  [B, H, slots, D, G]), one index per outlier instead of one per outlier and query row; GEAR
  block j adds into partial accumulator j mod `slots` (default OUTLIER_SLOTS; at most the
  number of blocks)."""
  batch, kv_heads, group, _ = probs.shape
  token, channel = _outlier_positions(outliers[2], block, head_dim)  # [B, H, J s]
  per_block = outliers[2].shape[-1]
  slots = min(OUTLIER_SLOTS if slots is None else slots, outliers[2].shape[2])
  slot = (jnp.arange(token.shape[-1], dtype=jnp.int32) // per_block) % slots
  b = jnp.arange(batch)[:, None, None]
  h = jnp.arange(kv_heads)[None, :, None]
  p_at_token = jnp.swapaxes(probs, 2, 3)[b, h, token]  # [B, H, J s, G]
  weighted = p_at_token * outliers[3].astype(jnp.float32).reshape(token.shape)[..., None]
  weighted = jnp.where((token < lengths[:, None, None])[..., None], weighted, 0.0)
  partials = jnp.zeros((batch, kv_heads, slots, head_dim, group), jnp.float32)
  partials = partials.at[b, h, slot[None, None, :], channel].add(weighted)
  return jnp.swapaxes(partials.sum(axis=2), 2, 3)


def normalised_probabilities(scores: jax.Array, lse: jax.Array, lengths: jax.Array) -> jax.Array:
  """float32 [B, H, G, T]: the segment's softmax probabilities, 0 at and past a row's length.

  scores, lse, lengths as `gear_value_terms_from_scores` takes them (G = lse's rows)."""
  group = lse.shape[-1]
  inside = (jnp.arange(scores.shape[-1]) < lengths[:, None])[:, None, None, :]  # [B, 1, 1, T]
  scores = jnp.where(inside, scores[:, :, :group], 0.0)
  return jnp.where(inside, jnp.exp2(scores - lse[..., None] * LOG2_E), 0.0)


def gear_value_terms_from_scores(
  lowrank,
  outliers,
  scores: jax.Array,
  lse: jax.Array,
  lengths: jax.Array,
  *,
  block: int,
  head_dim: int,
  outlier_slots: int | None = None,
) -> jax.Array:
  """float32 [B, H, G, D]: GEAR's addition to the segment's normalised output.

  scores float32 [B, H, >= G, T] as the kernel's softmax saw them, base-2 logits (s log2(e);
  entries at or past a row's length are never read: the kernel does not write them); lse
  float32 [B, H, G], the segment's log-sum-exp in natural units; lengths int32 [B];
  outlier_slots: `value_outlier_terms`' slots. GEAR's storage past a row's length (A rows,
  and B factors and outliers of blocks starting there) adds nothing, whatever it holds."""
  batch, kv_heads, group = lse.shape
  tokens = scores.shape[-1]
  blocks = tokens // block
  probs = normalised_probabilities(scores, lse, lengths)
  terms = jnp.zeros((batch, kv_heads, group, head_dim), jnp.float32)
  if lowrank is not None:
    v_a, v_b = lowrank[2], lowrank[3]  # [B, H, T, r], [B, H, J, D, r]
    # Zeroed past the length: p = 0 there, and 0 times NaN is NaN.
    inside = jnp.arange(tokens) < lengths[:, None]  # [B, T]
    live_blocks = jnp.arange(blocks) * block < lengths[:, None]  # [B, J]
    # In the storage dtype: XLA on the CPU writes the selected factors out (48 MiB at batch 8,
    # 8 KV heads x 4, 32k tokens, rank 4; 96 in f32). Whether a GPU's fusion reads them in
    # place is unmeasured (`benchmarks/gear_terms_parts.py`, the value-terms rows).
    v_a = jnp.where(inside[:, None, :, None], v_a, jnp.zeros((), v_a.dtype))
    v_b = jnp.where(live_blocks[:, None, :, None, None], v_b, jnp.zeros((), v_b.dtype))
    # Reductions, not einsums, as in gear_score_bias: this reads B_v in place instead of
    # transposing it for a GEMM, and takes no GEMM with a contraction of r.
    v_a = v_a.astype(jnp.float32).reshape(batch, kv_heads, 1, blocks, block, v_a.shape[-1])
    probs_blocks = probs.reshape(batch, kv_heads, group, blocks, block)
    p_a = jnp.sum(probs_blocks[..., None] * v_a, axis=4)  # [B, H, G, J, r]
    terms = jnp.sum(
      p_a[:, :, :, :, None, :] * v_b.astype(jnp.float32)[:, :, None], axis=(3, 5)
    )  # [B, H, G, D]
  if outliers is not None:
    terms = terms + value_outlier_terms(
      outliers, probs, lengths, block=block, head_dim=head_dim, slots=outlier_slots
    )
  return terms
