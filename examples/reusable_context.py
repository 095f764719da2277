"""Compress a ~2k-token document's cache once, save it to disk, restore it and ask it several
questions with the embedded SmolLM2.

python examples/reusable_context.py [--method SPEC] [--directory DIR]

The document is CPython's reference text for the `try` statement (shipped with Python, read
offline). Its cache is compressed before any question is seen (the query-agnostic setting: a
reused cache cannot know the questions to come), written with orbax-checkpoint, restored into a
template of the same method and shapes, and each question is fed through the restored
compressed cache and answered. The answers from the restored context are checked against the
answers from the context still in memory (the same program on the same arrays: they must be
equal), and then all questions are asked at once, in one batch of the context repeated on
device (`repeat_context`) and in one batch sharing the context held once (`share_context`: each
question and answer kept in full precision beside it, so a quantizing method may answer a little
differently). A batch computes the same attention in other pieces, which a bf16 cache rounds
differently: a near-tie may then flip a greedy token and the rest of that answer (README,
"Reusable compressed contexts"); the script reports where the answers part.
"""

import argparse
import pathlib
import tempfile
import time
from pydoc_data.topics import topics

import jax

from kvjax.compressed_context import (
  compress_context,
  context_template,
  continue_context,
  repeat_context,
  share_context,
)
from kvjax.context_checkpoint import read_context_record, restore_context, save_context
from kvjax.method_spec import parse_method_spec
from models.loading import load_model

QUESTIONS = (
  "In one sentence: when does the finally clause of a try statement run?",
  "Which exception does a bare except clause catch?",
)
ANSWER_TOKENS = 48


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--method", default="kivi:bits=4", help="cache method spec")
  parser.add_argument("--directory", help="where to save the context (default: a temporary one)")
  args = parser.parse_args(argv)

  model = load_model("smollm2-135m", layer_loop="scan")
  method = parse_method_spec(args.method)
  document_ids, question_ids = model.tokenizer.chat_document_and_questions(
    topics["try"], list(QUESTIONS)
  )
  room = max(map(len, question_ids)) + ANSWER_TOKENS
  print(f"document: {len(document_ids)} tokens, method {args.method}, room {room} tokens")

  def answer_rows(context, questions):  # one question per row of the context
    tokens, count = continue_context(
      model.decoder,
      model.params,
      context,
      questions,
      max_new_tokens=ANSWER_TOKENS,
      stop_token_ids=model.stop_token_ids,
    )
    return [row[:n].tolist() for row, n in zip(tokens, count)]

  ask = lambda context, ids: answer_rows(context, [ids])[0]

  start = time.perf_counter()
  context = jax.block_until_ready(
    compress_context(model.decoder, model.params, [document_ids], cache_method=method, room=room)
  )
  full = context_template(
    model.decoder,
    model.params,
    batch=1,
    prompt_len=len(document_ids),
    cache_method=parse_method_spec("full"),
    room=room,
  )
  print(
    f"compressed in {time.perf_counter() - start:.1f} s: cache {context.cache_bytes / 2**20:.2f} "
    f"MiB (full cache {full.cache_bytes / 2**20:.2f} MiB, "
    f"{full.cache_bytes / context.cache_bytes:.2f}x smaller)"
  )

  with tempfile.TemporaryDirectory() as scratch:
    directory = pathlib.Path(args.directory or pathlib.Path(scratch) / "try_statement")
    start = time.perf_counter()
    disk_bytes = save_context(
      directory,
      context,
      metadata={"model": "smollm2-135m", "method": args.method, "document": "topics['try']"},
    )
    print(
      f"saved to {directory} in {time.perf_counter() - start:.1f} s: "
      f"{disk_bytes / 2**20:.2f} MiB on disk"
    )
    start = time.perf_counter()
    template = context_template(
      model.decoder,
      model.params,
      batch=1,
      prompt_len=len(document_ids),
      cache_method=method,
      room=room,
    )
    restored = restore_context(directory, template)
    print(
      f"restored in {time.perf_counter() - start:.1f} s "
      f"(saved with {read_context_record(directory)['metadata']})\n"
    )

  answers, one_at_a_time_s = [], 0.0
  for question, ids in zip(QUESTIONS, question_ids):
    answer = ask(restored, ids)
    same = answer == ask(context, ids)
    start = time.perf_counter()  # compiled by the call above
    ask(context, ids)
    one_at_a_time_s += time.perf_counter() - start
    answers.append(answer)
    print(f"Q: {question}\nA: {model.tokenizer.decode(answer)}")
    print(f"(same answer from the context in memory: {same})\n")
    if not same:
      raise SystemExit("the restored context answered differently from the one in memory")

  # Every question at once, one row per question: the context repeated on device, or held
  # once and shared by the rows, each keeping its question and answer in full precision.
  repeated = repeat_context(context, len(question_ids))
  shared = share_context(model.decoder, context, len(question_ids), room=room)
  timings, batched = {}, {}
  for name, rows in (("repeat_context", repeated), ("share_context", shared)):
    answer_rows(rows, question_ids)  # compile
    start = time.perf_counter()
    batched[name] = answer_rows(rows, question_ids)
    timings[name] = time.perf_counter() - start
  print(f"{len(QUESTIONS)} questions one at a time: {one_at_a_time_s:.1f} s")
  for name, rows in (("repeat_context", repeated), ("share_context", shared)):
    print(
      f"in one batch ({name}): {timings[name]:.1f} s, caches {rows.cache_bytes / 2**20:.2f} "
      f"MiB; same answers: {batched[name] == answers}"
    )
  for question, alone, in_batch in zip(QUESTIONS, answers, batched["repeat_context"]):
    if alone != in_batch:
      parted = next(
        (i for i, (a, b) in enumerate(zip(alone, in_batch)) if a != b),
        min(map(len, (alone, in_batch))),
      )
      print(
        f"Q: {question}\nthe batch of copies answered differently from token {parted} on "
        f"(bf16 rounding):\nA (repeat_context): {model.tokenizer.decode(in_batch)}"
      )
  for question, answer in zip(QUESTIONS, batched["share_context"]):
    print(f"Q: {question}\nA (share_context): {model.tokenizer.decode(answer)}")


if __name__ == "__main__":
  main()
