"""kvjax's own decode loop (`generate`'s, caches donated) lowered for an accelerator this machine
does not have: a one-layer random Llama, a cache method's caches shaped by its prefill
(`jax.eval_shape`, nothing computed), and the decode loop traced on arguments placed on a
compile-only device. `xla_kernel_bytes.decode_step_kernels` (an H100) and
`tpu_compile_check.decode_loop` (a TPU) read what XLA does at every step from it;
`tpu_compile_check.decode_step` reads one step jitted alone, as a caller's own loop runs it.
"""

import contextlib
from unittest import mock


def _model_and_caches(
  cache_method,
  *,
  backend,
  context,
  new_tokens,
  target,
  kv_heads: int = 8,
  group: int = 4,
  head_dim: int = 128,
  batch: int = 8,
):
  """(decoder, params, abstract last logits, abstract caches): a one-layer random Llama
  (`kv_heads` KV heads, `group` query heads each) and the caches its prefill of `batch` rows of
  `context - new_tokens` tokens leaves, room for `new_tokens` more."""
  import importlib

  import jax
  import jax.numpy as jnp

  from models.config import DecoderConfig
  from models.nnx_decoder import split_decoder
  from models.weights import random_decoder

  generate_module = importlib.import_module("kvjax.generate")  # the package exports the function
  config = DecoderConfig(
    vocab_size=256,
    hidden_size=512,
    intermediate_size=512,
    num_layers=1,
    num_heads=kv_heads * group,
    num_kv_heads=kv_heads,
    head_dim=head_dim,
    max_position_embeddings=context + new_tokens,
  )
  decoder, params = split_decoder(random_decoder(config, seed=0))
  prefill_static = dict(
    cache_method=cache_method,
    max_new_tokens=new_tokens,
    cache_dtype=jnp.bfloat16,
    prefill_chunk=None,
  )
  with target(), mock.patch("jax.default_backend", return_value=backend):
    logits, caches = jax.eval_shape(
      lambda tokens, lengths: generate_module._prefill_in_jit(
        decoder, params, tokens, lengths, **prefill_static
      ),
      jax.ShapeDtypeStruct((batch, context - new_tokens), jnp.int32),
      jax.ShapeDtypeStruct((batch,), jnp.int32),
    )
  return decoder, params, logits, caches


def lowered_decode_loop(
  cache_method,
  *,
  placed,
  backend: str,
  platform: str,
  context: int,
  new_tokens: int = 64,
  target=contextlib.nullcontext,
  compile_in_target: bool = False,
  **shape,
):
  """The lowered decode loop (jax.stages.Lowered) for rows whose caches hold `context` tokens
  after the loop, or with `compile_in_target` the compiled one. `placed(tree)`: the abstract
  arrays of `tree` on the target device; `backend`: what `jax.default_backend()` reports while
  kvjax picks its kernels (it picks by the default backend, this machine's CPU), and while it
  compiles with `compile_in_target`; `platform`: the lowering platform ("cuda", "tpu");
  `target()`: a context the target's kernels lower (and compile) in; `shape`: kv_heads, group,
  head_dim, batch (`_model_and_caches`). The model's weights are made before it, on this
  machine."""
  import importlib

  import jax
  import jax.numpy as jnp

  from kvjax.sampling import SamplingConfig

  generate_module = importlib.import_module("kvjax.generate")
  decoder, params, logits, caches = _model_and_caches(
    cache_method, backend=backend, context=context, new_tokens=new_tokens, target=target, **shape
  )
  with target(), mock.patch("jax.default_backend", return_value=backend):
    traced = generate_module._decode_in_jit_donating_caches.trace(
      decoder,
      placed(params),
      placed(logits),
      placed(caches),
      placed(jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32)),
      placed(jax.eval_shape(lambda: jax.random.key(0))),
      max_new_tokens=new_tokens,
      sampling=SamplingConfig(),
      stop_token_ids=(),
      pad_token_id=0,
    )
    return _lowered(traced, platform, compile_in_target)


def lowered_decode_step(
  cache_method,
  *,
  placed,
  backend: str,
  platform: str,
  context: int,
  target=contextlib.nullcontext,
  compile_in_target: bool = False,
  **shape,
):
  """`lowered_decode_loop`'s model and caches, but one decode step jitted alone, the caches
  donated (a caller's own loop: `decode_step(params, tokens, positions, caches)`, the caches
  passed in and returned in the device's default layout at every call)."""
  import jax
  import jax.numpy as jnp

  decoder, params, logits, caches = _model_and_caches(
    cache_method, backend=backend, context=context, new_tokens=1, target=target, **shape
  )
  batch = logits.shape[0]
  step = jax.jit(decoder.decode_step, donate_argnums=(3,))
  with target(), mock.patch("jax.default_backend", return_value=backend):
    traced = step.trace(
      placed(params),
      placed(jax.ShapeDtypeStruct((batch, 1), jnp.int32)),
      placed(jax.ShapeDtypeStruct((batch,), jnp.int32)),
      placed(caches),
    )
    return _lowered(traced, platform, compile_in_target)


def _lowered(traced, platform: str, compile_in_target: bool):
  lowered = traced.lower(lowering_platforms=(platform,))
  return lowered.compile() if compile_in_target else lowered
