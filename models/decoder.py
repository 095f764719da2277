"""Llama-family decoder (Llama 1-3, SmolLM, Mistral) in Flax NNX with an explicit kvjax cache."""

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.cache_protocol import ModelCacheShape
from kvjax.layer_runs import check_layer_loop, run_layers
from models.attention import CachedAttention
from models.config import DecoderConfig, check_param_dtype
from models.layers import RMSNorm, SwiGLU


class DecoderLayer(nnx.Module):
  def __init__(self, config: DecoderConfig, *, dtype, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
    self.self_attn = CachedAttention(config, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(
      config.hidden_size, eps=config.rms_norm_eps, dtype=dtype
    )
    self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)

  def before_cache(self, x, positions):
    """(q, k, v) of this layer's attention at `positions` (int32 [batch, tokens])."""
    return self.self_attn.project(self.input_layernorm(x), positions)

  def after_cache(self, x, attended):
    """The residual stream after attention (`attended` [b, h, g, t, d]) and the MLP."""
    x = x + self.self_attn.output(attended, x.dtype)
    return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nnx.Module):
  """`prefill` ingests right-padded prompts into fresh caches; `decode_step` adds one token."""

  def __init__(
    self, config: DecoderConfig, *, dtype=jnp.float32, layer_loop: str = "unroll", rngs: nnx.Rngs
  ):
    check_layer_loop(layer_loop)
    check_param_dtype(dtype)
    self.config = config
    self.layer_loop = layer_loop  # kvjax.layer_runs: scan over look-alike layers, or unroll
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
      rope_theta=self.config.rope_theta,
      rope_scaling=self.config.rope_scaling,
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
    final_hidden: bool = False,
  ) -> tuple[jax.Array, tuple]:
    """Logits at each row's last prompt token [batch, vocab] (all: [batch, prompt, vocab]);
    `final_hidden`: instead, the final normalized hidden states at every prompt position
    [batch, prompt, hidden] in float32 (what DuoAttention's gates are trained to reproduce)."""
    x = self.embed_tokens(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    attention = self.layers[0].self_attn  # its cache step is every layer's (same config)
    x, new_caches = self._run_layers(
      x,
      caches,
      positions,
      lambda qkv, cache: attention.prefill_cache(qkv, lengths, cache),
      # Decode steps then update the stacked caches in place (kvjax.layer_runs).
      keep_stacked=True,
    )
    if final_hidden:
      return self.norm(x).astype(jnp.float32), tuple(new_caches)
    if not all_logits:
      x = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return self._logits(x), tuple(new_caches)

  def prefill_chunk(
    self,
    tokens: jax.Array,  # int32 [batch, chunk]: prompt positions [start, start + chunk)
    start: jax.Array,  # int32 [] or [batch]: position of the chunk's first token (per row)
    lengths: jax.Array,  # int32 [batch]: whole prompt lengths
    caches: tuple,  # holding each row's tokens before `start`
  ) -> tuple[jax.Array, tuple]:
    """One chunk of a chunked prefill: logits [batch, vocab] at each row's last prompt token
    where it lies in this chunk (elsewhere at the chunk's clipped end: not meaningful)."""
    chunk = tokens.shape[1]
    x = self.embed_tokens(tokens)
    positions = jnp.broadcast_to(
      jnp.asarray(start)[..., None] + jnp.arange(chunk, dtype=jnp.int32), tokens.shape
    )
    counts = jnp.clip(lengths - start, 0, chunk).astype(jnp.int32)
    attention = self.layers[0].self_attn
    x, new_caches = self._run_layers(
      x,
      caches,
      positions,
      lambda qkv, cache: attention.prefill_chunk_cache(qkv, counts, cache),
      keep_stacked=True,
    )
    last = jnp.clip(lengths - 1 - start, 0, chunk - 1)
    x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    return self._logits(x), tuple(new_caches)

  def decode_step(
    self,
    tokens: jax.Array,  # int32 [batch]
    positions: jax.Array,  # int32 [batch]
    caches: tuple,
  ) -> tuple[jax.Array, tuple]:
    """Logits [batch, vocab] of the next token after `tokens` at `positions`."""
    x = self.embed_tokens(tokens[:, None])
    x, new_caches = self._run_layers(
      x, caches, positions[:, None], self.layers[0].self_attn.decode_cache
    )
    return self._logits(x[:, 0]), new_caches

  def _run_layers(self, x, caches, positions, cache_step, *, keep_stacked=False):
    return run_layers(
      x,
      caches,
      before_cache=[
        lambda x, layer=layer: layer.before_cache(x, positions) for layer in self.layers
      ],
      cache_step=cache_step,
      after_cache=[layer.after_cache for layer in self.layers],
      layer_loop=self.layer_loop,
      keep_stacked=keep_stacked,
    )
