"""Building blocks of a Llama-family decoder layer: RMSNorm and the SwiGLU MLP."""

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (self.weight[...] * normed.astype(x.dtype)).astype(x.dtype)


class SwiGLU(nnx.Module):
  def __init__(self, hidden: int, intermediate: int, *, dtype, rngs: nnx.Rngs):
    linear = lambda i, o: nnx.Linear(
      i, o, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
    )
    self.gate_proj = linear(hidden, intermediate)
    self.up_proj = linear(hidden, intermediate)
    self.down_proj = linear(intermediate, hidden)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
