"""`kvjax compare`: every method against the full cache on identical inputs (DESIGN.md protocol)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from kvjax.cache_protocol import check_cache_dtype, check_count
from kvjax.chunked_prefill import check_prefill_chunk
from kvjax.decoder_protocol import decoder_vocab_size
from kvjax.eval.cache_size import cache_byte_columns, cache_bytes_after_context
from kvjax.eval.continuation import ContinuationScores, sample_text_windows, special_prefix
from kvjax.eval.needle import ANSWER_TOKENS, build_needle_prompts, run_needle
from kvjax.eval.speed import speed_record, timed_prefill, timed_teacher_force
from kvjax.generate import check_prefill_arguments
from kvjax.kernel_settings import DEFAULT_KERNEL_SETTINGS, KernelSettings
from kvjax.method_spec import describe_method, parse_method_spec
from kvjax.prompt_batch import check_token_ids

TASKS = ("ppl", "kl", "passkey", "passkey_agnostic", "speed")


@dataclasses.dataclass(frozen=True)
class CompareConfig:
  tasks: tuple[str, ...] = ("ppl", "kl", "passkey", "passkey_agnostic", "speed")
  context_len: int = 1024
  continuation_len: int = 256
  num_samples: int = 2
  seed: int = 0
  cache_dtype: str = "bfloat16"
  implementation: str = "auto"
  kernel_settings: KernelSettings = DEFAULT_KERNEL_SETTINGS
  prefill_chunk: int | None = None  # contexts fed this many tokens at a time (None: one piece)
  # The needle prompts' lengths, each a run of its own (empty: context_len alone).
  needle_lengths: tuple[int, ...] = ()

  def __post_init__(self):
    check_prefill_chunk(self.prefill_chunk)
    unknown = set(self.tasks) - set(TASKS)
    if not self.tasks:
      raise ValueError(f"tasks is empty; allowed: {','.join(TASKS)} (one or more)")
    if unknown:
      raise ValueError(
        f"tasks={','.join(self.tasks)!s} has unknown {sorted(unknown)}; allowed: {','.join(TASKS)}"
      )
    for name in ("context_len", "continuation_len", "num_samples"):
      check_count(name, getattr(self, name), 1)
    check_count("seed", self.seed, 0)  # numpy's generators take no negative seed
    check_cache_dtype(self.cache_dtype)
    self._check_needle_lengths()

  def _check_needle_lengths(self):
    lengths = self.needle_lengths
    if not isinstance(lengths, tuple):
      raise ValueError(
        f"needle_lengths={lengths!r} must be a tuple of token counts (empty: context_len)"
      )
    for i, length in enumerate(lengths):
      check_count(f"needle_lengths[{i}]", length, 1)
    if len(set(lengths)) != len(lengths):
      raise ValueError(f"needle_lengths={lengths} lists a length twice; list each once")
    if lengths and not set(self.tasks) & {"passkey", "passkey_agnostic"}:
      raise ValueError(
        f"needle_lengths={lengths} is given, but tasks={','.join(self.tasks)} runs no needle; "
        "add passkey or passkey_agnostic to tasks, or leave needle_lengths empty"
      )

  @property
  def needle_prompt_lengths(self) -> tuple[int, ...]:
    """The lengths the needle is asked at: `needle_lengths`, or `context_len` alone."""
    return self.needle_lengths or (self.context_len,)


def compare_methods(
  decoder,
  params,
  tokenizer,
  method_specs: list,
  *,
  text: str,
  config: CompareConfig,
  pad_token_id: int = 0,
  max_context: int | None = None,
  on_record=None,
) -> list[dict]:
  """One record per method (the full cache first: every number is relative to it).

  `method_specs`: spec strings (`kivi:bits=2`) or cache method objects. `on_record(records)` is
  called after each method with the records so far (to save partial results of long runs).
  """
  methods = [
    parse_method_spec(
      s, implementation=config.implementation, kernel_settings=config.kernel_settings
    )
    if isinstance(s, str)
    else s
    for s in method_specs
  ]
  names = [describe_method(m) for m in methods]
  # Every number is relative to the full cache (its bytes, its log-probs for KL): it runs first,
  # wherever it was listed, and is added when it was not.
  if "full" in names:
    first = names.index("full")
    methods.insert(0, methods.pop(first))
    names.insert(0, names.pop(first))
  else:
    methods.insert(
      0,
      parse_method_spec(
        "full", implementation=config.implementation, kernel_settings=config.kernel_settings
      ),
    )
    names.insert(0, "full")
  # An equal method twice would time a program already compiled (a razor profile by two paths
  # is one method), and a second full cache would replace the KL reference; two methods of one
  # name (other implementations) would be two rows no one could tell apart.
  for i, method in enumerate(methods):
    for j in range(i):
      if method == methods[j] or names[i] == names[j]:
        raise ValueError(
          f"method_specs lists {names[i]} twice; list each method once (and compare "
          "implementations in separate runs)"
        )
  tasks = set(config.tasks)
  # Only the continuation tasks feed continuation_len tokens; the needle answers ANSWER_TOKENS.
  continuing = bool(tasks & {"ppl", "kl", "speed"})
  needle = bool(tasks & {"passkey", "passkey_agnostic"})
  # (length, what a refusal calls it) of each needle run
  needle_lengths = [
    (length, f"needle_lengths[{i}]" if config.needle_lengths else "context_len")
    for i, length in enumerate(config.needle_prompt_lengths if needle else ())
  ]
  # (prompt tokens, tokens fed after them, what they are called) of every run to come
  runs = []
  if continuing:
    runs.append(
      (
        config.context_len,
        config.continuation_len,
        f"context_len {config.context_len} + continuation_len {config.continuation_len}",
      )
    )
  for length, name in needle_lengths:
    runs.append(
      (length, ANSWER_TOKENS, f"{name} {length} + the needle's {ANSWER_TOKENS} answer tokens")
    )
  for prompt_len, new_tokens, what in runs:
    if max_context is not None and prompt_len + new_tokens > max_context:
      raise ValueError(f"{what} exceeds the model's context of {max_context} tokens")
  dtype = jnp.dtype(config.cache_dtype)
  for method in methods:  # a method that cannot prefill in chunks is refused before any run
    for prompt_len, new_tokens, _ in runs:
      check_prefill_arguments(
        decoder,
        batch=1,
        prompt_len=prompt_len,
        cache_method=method,
        max_new_tokens=new_tokens,
        cache_dtype=dtype,
        prefill_chunk=config.prefill_chunk,
      )
  text_ids = np.asarray(tokenizer.encode(text))
  windows = None
  if continuing:
    # A context starts as the model's inputs do: with the BOS its tokenizer adds, if any.
    prefix = special_prefix(tokenizer)
    # The continuation tasks time and score through lowered programs, which skip generate's
    # input checks: a tokenizer with ids past the model's vocabulary gave NaN or garbage.
    for ids, what in ((text_ids, "the tokenized text"), (prefix, "the tokenizer's BOS prefix")):
      check_token_ids(ids, vocab_size=decoder_vocab_size(decoder), name=what)
    text_ids = text_ids.astype(np.int32)
    windows = sample_text_windows(
      text_ids,
      window=config.context_len + config.continuation_len - len(prefix),
      count=config.num_samples if tasks & {"ppl", "kl"} else 1,
      seed=config.seed,
    )
    if prefix:
      windows = np.concatenate(
        [np.tile(np.asarray(prefix, np.int32), (windows.shape[0], 1)), windows], axis=1
      )
  # Every length's prompts are built first: a length too short for them is refused before any run.
  needles = {
    length: build_needle_prompts(
      tokenizer,
      context_len=length,
      num_samples=config.num_samples,
      seed=config.seed,
      length_name=name,
    )
    for length, name in needle_lengths
  }
  full_bytes = cache_bytes_after_context(
    decoder, params, methods[0], context_len=config.context_len, cache_dtype=dtype
  )
  records, full_scores = [], None
  for name, method in tqdm(list(zip(names, methods)), desc="methods", unit="method"):
    record = dict(
      method=name,
      **cache_byte_columns(
        decoder,
        method,
        context_len=config.context_len,
        cache_dtype=dtype,
        full_bytes=full_bytes,
        # after the continuation; a needle-only run feeds none
        new_tokens=config.continuation_len if continuing else None,
      ),
      ppl=None,
      kl=None,
      passkey_acc=None,
      passkey_acc_by_depth=None,
      prefill_s=None,
      decode_tokens_per_s=None,
      compile_s=None,
      speed_batch=None,
    )
    steps = (["continuation"] if windows is not None else []) + [
      t for t in ("passkey", "passkey_agnostic") if t in tasks
    ]
    for task in tqdm(steps, desc=name, unit="task", leave=False):
      if task == "continuation":
        record.update(
          _continuation_and_speed(decoder, params, method, windows, config, tasks, dtype)
        )
        scores = record.pop("scores", None)
        if name == "full":
          full_scores = scores
        if "kl" in tasks:
          record["kl"] = scores.kl_from(full_scores) if name != "full" else 0.0
      else:
        record.update(
          _needle_columns(
            task,
            {
              length: run_needle(
                decoder,
                params,
                tokenizer,
                method,
                prompts,
                query_aware=task == "passkey",
                cache_dtype=dtype,
                pad_token_id=pad_token_id,
                prefill_chunk=config.prefill_chunk,
              )
              for length, prompts in needles.items()
            },
          )
        )
    records.append(record)
    if on_record is not None:
      on_record(records)
  return records


def _needle_columns(task: str, results: dict[int, dict]) -> dict:
  """A needle task's columns from its runs at each length (`run_needle`'s results): accuracy
  over all of them, per depth over all lengths, per length (with its depths), and the answers
  in the order of the lengths."""
  hits_by_depth = {}
  for result in results.values():
    for depth, accuracy in result["by_depth"].items():
      hits_by_depth.setdefault(depth, []).append(accuracy)
  return {
    # every length asks as many needles at every depth, so the means are over all needles
    f"{task}_acc": sum(r["accuracy"] for r in results.values()) / len(results),
    f"{task}_acc_by_depth": {d: sum(a) / len(a) for d, a in hits_by_depth.items()},
    f"{task}_acc_by_length": {
      str(length): dict(accuracy=r["accuracy"], by_depth=r["by_depth"])
      for length, r in results.items()
    },
    f"{task}_answers": [answer for r in results.values() for answer in r["answers"]],
  }


def _continuation_and_speed(decoder, params, method, windows, config, tasks, dtype) -> dict:
  """Prefills the context windows, then teacher-forces the continuation through the caches:
  perplexity and log-probs (ppl, kl), and the two programs' timings (speed)."""
  context, continuation = windows[:, : config.context_len], windows[:, config.context_len :]
  lengths = np.full((windows.shape[0],), config.context_len, np.int32)
  prefilled = timed_prefill(
    decoder,
    params,
    context,
    lengths,
    cache_method=method,
    max_new_tokens=continuation.shape[1],
    cache_dtype=dtype,
    prefill_chunk=config.prefill_chunk,
  )
  logits, caches = prefilled.outputs
  forced = timed_teacher_force(decoder, params, logits, caches, lengths, continuation)
  out = {}
  if "speed" in tasks:
    speed = speed_record(prefilled, forced, batch=windows.shape[0], steps=continuation.shape[1])
    out.update(dataclasses.asdict(speed))
  if tasks & {"ppl", "kl"}:
    scores = ContinuationScores(np.asarray(forced.outputs[0], np.float32), continuation)
    out["scores"] = scores
    if "ppl" in tasks:
      out["ppl"] = scores.perplexity
  return out
