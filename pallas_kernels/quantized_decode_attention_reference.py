"""Pure-jnp decode attention over a quantized (KIVI / GEAR) K/V segment.

It is the reference the kernels are tested against and the CPU decode path, so it never
materialises dequantized K/V for the whole sequence: it scans the segment in chunks of a few
hundred tokens with an online softmax, and inside a chunk it uses the decomposition

    q . K_hat[t]  = (q * k_scale[g(t)]) . codes[t] + q . k_min[g(t)]  (+ (q B_j) . A[t] + q . S[t])
    sum_t p_t V_hat[t] = sum_t (p_t * v_scale[t]) codes[t] + sum_t p_t v_min[t]
                         (+ (sum_t p_t A[t]) B_j^T + sum_t p_t S[t])

Storage (all arrays [batch, kv_heads, ...]; see DESIGN.md "Quantized storage"):
  k_codes uint32 [B, H, T, D*bits/32] planar-packed along head_dim (`bit_packing`),
  k_scale, k_min [B, H, T/group_size, D]  (per channel, groups of `group_size` tokens),
  v_codes uint32 [B, H, T, D*bits/32],
  v_scale, v_min [B, H, T, D/group_size]  (per token, groups of `group_size` channels).
GEAR extras, per block of `block` tokens (block j holds tokens [j*block, (j+1)*block)):
  lowrank = (k_a [B,H,T,r], k_b [B,H,T/block,D,r], v_a, v_b): K[t] += k_a[t] @ k_b[j].T;
  outliers = (k_index [B,H,T/block,s], k_value [B,H,T/block,s], v_index, v_value):
    flat index t_local*D + d within the block; K[j*block + t_local, d] += value. The caches
    store the index as uint16 where a block has at most 2^16 elements (`outlier_index_dtype`);
    any integer dtype is accepted.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.bit_packing import check_bits, unpack_codes

# Outlier indices are flat positions within one block; below this many elements they fit uint16.
_UINT16_POSITIONS = 1 << 16


def outlier_index_dtype(block_elements: int):
  """The dtype GEAR's outlier indices are stored in, for blocks of `block_elements` (block x
  head_dim) entries: uint16 (2 bytes instead of 4 per outlier) where every position fits."""
  return jnp.uint16 if block_elements <= _UINT16_POSITIONS else jnp.int32


# Chunk length the reference scans by (rounded to the storage's granularity): large enough
# that each step is a few batched matmuls, small enough that a chunk's dequantized
# intermediates stay in cache.
REFERENCE_CHUNK_TOKENS = 512


class QuantizedSegmentShape(NamedTuple):
  """Static sizes of a quantized segment, read off the arrays and checked for consistency."""

  batch: int
  kv_heads: int
  group: int  # query heads per KV head
  head_dim: int
  tokens: int  # segment capacity T
  words: int  # uint32 words per token row (head_dim * bits / 32)
  rank: int  # GEAR low rank (0 without low-rank factors)
  outliers_per_block: int  # GEAR outlier count per block (0 without outliers)


def check_quantized_inputs(
  queries,
  k_codes,
  k_scale,
  k_min,
  v_codes,
  v_scale,
  v_min,
  lengths,
  *,
  bits: int,
  group_size: int,
  lowrank=None,
  outliers=None,
  block: int = 64,
) -> QuantizedSegmentShape:
  """Raises ValueError naming the offending parameter; returns the segment's static sizes.

  Only shapes and dtypes are read, so this runs before tracing (and on tracers).
  """
  check_bits(bits)
  if queries.ndim != 4:
    raise ValueError(
      f"queries must be [batch, kv_heads, group, head_dim], got shape {queries.shape}"
    )
  batch, kv_heads, group, head_dim = queries.shape
  if not isinstance(group_size, int) or group_size <= 0:
    raise ValueError(f"group_size={group_size!r} must be a positive int")
  per_word = 32 // bits
  if head_dim % per_word != 0:
    raise ValueError(f"head_dim={head_dim} must be a multiple of 32 // bits = {per_word}")
  words = head_dim // per_word
  if k_codes.ndim != 4 or k_codes.shape[:2] != (batch, kv_heads) or k_codes.shape[3] != words:
    raise ValueError(
      f"k_codes must be uint32 [{batch}, {kv_heads}, tokens, {words}] for bits={bits}, "
      f"head_dim={head_dim}; got {k_codes.shape}"
    )
  tokens = k_codes.shape[2]
  for name, array in (("k_codes", k_codes), ("v_codes", v_codes)):
    if array.dtype != jnp.uint32:
      raise ValueError(f"{name} must be uint32 (planar-packed codes), got {array.dtype}")
  if v_codes.shape != k_codes.shape:
    raise ValueError(f"v_codes shape {v_codes.shape} must equal k_codes shape {k_codes.shape}")
  if tokens % group_size != 0:
    raise ValueError(f"group_size={group_size} must divide the segment capacity {tokens}")
  if head_dim % group_size != 0:
    raise ValueError(f"group_size={group_size} must divide head_dim={head_dim} (value groups)")
  key_stat_shape = (batch, kv_heads, tokens // group_size, head_dim)
  for name, array in (("k_scale", k_scale), ("k_min", k_min)):
    if array.shape != key_stat_shape:
      raise ValueError(f"{name} must have shape {key_stat_shape}, got {array.shape}")
  value_stat_shape = (batch, kv_heads, tokens, head_dim // group_size)
  for name, array in (("v_scale", v_scale), ("v_min", v_min)):
    if array.shape != value_stat_shape:
      raise ValueError(f"{name} must have shape {value_stat_shape}, got {array.shape}")
  if lengths.shape != (batch,):
    raise ValueError(f"lengths must have shape ({batch},), got {lengths.shape}")
  rank = 0
  outliers_per_block = 0
  if lowrank is not None or outliers is not None:
    if not isinstance(block, int) or block <= 0 or tokens % block != 0:
      raise ValueError(f"block={block!r} must be a positive int dividing the capacity {tokens}")
    if block % group_size != 0:
      raise ValueError(f"block={block} must be a multiple of group_size={group_size}")
  if lowrank is not None:
    if len(lowrank) != 4:
      raise ValueError("lowrank must be (k_a, k_b, v_a, v_b) or None")
    k_a, k_b, v_a, v_b = lowrank
    rank = k_a.shape[-1]
    a_shape = (batch, kv_heads, tokens, rank)
    b_shape = (batch, kv_heads, tokens // block, head_dim, rank)
    for name, array, shape in (
      ("k_a", k_a, a_shape),
      ("v_a", v_a, a_shape),
      ("k_b", k_b, b_shape),
      ("v_b", v_b, b_shape),
    ):
      if array.shape != shape:
        raise ValueError(f"lowrank {name} must have shape {shape}, got {array.shape}")
  if outliers is not None:
    if len(outliers) != 4:
      raise ValueError("outliers must be (k_index, k_value, v_index, v_value) or None")
    k_index, k_value, v_index, v_value = outliers
    outliers_per_block = k_index.shape[-1]
    shape = (batch, kv_heads, tokens // block, outliers_per_block)
    for name, array in (
      ("k_index", k_index),
      ("k_value", k_value),
      ("v_index", v_index),
      ("v_value", v_value),
    ):
      if array.shape != shape:
        raise ValueError(f"outliers {name} must have shape {shape}, got {array.shape}")
    for name, array in (("k_index", k_index), ("v_index", v_index)):
      if not jnp.issubdtype(array.dtype, jnp.integer):
        raise ValueError(f"outliers {name} must be an integer array, got {array.dtype}")
  return QuantizedSegmentShape(
    batch, kv_heads, group, head_dim, tokens, words, rank, outliers_per_block
  )


def _chunk_tokens(tokens: int, granularity: int, target: int) -> int:
  """Largest multiple of `granularity` dividing `tokens` and at most max(target, granularity)."""
  best = granularity
  for multiple in range(1, tokens // granularity + 1):
    size = multiple * granularity
    if size > max(target, granularity):
      break
    if tokens % size == 0:
      best = size
  return best


def quantized_decode_attention_reference(
  queries: jax.Array,  # [B, H, G, D]
  k_codes: jax.Array,  # uint32 [B, H, T, D*bits/32]
  k_scale: jax.Array,  # [B, H, T/group_size, D]
  k_min: jax.Array,  # [B, H, T/group_size, D]
  v_codes: jax.Array,  # uint32 [B, H, T, D*bits/32]
  v_scale: jax.Array,  # [B, H, T, D/group_size]
  v_min: jax.Array,  # [B, H, T, D/group_size]
  lengths: jax.Array,  # int32 [B]: slots [0, length) are valid
  *,
  bits: int,
  group_size: int,
  sm_scale: float,
  lowrank=None,
  outliers=None,
  block: int = 64,
  chunk_tokens: int = REFERENCE_CHUNK_TOKENS,
) -> tuple[jax.Array, jax.Array]:
  """(out f32 [B,H,G,D], lse f32 [B,H,G]) of one query position over K_hat = deq + S + A B^T.

  A row with length 0 gives out 0 and lse -inf, so partials merge with
  `merge_attention_partials`.
  """
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
  batch, kv_heads, group, head_dim, tokens = sizes[:5]
  gear = lowrank is not None or outliers is not None
  granularity = math.lcm(group_size, block) if gear else group_size
  chunk = _chunk_tokens(tokens, granularity, chunk_tokens)
  num_chunks = tokens // chunk
  key_groups = chunk // group_size  # key quantization groups per chunk
  value_groups = head_dim // group_size  # value quantization groups per token
  blocks = chunk // block if gear else 0  # GEAR blocks per chunk

  f32 = jnp.float32
  q = queries.astype(f32) * sm_scale  # [B,H,G,D]; sm_scale folded in once
  lengths = lengths.astype(jnp.int32)

  def split_chunks(array, per_chunk):  # [B,H,N*per_chunk,...] -> [N,B,H,per_chunk,...]
    array = array.reshape(batch, kv_heads, num_chunks, per_chunk, *array.shape[3:])
    return jnp.moveaxis(array, 2, 0)

  xs = {
    "k_codes": split_chunks(k_codes, chunk),
    "k_scale": split_chunks(k_scale, key_groups),
    "k_min": split_chunks(k_min, key_groups),
    "v_codes": split_chunks(v_codes, chunk),
    "v_scale": split_chunks(v_scale, chunk),
    "v_min": split_chunks(v_min, chunk),
    "start": jnp.arange(num_chunks, dtype=jnp.int32) * chunk,
  }
  if lowrank is not None:
    k_a, k_b, v_a, v_b = lowrank
    xs.update(
      k_a=split_chunks(k_a, chunk),
      k_b=split_chunks(k_b, blocks),
      v_a=split_chunks(v_a, chunk),
      v_b=split_chunks(v_b, blocks),
    )
  if outliers is not None:
    k_index, k_value, v_index, v_value = outliers
    xs.update(
      k_index=split_chunks(k_index, blocks),
      k_value=split_chunks(k_value, blocks),
      v_index=split_chunks(v_index, blocks),
      v_value=split_chunks(v_value, blocks),
    )

  def chunk_scores_and_values(x):
    """Scores [B,H,G,chunk] and a function mapping probabilities to sum_t p_t V_hat[t]."""
    k_code = unpack_codes(x["k_codes"], bits).astype(f32)  # [B,H,C,D]
    k_code = k_code.reshape(batch, kv_heads, key_groups, group_size, head_dim)
    scaled_q = q[:, :, :, None, :] * x["k_scale"].astype(f32)[:, :, None]  # [B,H,G,n,D]
    scores = jnp.einsum("bhgnd,bhnkd->bhgnk", scaled_q, k_code)
    scores = scores + jnp.einsum("bhgd,bhnd->bhgn", q, x["k_min"].astype(f32))[..., None]
    scores = scores.reshape(batch, kv_heads, group, chunk)
    if lowrank is not None:
      q_b = jnp.einsum("bhgd,bhjdr->bhgjr", q, x["k_b"].astype(f32))
      k_a_blocks = x["k_a"].astype(f32).reshape(batch, kv_heads, blocks, block, -1)
      scores = scores + jnp.einsum("bhgjr,bhjkr->bhgjk", q_b, k_a_blocks).reshape(scores.shape)
    if outliers is not None:
      index = x["k_index"].astype(jnp.int32)  # [B,H,J,s]
      token_in_block, channel = index // head_dim, index % head_dim
      q_at_channel = jnp.take_along_axis(
        q[:, :, :, None, :], channel[:, :, None, :, :], axis=-1
      )  # [B,H,G,J,s]
      contribution = q_at_channel * x["k_value"].astype(f32)[:, :, None]
      token_one_hot = jax.nn.one_hot(token_in_block, block, dtype=f32)  # [B,H,J,s,block]
      scores = scores + jnp.einsum("bhgjs,bhjsk->bhgjk", contribution, token_one_hot).reshape(
        scores.shape
      )

    def weighted_values(probs, live_tokens):  # [B,H,G,C], bool [B,C] -> [B,H,G,D]
      """Value-side storage past the length may hold anything (NaN): it is zeroed, so that a
      probability of 0 times NaN cannot reach the output. Token rows past the length, and GEAR
      blocks starting past it (their B factors and outliers)."""

      def live(array, mask):  # mask [B, n] over the array's third axis
        mask = mask.reshape(mask.shape[:1] + (1,) + mask.shape[1:] + (1,) * (array.ndim - 3))
        return jnp.where(mask, array.astype(f32), 0.0)

      v_code = unpack_codes(x["v_codes"], bits).astype(f32)
      v_code = v_code.reshape(batch, kv_heads, chunk, value_groups, group_size)
      scaled_p = probs[..., None] * live(x["v_scale"], live_tokens)[:, :, None]  # [B,H,G,C,n]
      out = jnp.einsum("bhgtc,bhtce->bhgce", scaled_p, v_code)
      out = out + jnp.einsum("bhgt,bhtc->bhgc", probs, live(x["v_min"], live_tokens))[..., None]
      out = out.reshape(batch, kv_heads, group, head_dim)
      if lowrank is not None or outliers is not None:
        probs_blocks = probs.reshape(batch, kv_heads, group, blocks, block)
        live_blocks = live_tokens[:, ::block]  # [B, J]: live where the block's first token is
      if lowrank is not None:
        v_a_blocks = live(x["v_a"], live_tokens).reshape(batch, kv_heads, blocks, block, -1)
        p_a = jnp.einsum("bhgjk,bhjkr->bhgjr", probs_blocks, v_a_blocks)
        out = out + jnp.einsum("bhgjr,bhjdr->bhgd", p_a, live(x["v_b"], live_blocks))
      if outliers is not None:
        index = x["v_index"].astype(jnp.int32)
        token_in_block, channel = index // head_dim, index % head_dim
        p_at_token = jnp.take_along_axis(
          probs_blocks, token_in_block[:, :, None], axis=-1
        )  # [B,H,G,J,s]
        # Where the product, not the value: a dead block's index may point anywhere, and an
        # index past the block gathers NaN.
        weighted = jnp.where(
          live_blocks[:, None, None, :, None], p_at_token * x["v_value"].astype(f32)[:, :, None], 0
        )
        channel_one_hot = jax.nn.one_hot(channel, head_dim, dtype=f32)  # [B,H,J,s,D]
        out = out + jnp.einsum("bhgjs,bhjsd->bhgd", weighted, channel_one_hot)
      return out

    return scores, weighted_values

  def step(carry, x):
    running_max, running_sum, acc = carry  # [B,H,G], [B,H,G], [B,H,G,D]

    def attend(carry):
      running_max, running_sum, acc = carry
      scores, weighted_values = chunk_scores_and_values(x)
      token = x["start"] + jnp.arange(chunk, dtype=jnp.int32)
      live_tokens = token[None, :] < lengths[:, None]  # [B, C]
      valid = live_tokens[:, None, None, :]  # [B,1,1,C]
      scores = jnp.where(valid, scores, -jnp.inf)
      new_max = jnp.maximum(running_max, scores.max(axis=-1))
      # A row with no valid token so far keeps max -inf: subtract 0 instead, so no inf - inf.
      safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
      probs = jnp.where(valid, jnp.exp(scores - safe_max[..., None]), 0.0)
      correction = jnp.where(jnp.isfinite(running_max), jnp.exp(running_max - safe_max), 0.0)
      running_sum = running_sum * correction + probs.sum(axis=-1)
      acc = acc * correction[..., None] + weighted_values(probs, live_tokens)
      return new_max, running_sum, acc

    # Chunks past every row's length are skipped outright (capacity is static, lengths are not).
    carry = jax.lax.cond(x["start"] < lengths.max(initial=0), attend, lambda c: c, carry)
    return carry, None

  init = (
    jnp.full((batch, kv_heads, group), -jnp.inf, f32),
    jnp.zeros((batch, kv_heads, group), f32),
    jnp.zeros((batch, kv_heads, group, head_dim), f32),
  )
  (running_max, running_sum, acc), _ = jax.lax.scan(step, init, xs)
  nonempty = running_sum != 0  # a NaN sum is not empty: the NaN reaches out and lse
  out = jnp.where(nonempty[..., None], acc / jnp.where(nonempty, running_sum, 1.0)[..., None], 0.0)
  lse = jnp.where(nonempty, running_max + jnp.log(jnp.where(nonempty, running_sum, 1.0)), -jnp.inf)
  return out, lse


def dequantize_segment(
  k_codes,
  k_scale,
  k_min,
  v_codes,
  v_scale,
  v_min,
  *,
  bits: int,
  group_size: int,
  lowrank=None,
  outliers=None,
  block: int = 64,
) -> tuple[jax.Array, jax.Array]:
  """Materialised K_hat, V_hat f32 [B,H,T,D] (tests and small inputs only, never the hot path)."""
  f32 = jnp.float32
  k = unpack_codes(k_codes, bits).astype(f32)
  v = unpack_codes(v_codes, bits).astype(f32)
  batch, kv_heads, tokens, head_dim = k.shape
  k = k * jnp.repeat(k_scale.astype(f32), group_size, axis=2) + jnp.repeat(
    k_min.astype(f32), group_size, axis=2
  )
  v = v * jnp.repeat(v_scale.astype(f32), group_size, axis=3) + jnp.repeat(
    v_min.astype(f32), group_size, axis=3
  )
  if lowrank is not None:
    k_a, k_b, v_a, v_b = (x.astype(f32) for x in lowrank)
    k = k + jnp.einsum("bhtr,bhtdr->bhtd", k_a, jnp.repeat(k_b, block, axis=2))
    v = v + jnp.einsum("bhtr,bhtdr->bhtd", v_a, jnp.repeat(v_b, block, axis=2))
  if outliers is not None:
    k_index, k_value, v_index, v_value = outliers

    def add_sparse(dense, index, value):
      blocks = tokens // block
      flat = dense.reshape(batch, kv_heads, blocks, block * head_dim)
      b, h, j = jnp.meshgrid(
        jnp.arange(batch), jnp.arange(kv_heads), jnp.arange(blocks), indexing="ij"
      )
      flat = flat.at[b[..., None], h[..., None], j[..., None], index].add(value.astype(f32))
      return flat.reshape(dense.shape)

    k = add_sparse(k, k_index, k_value)
    v = add_sparse(v, v_index, v_value)
  return k, v
