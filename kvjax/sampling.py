"""Next-token sampling: greedy, temperature, top-k and top-p, with an explicit PRNG key."""

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

# Logits of magnitude up to 1e32 stay finite in float32 when divided by it.
MIN_TEMPERATURE = 1e-6


def _is_real(value) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """`temperature=0` is greedy decoding; top-k / top-p filter before sampling. A temperature
  in (0, MIN_TEMPERATURE) is refused: dividing float32 logits by it overflows (or the
  temperature itself rounds to 0), and it samples the argmax anyway."""

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    if not _is_real(self.temperature) or not (
      self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf
    ):
      raise ValueError(
        f"temperature={self.temperature!r} must be 0 (greedy) or a finite number >= "
        f"{MIN_TEMPERATURE:g}"
      )
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
  """Keeps the k largest logits and every logit tied with the k-th (as Hugging Face does)."""
  kth_largest = jax.lax.top_k(logits, min(k, logits.shape[-1]))[0][:, -1:]
  return jnp.where(logits < kth_largest, -jnp.inf, logits)


def filter_top_p(logits: jax.Array, p: float) -> jax.Array:  # [batch, vocab]
  """Keeps the smallest set of most likely tokens whose probability reaches p (at least one
  token; among tied logits the earlier in the vocabulary go in first). The mass is summed in
  float32 from the least likely token up: summed from the top, float32 reaches 1 before the
  tail and would drop tokens even at p=1."""
  if not isinstance(p, jax.core.Tracer) and p >= 1:
    return logits
  order = jnp.argsort(-logits, axis=-1, stable=True)[:, ::-1]  # least likely first
  ascending_logits = jnp.take_along_axis(logits, order, axis=-1).astype(jnp.float32)
  mass_up_to = jnp.cumsum(jax.nn.softmax(ascending_logits, axis=-1), axis=-1)
  # Token j is in the set iff the tokens more likely than it hold less than p, i.e. the mass
  # up to and including it exceeds 1 - p; the most likely token is always kept.
  dropped = ((mass_up_to <= 1 - p) & (p < 1)).at[:, -1].set(False)  # p traced: p=1 drops none
  dropped_in_place = jnp.take_along_axis(dropped, jnp.argsort(order, axis=-1), axis=-1)
  return jnp.where(dropped_in_place, -jnp.inf, logits)


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
