"""Why a kernel's generated tokens leave the reference path's: teacher-forced logits, step by step.

`generate_kernels_check.py` compares tokens. When they differ (KERNEL_NOTES v29: the folded
kernels on a bf16 cache, on an H200), this tells a near tie from a real difference: both paths
are fed the reference path's own tokens, and at every step it prints, per row, the reference's
margin between its two best logits and the largest logit difference between the two paths. A
flip where the margin is below the logit difference, with differences of the size seen at the
steps that did not flip, is a near tie; a logit difference far above the others is not.

    python benchmarks/generate_logit_margins.py [--spec kivi:bits=4,residual=32]
        [--kernel-config '{"variant": "folded"}'] [--cache-dtype bfloat16] [--implementation pallas]
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.generate_kernels_check import CONFIG, prompts_of_record
from kvjax.generate import generate, prefill
from kvjax.kernel_settings import KernelSettings
from kvjax.method_spec import parse_method_spec
from kvjax.prompt_batch import pack_prompts
from models.nnx_decoder import split_decoder
from models.weights import random_decoder


def teacher_forced_logits(decoder, params, tokens, lengths, forced, method, cache_dtype):
  """float32 [steps, batch, vocab]: each step's next-token logits, fed `forced` [batch, steps]."""
  steps = forced.shape[1]
  logits, caches = prefill(
    decoder,
    params,
    tokens,
    lengths,
    cache_method=method,
    max_new_tokens=steps,
    cache_dtype=cache_dtype,
  )
  decode_step = jax.jit(decoder.decode_step)
  out = [np.asarray(logits, np.float32)]
  for step in range(steps - 1):
    logits, caches = decode_step(params, jnp.asarray(forced[:, step]), lengths + step, caches)
    out.append(np.asarray(logits, np.float32))
  return np.stack(out)


def margins_table(reference_logits, other_logits) -> list[dict]:
  """Per step and row: the reference's top-two margin, the largest |logit difference|, and
  whether the two paths' best tokens agree."""
  top_two = np.sort(reference_logits, axis=-1)[..., -2:]
  margin = top_two[..., 1] - top_two[..., 0]
  difference = np.abs(other_logits - reference_logits).max(axis=-1)
  same_best = reference_logits.argmax(-1) == other_logits.argmax(-1)
  return [
    dict(
      step=step,
      row=row,
      margin=float(margin[step, row]),
      max_logit_difference=float(difference[step, row]),
      same_best=bool(same_best[step, row]),
    )
    for step in range(margin.shape[0])
    for row in range(margin.shape[1])
  ]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
  """The teacher-forced run's options (`attention_calls_check.py` takes them too): the cache's
  dtype, the kernels natively or interpreted, and the steps."""
  parser.add_argument("--cache-dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument(
    "--implementation",
    default="pallas",
    choices=("pallas", "interpret"),
    help="the kernels natively (an accelerator) or interpreted (CPU)",
  )
  parser.add_argument("--steps", type=int, default=16)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--spec", default="kivi:bits=4,residual=32")
  parser.add_argument("--kernel-config", default='{"variant": "folded"}')
  add_run_arguments(parser)
  args = parser.parse_args()
  print(jax.__version__, jax.devices())
  cache_dtype = jnp.dtype(args.cache_dtype)
  settings = KernelSettings(quantized=json.loads(args.kernel_config))
  decoder, params = split_decoder(random_decoder(CONFIG, seed=0))
  prompts = prompts_of_record()
  methods = {
    impl: parse_method_spec(args.spec, implementation=impl, kernel_settings=settings)
    for impl in ("reference", args.implementation)
  }
  reference_run = generate(
    decoder,
    params,
    prompts,
    max_new_tokens=args.steps,
    cache_dtype=cache_dtype,
    cache_method=methods["reference"],
  )
  tokens, lengths = pack_prompts(prompts)
  logits = {
    impl: teacher_forced_logits(
      decoder, params, tokens, lengths, reference_run.tokens, method, cache_dtype
    )
    for impl, method in methods.items()
  }
  if not np.array_equal(logits["reference"].argmax(-1).T, reference_run.tokens):
    print("note: the stepped reference path does not reproduce generate's reference tokens")
  rows = margins_table(logits["reference"], logits[args.implementation])
  print(f"{args.spec} {dict(settings.quantized)} {cache_dtype.name}, {args.implementation}")
  print(f"{'step':>4} {'row':>3} {'margin':>10} {'max |dlogit|':>13} same best")
  for entry in rows:
    print(
      f"{entry['step']:4d} {entry['row']:3d} {entry['margin']:10.4f} "
      f"{entry['max_logit_difference']:13.4f} {entry['same_best']}"
    )
  flips = [entry for entry in rows if not entry["same_best"]]
  unflipped = [entry["max_logit_difference"] for entry in rows if entry["same_best"]]
  print(
    f"flips: {len(flips)}; max |dlogit| where the best token agreed: "
    f"median {np.median(unflipped):.4f}, max {np.max(unflipped):.4f}"
  )


if __name__ == "__main__":
  main()
