"""Timing the prefill and the decode steps apart from compilation (`kvjax compare`'s speed).

Each program is compiled ahead of time (`compile_s`), then run once and waited for. The decode
speed is read off the continuation task's teacher forcing: every forced token is one decode
step through the compressed cache (store K/V, attend, logits), the step generation runs too,
with the next token given instead of sampled; so speed costs no programs or runs of its own.
"""

import dataclasses
import time

import jax

from kvjax.cache_room import check_room
from kvjax.generate import prefill
from kvjax.teacher_forcing import teacher_force


def _compile_and_run(jitted, decoder, dynamic_args: tuple, static_kwargs: dict):
  start = time.perf_counter()
  compiled = jitted.lower(decoder, *dynamic_args, **static_kwargs).compile()
  compiled_at = time.perf_counter()
  out = jax.block_until_ready(compiled(*dynamic_args))
  return out, compiled_at - start, time.perf_counter() - compiled_at


@dataclasses.dataclass(frozen=True)
class TimedRun:
  outputs: tuple
  compile_s: float
  run_s: float


def timed_prefill(
  decoder,
  params,
  tokens,
  lengths,
  *,
  cache_method,
  max_new_tokens: int,
  cache_dtype,
  prefill_chunk: int | None = None,
) -> TimedRun:
  """(last-token logits, caches) of `kvjax.generate.prefill`, with its compile and run times."""
  return TimedRun(
    *_compile_and_run(
      prefill,
      decoder,
      (params, tokens, lengths),
      dict(
        cache_method=cache_method,
        max_new_tokens=max_new_tokens,
        cache_dtype=cache_dtype,
        prefill_chunk=prefill_chunk,
      ),
    )
  )


def timed_teacher_force(decoder, params, logits, caches, lengths, forced) -> TimedRun:
  """(log-probs, logits, caches) of `kvjax.teacher_forcing.teacher_force`, timed."""
  check_room(caches, forced.shape[1], caller="teacher_force")
  return TimedRun(
    *_compile_and_run(teacher_force, decoder, (params, logits, caches, lengths, forced), {})
  )


@dataclasses.dataclass(frozen=True)
class SpeedRecord:
  prefill_s: float  # the context prefill of the whole batch
  decode_tokens_per_s: float  # decode steps per second times the batch
  compile_s: float  # prefill and decode programs
  speed_batch: int


def speed_record(prefilled: TimedRun, decoded: TimedRun, *, batch: int, steps: int) -> SpeedRecord:
  return SpeedRecord(
    prefill_s=prefilled.run_s,
    decode_tokens_per_s=batch * steps / decoded.run_s,
    compile_s=prefilled.compile_s + decoded.compile_s,
    speed_batch=batch,
  )
