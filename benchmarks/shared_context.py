"""Many questions about one compressed document, on the embedded SmolLM2-135M: the context
copied per question (`repeat_context`) or held once for all of them (`share_context`).

    PYTHONPATH=. python benchmarks/shared_context.py --context 4096 --questions 1 4 16 \\
        --methods full kivi:bits=2 snapkv:ratio=0.25 --question-tokens 16 --new-tokens 32

For each method the pydoc prompt is compressed once (with room for the questions and answers
when repeated; with none when shared, whose rows keep them beside the context). For each
number of questions: the bytes of the rows' caches both ways (every array they hold), and the
wall time of `continue_context` feeding each row its own question (distinct pydoc tokens) and
generating `--new-tokens` greedy tokens without a stop token, timed on a second call after a
compiling one; the same for the shared context with each question fed in one chunk
(`feed_chunk=--question-tokens`) instead of one decode step per token; and whether the ways
generated the same tokens. Writes a JSON and a Markdown table.
"""

import argparse
import json
import pathlib
import time

import jax
import numpy as np

from benchmarks.generate_speed import pydoc_prompt_ids
from kvjax.compressed_context import (
  compress_context,
  continue_context,
  repeat_context,
  share_context,
)
from kvjax.eval.machine import machine_description
from kvjax.method_spec import parse_method_spec
from models.loading import load_model

HERE = pathlib.Path(__file__).parent
MIB = 2**20


def timed_answers(model, rows, questions, new_tokens, feed_chunk=None):
  run = lambda: continue_context(
    model.decoder, model.params, rows, questions, max_new_tokens=new_tokens, feed_chunk=feed_chunk
  )
  run()  # compile
  start = time.perf_counter()
  tokens, _ = run()
  return tokens, time.perf_counter() - start


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--context", type=int, default=4096)
  parser.add_argument("--questions", type=int, nargs="+", default=[1, 4, 16])
  parser.add_argument("--methods", nargs="+", default=["full", "kivi:bits=2", "snapkv:ratio=0.25"])
  parser.add_argument("--question-tokens", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--out", default=str(HERE / "results" / "shared_context"))
  args = parser.parse_args(argv)

  model = load_model("smollm2-135m", layer_loop="scan")
  most = max(args.questions)
  ids = pydoc_prompt_ids(model.tokenizer, args.context + most * args.question_tokens)
  document = ids[: args.context]
  all_questions = [
    ids[args.context + i * args.question_tokens : args.context + (i + 1) * args.question_tokens]
    for i in range(most)
  ]
  room = args.question_tokens + args.new_tokens
  rows_out = []
  for spec in args.methods:
    method = parse_method_spec(spec)
    compress = lambda room, method=method: jax.block_until_ready(
      compress_context(model.decoder, model.params, [document], cache_method=method, room=room)
    )
    with_room, without_room = compress(room), compress(0)
    for n in args.questions:
      questions = all_questions[:n]
      repeated = repeat_context(with_room, n)
      shared = share_context(model.decoder, without_room, n, room=room)
      repeated_tokens, repeated_s = timed_answers(model, repeated, questions, args.new_tokens)
      shared_tokens, shared_s = timed_answers(model, shared, questions, args.new_tokens)
      chunked_tokens, chunked_s = timed_answers(
        model, shared, questions, args.new_tokens, feed_chunk=args.question_tokens
      )
      row = dict(
        method=spec,
        questions=n,
        context_bytes=without_room.cache_bytes,
        repeated_bytes=repeated.cache_bytes,
        shared_bytes=shared.cache_bytes,
        repeated_s=repeated_s,
        shared_s=shared_s,
        shared_fed_in_chunks_s=chunked_s,
        same_tokens=bool(np.array_equal(repeated_tokens, shared_tokens)),
        same_tokens_fed_in_chunks=bool(np.array_equal(shared_tokens, chunked_tokens)),
      )
      rows_out.append(row)
      print(json.dumps(row), flush=True)

  record = dict(
    machine=machine_description(),
    jax_version=jax.__version__,
    context_tokens=args.context,
    question_tokens=args.question_tokens,
    new_tokens=args.new_tokens,
    rows=rows_out,
  )
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(record, indent=1))
  lines = [
    f"SmolLM2-135M, a {args.context}-token pydoc document, each question {args.question_tokens} "
    f"tokens then {args.new_tokens} greedy tokens; {record['machine']}, jax {jax.__version__}.",
    "",
    "| method | questions | context MiB | repeated MiB | shared MiB | repeated s | shared s "
    "| shared, question in one chunk s | same tokens (repeated, shared) | same tokens (shared "
    "token by token, in one chunk) |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows_out:
    lines.append(
      f"| {r['method']} | {r['questions']} | {r['context_bytes'] / MIB:.2f} | "
      f"{r['repeated_bytes'] / MIB:.2f} | {r['shared_bytes'] / MIB:.2f} | "
      f"{r['repeated_s']:.2f} | {r['shared_s']:.2f} | {r['shared_fed_in_chunks_s']:.2f} | "
      f"{r['same_tokens']} | {r['same_tokens_fed_in_chunks']} |"
    )
  out.with_suffix(".md").write_text("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
