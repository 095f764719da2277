"""Using kvjax caches and `generate` with your own JAX model (no `models` import needed).

A model only has to be hashable (a frozen dataclass here), say its `cache_shape`, and
implement `prefill` and `decode_step` over a tuple of kvjax layer caches
(kvjax.CachedDecoder); `prefill_chunk` as well lets it prefill long prompts a chunk at a time
(`prefill_chunk=` of generate / compress_context). Here: a one-layer toy attention model
written directly in jnp, its weights a plain dict passed as `params` (a Flax NNX model would
pass its `nnx.State` and keep its `nnx.GraphDef` on the decoder: models/nnx_decoder.py).

    python examples/own_model_protocol.py
"""

import dataclasses

import jax
import jax.numpy as jnp

import kvjax
from kvjax.chunk_attention import chunk_attention
from kvjax.prefill_attention import cache_prompt_attention

VOCAB, HEADS, KV_HEADS, DIM = 32, 4, 2, 16


@dataclasses.dataclass(frozen=True)
class ToyDecoder:
  cache_shape = kvjax.ModelCacheShape(
    num_layers=1, num_kv_heads=KV_HEADS, num_query_heads=HEADS, head_dim=DIM
  )
  honours_prompt_attention = True  # prefill asks the cache how the prompt attends

  def _qkv(self, params, tokens):  # tokens [batch, t]
    x = params["embed"][tokens]
    q = jnp.einsum("btd,dhgk->bhgtk", x, params["wq"])
    k = jnp.einsum("btd,dhk->bhtk", x, params["wk"])
    v = jnp.einsum("btd,dhk->bhtk", x, params["wv"])
    return q, k, v

  def _logits(self, params, attended):  # [batch, h, g, d] -> [batch, vocab]
    return jnp.einsum("bhgk,hgkv->bv", attended, params["wo"])

  def prefill(self, params, tokens, lengths, caches):
    q, k, v = self._qkv(params, tokens)
    # Causal attention, unless the layer's cache says otherwise (DuoAttention's streaming heads
    # see only their sinks and recent tokens); hence honours_prompt_attention below.
    out = cache_prompt_attention(caches[0], q, k, v, lengths, sm_scale=DIM**-0.5)
    last = jnp.take_along_axis(out, (lengths - 1)[:, None, None, None, None], axis=3)[:, :, :, 0]
    return self._logits(params, last), (caches[0].ingest(k, v, q, lengths),)

  def prefill_chunk(self, params, tokens, start, lengths, caches):
    """Prompt positions [start, start + chunk): attend over what the cache holds and causally
    within the chunk, then hand the chunk's real tokens to the cache."""
    chunk = tokens.shape[1]
    q, k, v = self._qkv(params, tokens)
    held = caches[0].attend_chunk(q, sm_scale=DIM**-0.5)
    out = chunk_attention(held, q, k, v, sm_scale=DIM**-0.5, sliding_window=None)
    last = jnp.clip(lengths - 1 - start, 0, chunk - 1)
    last = jnp.take_along_axis(out, last[:, None, None, None, None], axis=3)[:, :, :, 0]
    counts = jnp.clip(lengths - start, 0, chunk)
    return self._logits(params, last), (caches[0].ingest_chunk(k, v, q, counts),)

  def decode_step(self, params, tokens, positions, caches):
    del positions  # this toy model has no position encoding
    q, k, v = self._qkv(params, tokens[:, None])
    # append_and_attend: the new token stored, then attended over (caches that evict by the
    # attention their tokens receive, h2o_decode, do both at once).
    attended, cache = kvjax.append_and_attend(
      caches[0], k[:, :, 0], v[:, :, 0], q[:, :, :, 0], sm_scale=DIM**-0.5
    )
    return self._logits(params, attended), (cache,)


def toy_params(seed: int = 0) -> dict:
  keys = jax.random.split(jax.random.key(seed), 5)
  group = HEADS // KV_HEADS
  return dict(
    embed=jax.random.normal(keys[0], (VOCAB, DIM)),
    wq=jax.random.normal(keys[1], (DIM, KV_HEADS, group, DIM)) * 0.3,
    wk=jax.random.normal(keys[2], (DIM, KV_HEADS, DIM)) * 0.3,
    wv=jax.random.normal(keys[3], (DIM, KV_HEADS, DIM)) * 0.3,
    wo=jax.random.normal(keys[4], (KV_HEADS, group, DIM, VOCAB)) * 0.3,
  )


def main():
  params = toy_params()
  for spec, prefill_chunk in (
    ("full", None),
    ("full", 16),
    ("kivi:bits=4,group_size=16,residual=16", None),
  ):
    result = kvjax.generate(
      ToyDecoder(),
      params,
      [[1, 2, 3, 4, 5, 6, 7, 8] * 6, [9, 10, 11]],
      max_new_tokens=8,
      cache_method=kvjax.parse_method_spec(spec),
      cache_dtype=jnp.float32,
      prefill_chunk=prefill_chunk,
    )
    name = spec if prefill_chunk is None else f"{spec},prefill_chunk={prefill_chunk}"
    print(name, result.tokens.tolist(), f"{result.cache_bytes} bytes")


if __name__ == "__main__":
  main()
