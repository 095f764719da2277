"""kvjax generation speed on the embedded SmolLM2-135M: prefill s, decode tok/s, compile s.

    python benchmarks/generate_speed.py --prompt-len 1000 --new-tokens 128 [--method full]

Same prompt construction as benchmarks/transformers_decode_baseline.py (CPython pydoc topics,
cut to --prompt-len tokens), batch 1, greedy; if that script's JSON exists, prints the ratio.
"""

import argparse
import json
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp

from kvjax.generate import generate
from kvjax.method_spec import parse_method_spec
from models.loading import load_model

HERE = pathlib.Path(__file__).parent


def pydoc_prompt_ids(tokenizer, prompt_len: int) -> list[int]:
  from pydoc_data.topics import topics

  text = "".join(topics[name] for name in sorted(topics))  # as the transformers baseline builds it
  ids = tokenizer.encode(text[: prompt_len * 12])
  if len(ids) < prompt_len:
    raise ValueError(f"pydoc text gave only {len(ids)} tokens; need {prompt_len}")
  return ids[:prompt_len]


def main():
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--model", default="smollm2-135m")
  parser.add_argument("--prompt-len", type=int, default=1000)
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--method", default="full")
  parser.add_argument(
    "--cache-dtype", default="float32", help="float32 matches the transformers baseline"
  )
  parser.add_argument("--layer-loop", choices=("unroll", "scan"), default="unroll")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=str(HERE / "results" / "generate_speed.json"))
  args = parser.parse_args()

  load_start = time.perf_counter()
  loaded = load_model(args.model, layer_loop=args.layer_loop)
  load_s = time.perf_counter() - load_start
  method = parse_method_spec(args.method)
  prompt = pydoc_prompt_ids(loaded.tokenizer, args.prompt_len)
  runs = [
    generate(
      loaded.decoder,
      loaded.params,
      [prompt],
      max_new_tokens=args.new_tokens,
      cache_method=method,
      cache_dtype=jnp.dtype(args.cache_dtype),
    )
    for _ in range(args.repeats)
  ]
  median = lambda xs: sorted(xs)[len(xs) // 2]
  record = dict(
    model=args.model,
    method=args.method,
    layer_loop=args.layer_loop,
    prompt_tokens=args.prompt_len,
    new_tokens=args.new_tokens,
    cache_dtype=args.cache_dtype,
    load_s=load_s,
    compile_s=runs[0].compile_s,
    prefill_s=median([r.prefill_s for r in runs]),
    decode_tokens_per_s=median([r.decode_tokens_per_s for r in runs]),
    all_prefill_s=[r.prefill_s for r in runs],
    all_decode_tokens_per_s=[r.decode_tokens_per_s for r in runs],
    cache_bytes=runs[0].cache_bytes,
    generated_ids=runs[0].tokens[0].tolist(),
    jax_version=jax.__version__,
    backend=jax.default_backend(),
    device=jax.devices()[0].device_kind,
    cpus=os.cpu_count(),
    machine=platform.processor(),
  )
  baseline_path = HERE / "results" / "transformers_decode_baseline.json"
  if baseline_path.exists():
    baseline = json.loads(baseline_path.read_text())
    record["transformers_decode_tokens_per_s"] = baseline["decode_tokens_per_s"]
    record["transformers_prefill_s"] = baseline["prefill_s"]
    record["decode_speedup_vs_transformers"] = (
      record["decode_tokens_per_s"] / baseline["decode_tokens_per_s"]
    )
    # The baseline may hold one token more (the prediction after its last decode step).
    theirs = baseline.get("generated_ids", [])[: len(record["generated_ids"])]
    record["same_greedy_tokens_as_transformers"] = theirs == record["generated_ids"]
  pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.out).write_text(json.dumps(record, indent=2))
  for key in (
    "compile_s",
    "prefill_s",
    "decode_tokens_per_s",
    "transformers_prefill_s",
    "transformers_decode_tokens_per_s",
    "decode_speedup_vs_transformers",
    "same_greedy_tokens_as_transformers",
  ):
    if key in record:
      print(f"{key:36s} {record[key]}")


if __name__ == "__main__":
  main()
