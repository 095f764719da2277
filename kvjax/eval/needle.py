"""Needle retrieval: a 5-digit number hidden at a depth of a filler context, asked for at the end.

The wording is RULER's single needle (DESIGN.md): on SmolLM2-135M the full cache finds it at
every depth at 1k-2k tokens, so a loss is the compression's doing. Two settings:
- query-aware: the question is part of the prompt whose cache is compressed (SnapKV's setting);
- query-agnostic: the context is compressed first and the question is fed afterwards through
  the compressed cache (the setting of a reused cache).
"""

import dataclasses
import math
import re

import jax.numpy as jnp
import numpy as np

from kvjax.compressed_context import compress_context, continue_context

FILLER = (
  "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
INSTRUCTION = (
  "A special magic number is hidden within the following text. Make sure to memorize it. "
  "I will quiz you about the number afterwards.\n"
)
NEEDLE = "One of the special magic numbers for apple is: {key}. "
QUESTION = "\nWhat is the special magic number for apple mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for apple mentioned in the provided text is"
DEPTHS = (0.1, 0.5, 0.9)
ANSWER_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class NeedlePrompt:
  context_ids: list[int]  # chat prefix + instruction + filler with the needle
  question_ids: list[int]  # question + end of turn + the started answer
  key: str
  depth: float


def _filler_units_for(tokenizer, context_len: int, overhead: int, length_name: str) -> int:
  per_unit = len(tokenizer.encode(FILLER * 16)) / 16
  units = int((context_len - overhead) / per_unit)
  if units < 1:
    # A longer prompt than asked would be scored, and bytes and checks made, for context_len.
    raise ValueError(
      f"{length_name}={context_len} is too short for the needle task: its instruction, needle "
      f"and question take {overhead} tokens and one filler sentence {per_unit:.0f} more; use "
      f"{length_name} >= {math.ceil(overhead + per_unit)} or leave out the passkey tasks"
    )
  return units


def build_needle_prompts(
  tokenizer,
  *,
  context_len: int,
  num_samples: int,
  seed: int,
  depths=DEPTHS,
  length_name: str = "context_len",
) -> list[NeedlePrompt]:
  """`num_samples` prompts per depth of about `context_len` tokens, keys drawn from `seed`;
  `length_name`: what a refusal calls `context_len` (the caller's name for it)."""
  rng = np.random.default_rng(seed)
  chat = tokenizer.apply_chat_template(
    [{"role": "user", "content": "\x00"}], add_generation_prompt=True
  )
  chat_prefix, chat_suffix = chat.split("\x00")
  question_text = QUESTION + chat_suffix + ANSWER_PREFIX
  overhead = len(tokenizer.encode(chat_prefix + INSTRUCTION + NEEDLE.format(key="12345")))
  overhead += len(tokenizer.encode(question_text))
  units = _filler_units_for(tokenizer, context_len, overhead, length_name)
  prompts = []
  for depth in depths:
    for _ in range(num_samples):
      key = str(rng.integers(10000, 100000))
      before = int(round(units * depth))
      haystack = FILLER * before + NEEDLE.format(key=key) + FILLER * (units - before)
      prompts.append(
        NeedlePrompt(
          context_ids=tokenizer.encode(chat_prefix + INSTRUCTION + haystack.rstrip()),
          question_ids=tokenizer.encode(question_text),
          key=key,
          depth=depth,
        )
      )
  return prompts


def answer_has_key(answer: str, key: str) -> bool:
  """The first number in the answer is the key (digits may come with spaces or a colon)."""
  digits = re.findall(r"\d+", answer.replace(" ", ""))
  return bool(digits) and digits[0] == key


def run_needle(
  decoder,
  params,
  tokenizer,
  cache_method,
  prompts: list[NeedlePrompt],
  *,
  query_aware: bool,
  cache_dtype=jnp.bfloat16,
  pad_token_id: int = 0,
  prefill_chunk: int | None = None,
) -> dict:
  """Greedy answers for all prompts in one batch; accuracy overall and per depth."""
  if query_aware:
    context_ids = [p.context_ids + p.question_ids for p in prompts]
    fed = [[] for _ in prompts]
  else:
    context_ids = [p.context_ids for p in prompts]
    fed = [p.question_ids for p in prompts]
  context = compress_context(
    decoder,
    params,
    context_ids,
    cache_method=cache_method,
    room=max(len(question) for question in fed) + ANSWER_TOKENS,
    cache_dtype=cache_dtype,
    pad_token_id=pad_token_id,
    prefill_chunk=prefill_chunk,
  )
  answers, _ = continue_context(
    decoder, params, context, fed, max_new_tokens=ANSWER_TOKENS, pad_token_id=pad_token_id
  )
  texts = [tokenizer.decode(np.asarray(row).tolist()) for row in answers]
  hits = [answer_has_key(text, p.key) for text, p in zip(texts, prompts)]
  by_depth = {}
  for depth in sorted({p.depth for p in prompts}):
    depth_hits = [h for h, p in zip(hits, prompts) if p.depth == depth]
    by_depth[str(depth)] = sum(depth_hits) / len(depth_hits)
  return dict(accuracy=sum(hits) / len(hits), by_depth=by_depth, answers=texts)
