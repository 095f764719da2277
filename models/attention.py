"""Grouped-query self-attention whose K/V live in a kvjax layer cache passed in and returned."""

from einops import rearrange
from flax import nnx

from kvjax.cache_protocol import append_and_attend
from kvjax.chunk_attention import chunk_attention
from kvjax.prefill_attention import cache_prompt_attention
from kvjax.rope import apply_rope, rope_inverse_frequencies
from models.config import DecoderConfig


class CachedAttention(nnx.Module):
  def __init__(self, config: DecoderConfig, *, dtype, rngs: nnx.Rngs):
    self.num_heads = config.num_heads
    self.num_kv_heads = config.num_kv_heads
    self.head_dim = config.head_dim
    self.sliding_window = config.sliding_window
    self.sm_scale = config.head_dim**-0.5
    self.rope = (config.head_dim, config.rope_theta, config.rope_scaling)
    linear = lambda i, o: nnx.Linear(
      i, o, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
    )
    self.q_proj = linear(config.hidden_size, config.num_heads * config.head_dim)
    self.k_proj = linear(config.hidden_size, config.num_kv_heads * config.head_dim)
    self.v_proj = linear(config.hidden_size, config.num_kv_heads * config.head_dim)
    self.o_proj = linear(config.num_heads * config.head_dim, config.hidden_size)

  def project(self, x, positions):
    """q [b, kv_heads, group, t, d], k and v [b, kv_heads, t, d], rotated at `positions`."""
    inv_freq = rope_inverse_frequencies(*self.rope)  # a trace-time constant
    q = self.q_proj(x).reshape(*x.shape[:2], self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(*x.shape[:2], self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(*x.shape[:2], self.num_kv_heads, self.head_dim)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)
    # Query head h*group + g reads KV head h (the grouping of the reference implementation).
    q = rearrange(q, "b t (h g) d -> b h g t d", h=self.num_kv_heads)
    k = rearrange(k, "b t h d -> b h t d")
    v = rearrange(v, "b t h d -> b h t d")
    return q, k, v

  def output(self, attended, dtype):  # attended: [b, h, g, t, d]
    return self.o_proj(rearrange(attended, "b h g t d -> b t (h g d)").astype(dtype))

  # The cache steps touch no weights: kvjax.layer_runs compiles them once for look-alike layers.
  def prefill_cache(self, qkv, lengths, cache):
    """Attention over the prompt itself, and the prompt stored (compressed) in the cache."""
    q, k, v = qkv
    attended = cache_prompt_attention(
      cache, q, k, v, lengths, sm_scale=self.sm_scale, sliding_window=self.sliding_window
    )
    return attended, cache.ingest(k, v, q, lengths)

  def prefill_chunk_cache(self, qkv, counts, cache):
    """A prompt chunk's attention over the held tokens and itself, then the chunk's first
    `counts[b]` tokens stored (compressed) after each row's held tokens."""
    q, k, v = qkv
    attended = chunk_attention(
      cache.attend_chunk(q, sm_scale=self.sm_scale),
      q,
      k,
      v,
      sm_scale=self.sm_scale,
      sliding_window=self.sliding_window,
    )
    return attended.astype(q.dtype), cache.ingest_chunk(k, v, q, counts)

  def decode_cache(self, qkv, cache):
    """One new token stored, then its query attends over everything the cache holds."""
    q, k, v = qkv
    attended, cache = append_and_attend(
      cache, k[:, :, 0], v[:, :, 0], q[:, :, :, 0], sm_scale=self.sm_scale
    )
    return attended[:, :, :, None], cache
