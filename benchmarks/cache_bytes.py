"""What each method's caches hold for a context on a model, read from the shapes it allocates.

    PYTHONPATH=. python benchmarks/cache_bytes.py --context 2048 \\
        --methods full kivi gear snapkv:ratio=0.25+kivi:bits=4

The same numbers as `kvjax compare`'s byte columns (`kvjax.eval.cache_size`: cache MiB after the
context in caches allocated for it alone, x smaller, bits/elem, and with `--new-tokens N` MiB
at end, allocated with room for N more), without running the model: for a table whose quality
columns a change of allocation leaves alone, or for a context too long to run here.
"""

import argparse
import json
import pathlib

import jax.numpy as jnp

from kvjax.eval.cache_size import cache_byte_columns, cache_bytes_after_context
from kvjax.eval.report import format_table
from kvjax.method_spec import parse_method_spec
from models.loading import load_model


def byte_rows(decoder, methods: list[str], *, context: int, new_tokens: int) -> list[dict]:
  """compare's byte columns of each method (`MiB at end` only with `new_tokens`)."""
  full_bytes = cache_bytes_after_context(
    decoder, None, parse_method_spec("full"), context_len=context, cache_dtype=jnp.bfloat16
  )
  return [
    dict(
      method=spec,
      **cache_byte_columns(
        decoder,
        parse_method_spec(spec),
        context_len=context,
        cache_dtype=jnp.bfloat16,
        full_bytes=full_bytes,
        new_tokens=new_tokens or None,
      ),
    )
    for spec in methods
  ]


def markdown(rows: list[dict], header: str) -> str:
  return header + "\n\n" + format_table(rows, markdown=True) + "\n"


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--model", default="smollm2-135m")
  parser.add_argument("--context", type=int, required=True)
  parser.add_argument("--new-tokens", type=int, default=0)
  parser.add_argument("--methods", nargs="+", required=True)
  parser.add_argument("--out", type=pathlib.Path, help="writes OUT.json and OUT.md")
  args = parser.parse_args()
  if args.context < 1 or args.new_tokens < 0:
    parser.error(f"--context={args.context} must be >= 1, --new-tokens={args.new_tokens} >= 0")
  decoder = load_model(args.model).decoder
  rows = byte_rows(decoder, args.methods, context=args.context, new_tokens=args.new_tokens)
  header = (
    f"model {args.model}, context {args.context} tokens, room for {args.new_tokens} more "
    "(MiB at end), cache dtype bfloat16; bytes of the allocated shapes (no model run)"
  )
  table = markdown(rows, header)
  print(table)
  if args.out is not None:
    args.out.with_suffix(".json").write_text(json.dumps(dict(header=header, rows=rows), indent=1))
    args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
  main()
