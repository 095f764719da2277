"""Continuation scoring through a compressed cache: perplexity and KL to the full cache.

The context's cache is built (and compressed) by the method at prefill; the continuation is
then teacher-forced one decode step at a time through that cache, as generation would use it.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvjax.generate import prefill
from kvjax.teacher_forcing import teacher_force


def special_prefix(tokenizer) -> list[int]:
  """The ids a tokenizer puts before any text when it adds its special tokens (Llama's BOS), so
  that scored windows start as the model's inputs do; [] for one that adds none (SmolLM2) or
  cannot say (an `encode` without `add_special_tokens`)."""
  try:
    marked = tokenizer.encode("a", add_special_tokens=True)
  except TypeError:
    return []
  plain = tokenizer.encode("a")
  for start in range(len(marked) - len(plain) + 1):
    if marked[start : start + len(plain)] == plain:
      return list(marked[:start])
  return []


def sample_text_windows(
  token_ids: np.ndarray, *, window: int, count: int, seed: int
) -> np.ndarray:  # int32 [count, window]
  """`count` non-overlapping windows of `window` tokens at seeded random offsets."""
  slots = len(token_ids) // window
  if slots < count:
    raise ValueError(
      f"the text has {len(token_ids)} tokens: too short for {count} windows of {window} tokens "
      + (
        "(lower --num-samples or --context-len, or give a longer --text)"
        if count > 1
        else "(lower --context-len or --continuation-len, or give a longer --text)"
      )
    )
  chosen = np.sort(np.random.default_rng(seed).choice(slots, size=count, replace=False))
  return np.stack([token_ids[s * window : (s + 1) * window] for s in chosen]).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class ContinuationScores:
  logprobs: np.ndarray  # float32 [samples, continuation, vocab]
  targets: np.ndarray  # int32 [samples, continuation]

  @property
  def target_logprobs(self) -> np.ndarray:  # [samples, continuation]
    return np.take_along_axis(self.logprobs, self.targets[..., None], axis=-1)[..., 0]

  @property
  def perplexity(self) -> float:
    return float(np.exp(-self.target_logprobs.mean()))

  def kl_from(self, reference: "ContinuationScores") -> float:
    """Mean over positions of KL(reference || self) of the next-token distributions (in float64,
    one sample at a time: all of them at once would be samples x tokens x vocab x 8 bytes)."""
    per_position = []
    for p_log, q_log in zip(reference.logprobs, self.logprobs, strict=True):
      p_log, q_log = p_log.astype(np.float64), q_log.astype(np.float64)
      per_position.append(np.sum(np.exp(p_log) * (p_log - q_log), axis=-1))
    return float(np.mean(per_position))


def score_continuation(
  decoder, params, cache_method, windows: np.ndarray, *, context_len: int, cache_dtype=jnp.bfloat16
) -> ContinuationScores:
  """Compress the first `context_len` tokens of each window, score the rest through the cache."""
  windows = np.asarray(windows)
  if windows.ndim == 2 and windows.shape[1] == context_len:
    # Nothing left to score: the perplexity and KL of no tokens came out NaN.
    raise ValueError(
      f"context_len={context_len} leaves no continuation in windows of {windows.shape[1]} "
      "tokens; it must be less than the windows' width"
    )
  context, continuation = windows[:, :context_len], windows[:, context_len:]
  lengths = np.full((windows.shape[0],), context_len, np.int32)
  logits, caches = prefill(
    decoder,
    params,
    context,
    lengths,
    cache_method=cache_method,
    max_new_tokens=continuation.shape[1],
    cache_dtype=cache_dtype,
  )
  logprobs, _, _ = teacher_force(decoder, params, logits, caches, lengths, continuation)
  return ContinuationScores(np.asarray(logprobs, np.float32), continuation)
