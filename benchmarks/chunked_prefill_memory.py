"""Working memory of a prefill in one piece and in chunks, on the embedded SmolLM2-135M.

    PYTHONPATH=. python benchmarks/chunked_prefill_memory.py --context 8192 \\
        --chunks none 512 --methods full kivi:bits=2 snapkv:ratio=0.25 --run-context 2048

For each method and chunk size the prefill program is compiled ahead of time and XLA's own
accounting is read off it (`compiled.memory_analysis()`): `temp` is the working memory the
program needs besides its arguments (weights, prompt) and outputs (logits, caches). With
`--run-context N` the prefill of an N-token pydoc prompt also runs once after a warm-up run:
its time, and the largest |logit difference| from the one-piece prefill of the same method.
Writes a JSON and a Markdown table.
"""

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.generate_speed import pydoc_prompt_ids
from kvjax.cache_protocol import model_cache_nbytes
from kvjax.eval.machine import machine_description
from kvjax.generate import prefill
from kvjax.method_spec import parse_method_spec
from models.loading import load_model

HERE = pathlib.Path(__file__).parent
MIB = 2**20


def pydoc_prompt(tokenizer, length: int) -> np.ndarray:
  return np.asarray([pydoc_prompt_ids(tokenizer, length)], np.int32)


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--model", default="smollm2-135m")
  parser.add_argument("--context", type=int, default=8192, help="prompt tokens (compiled only)")
  parser.add_argument("--chunks", nargs="+", default=["none", "512"], help="'none' or ints")
  parser.add_argument("--methods", nargs="+", default=["full", "kivi:bits=2", "snapkv:ratio=0.25"])
  parser.add_argument("--new-tokens", type=int, default=256, help="room the caches are given")
  parser.add_argument("--cache-dtype", default="bfloat16")
  parser.add_argument("--run-context", type=int, default=0, help="also run at this length")
  parser.add_argument("--out", default=str(HERE / "results" / "chunked_prefill_memory"))
  args = parser.parse_args()

  chunks = [None if c == "none" else int(c) for c in args.chunks]
  loaded = load_model(args.model, layer_loop="scan")
  dtype = jnp.dtype(args.cache_dtype)
  rows = []
  for spec in args.methods:
    method = parse_method_spec(spec)
    one_piece_logits = None
    for chunk in chunks:
      static = dict(
        cache_method=method,
        max_new_tokens=args.new_tokens,
        cache_dtype=dtype,
        prefill_chunk=chunk,
      )
      tokens = jax.ShapeDtypeStruct((1, args.context), jnp.int32)
      lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
      start = time.perf_counter()
      compiled = prefill.lower(loaded.decoder, loaded.params, tokens, lengths, **static).compile()
      compile_s = time.perf_counter() - start
      memory = compiled.memory_analysis()
      _, caches = jax.eval_shape(
        lambda t, n, static=static: prefill(loaded.decoder, loaded.params, t, n, **static),
        tokens,
        lengths,
      )
      row = dict(
        method=spec,
        context=args.context,
        prefill_chunk=chunk,
        temp_mib=memory.temp_size_in_bytes / MIB,
        output_mib=memory.output_size_in_bytes / MIB,
        argument_mib=memory.argument_size_in_bytes / MIB,
        cache_mib=model_cache_nbytes(caches) / MIB,
        compile_s=compile_s,
        run_context=None,
        run_s=None,
        max_logit_diff_from_one_piece=None,
      )
      if args.run_context:
        prompt = pydoc_prompt(loaded.tokenizer, args.run_context)
        run_lengths = np.array([args.run_context], np.int32)

        def run(static=static, prompt=prompt, run_lengths=run_lengths):
          return jax.block_until_ready(
            prefill(loaded.decoder, loaded.params, prompt, run_lengths, **static)
          )

        run()
        start = time.perf_counter()
        logits, _ = run()
        row.update(run_context=args.run_context, run_s=time.perf_counter() - start)
        logits = np.asarray(logits, np.float32)
        if chunk is None:
          one_piece_logits = logits
        elif one_piece_logits is not None:
          row["max_logit_diff_from_one_piece"] = float(np.abs(logits - one_piece_logits).max())
      rows.append(row)
      print(json.dumps(row))

  header = (
    f"SmolLM2-135M ({args.model}), prefill of {args.context} tokens, batch 1, caches "
    f"{args.cache_dtype} with room for {args.new_tokens} more; {machine_description()}"
  )
  table = [
    "| method | prefill_chunk | XLA temp MiB | caches MiB | compile s | run s | max logit diff |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    fmt = lambda value, spec: "" if value is None else format(value, spec)
    table.append(
      f"| {r['method']} | {r['prefill_chunk'] or 'one piece'} | {r['temp_mib']:.1f} | "
      f"{r['cache_mib']:.2f} | {r['compile_s']:.1f} | {fmt(r['run_s'], '.2f')} | "
      f"{fmt(r['max_logit_diff_from_one_piece'], '.3f')} |"
    )
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(dict(header=header, rows=rows), indent=1))
  out.with_suffix(".md").write_text(header + "\n\n" + "\n".join(table) + "\n")
  print(header)
  print("\n".join(table))


if __name__ == "__main__":
  main()
