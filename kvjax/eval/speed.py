"""Timing the prefill and the decode steps apart from compilation (`kvjax compare`'s speed).

Each program is compiled ahead of time (`compile_s`). The prefill then runs once unmeasured
(a program's first run also pays for setting itself up; a review measured it 10-15% slower for
a 1024-token prefill on a busy 2-CPU machine) and `PREFILL_TIMED_RUNS` more times, of which the
median is `prefill_s`. The decode speed is read off the continuation task's teacher forcing,
run once: every forced token is one decode step through the compressed cache (store K/V,
attend, logits), the step generation runs too, with the next token given instead of sampled.
Its 256 steps take tens of seconds on a CPU, so a first run's setup is a small part of them,
and repeating it would multiply the comparison's time.
"""

import dataclasses
import time

import jax
import numpy as np

from kvjax.cache_room import check_room
from kvjax.generate import prefill
from kvjax.teacher_forcing import teacher_force

PREFILL_TIMED_RUNS = 3


def _compile_and_run(jitted, decoder, dynamic_args: tuple, static_kwargs: dict, *, timed_runs=0):
  """(outputs, compile seconds, run seconds): the one run's time, or with `timed_runs` the
  median of that many runs after an unmeasured one."""
  start = time.perf_counter()
  compiled = jitted.lower(decoder, *dynamic_args, **static_kwargs).compile()
  compile_s = time.perf_counter() - start
  run_times = []
  for _ in range(1 + timed_runs):
    run_start = time.perf_counter()
    out = jax.block_until_ready(compiled(*dynamic_args))
    run_times.append(time.perf_counter() - run_start)
  return out, compile_s, float(np.median(run_times[1:] if timed_runs else run_times))


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
      timed_runs=PREFILL_TIMED_RUNS,
    )
  )


def timed_teacher_force(decoder, params, logits, caches, lengths, forced) -> TimedRun:
  """(log-probs, logits, caches) of `kvjax.teacher_force`, timed."""
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
