"""Llama-family decoder (Llama 1-3, SmolLM, Mistral) in Flax NNX with an explicit kvjax cache."""

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.cache_protocol import ModelCacheShape
from models.attention import CachedAttention
from models.config import DecoderConfig
from models.layers import RMSNorm, SwiGLU


class DecoderLayer(nnx.Module):
  def __init__(self, config: DecoderConfig, *, dtype, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
    self.self_attn = CachedAttention(config, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(
      config.hidden_size, eps=config.rms_norm_eps, dtype=dtype
    )
    self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)

  def _finish(self, x, attended):
    x = x + attended
    return x + self.mlp(self.post_attention_layernorm(x))

  def prefill(self, x, lengths, cache):
    attended, cache = self.self_attn.prefill(self.input_layernorm(x), lengths, cache)
    return self._finish(x, attended), cache

  def decode(self, x, positions, cache):
    attended, cache = self.self_attn.decode(self.input_layernorm(x), positions, cache)
    return self._finish(x, attended), cache


class Decoder(nnx.Module):
  """`prefill` ingests right-padded prompts into fresh caches; `decode_step` adds one token."""

  def __init__(self, config: DecoderConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.config = config
    self.embed_tokens = nnx.Embed(
      config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
    )
    self.layers = nnx.List(
      [DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)]
    )
    self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
    if not config.tie_word_embeddings:
      self.lm_head = nnx.Linear(
        config.hidden_size,
        config.vocab_size,
        use_bias=False,
        dtype=dtype,
        param_dtype=dtype,
        rngs=rngs,
      )

  @property
  def cache_shape(self) -> ModelCacheShape:
    return ModelCacheShape(
      num_layers=self.config.num_layers,
      num_kv_heads=self.config.num_kv_heads,
      num_query_heads=self.config.num_heads,
      head_dim=self.config.head_dim,
      sliding_window=self.config.sliding_window,
    )

  def _logits(self, hidden):
    hidden = self.norm(hidden)
    if self.config.tie_word_embeddings:
      return self.embed_tokens.attend(hidden).astype(jnp.float32)
    return self.lm_head(hidden).astype(jnp.float32)

  def prefill(
    self,
    tokens: jax.Array,  # int32 [batch, prompt], right-padded
    lengths: jax.Array,  # int32 [batch]
    caches: tuple,
    *,
    all_logits: bool = False,
  ) -> tuple[jax.Array, tuple]:
    """Logits at each row's last prompt token [batch, vocab] (all: [batch, prompt, vocab])."""
    x = self.embed_tokens(tokens)
    new_caches = []
    for layer, cache in zip(self.layers, caches):
      x, cache = layer.prefill(x, lengths, cache)
      new_caches.append(cache)
    if not all_logits:
      x = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return self._logits(x), tuple(new_caches)

  def decode_step(
    self,
    tokens: jax.Array,  # int32 [batch]
    positions: jax.Array,  # int32 [batch]
    caches: tuple,
  ) -> tuple[jax.Array, tuple]:
    """Logits [batch, vocab] of the next token after `tokens` at `positions`."""
    x = self.embed_tokens(tokens[:, None])
    new_caches = []
    for layer, cache in zip(self.layers, caches):
      x, cache = layer.decode(x, positions, cache)
      new_caches.append(cache)
    return self._logits(x[:, 0]), tuple(new_caches)
