"""Next-token sampling: greedy, temperature, top-k and top-p, with an explicit PRNG key."""

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """`temperature=0` is greedy decoding; top-k / top-p filter before sampling."""

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
      raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0: greedy)")
    if self.top_k is not None and (
      isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 1
    ):
      raise ValueError(f"top_k={self.top_k!r} must be an int >= 1 (or None for no top-k filter)")
    if self.top_p is not None and (not _is_real(self.top_p) or not 0 < self.top_p <= 1):
      raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (or None for no top-p filter)")
    if self.temperature == 0 and (self.top_k is not None or self.top_p is not None):
      raise ValueError("top_k/top_p need temperature > 0 (temperature=0 is greedy decoding)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def filter_top_k(logits: jax.Array, k: int) -> jax.Array:  # [batch, vocab]
  kth_largest = jax.lax.top_k(logits, min(k, logits.shape[-1]))[0][:, -1:]
  return jnp.where(logits < kth_largest, -jnp.inf, logits)


def filter_top_p(logits: jax.Array, p: float) -> jax.Array:  # [batch, vocab]
  """Keeps the smallest set of most likely tokens whose probability reaches p (at least one)."""
  sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
  sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  kept = mass_before < p
  threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits < threshold, -jnp.inf, logits)


def sample_next_token(
  logits: jax.Array,  # float [batch, vocab]
  key: jax.Array,
  config: SamplingConfig,
) -> jax.Array:  # int32 [batch]
  if config.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / config.temperature
  if config.top_k is not None:
    logits = filter_top_k(logits, config.top_k)
  if config.top_p is not None:
    logits = filter_top_p(logits, config.top_p)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
