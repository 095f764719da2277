"""Compile seconds of kvjax's programs with the decoder's layers unrolled or scanned.

    python benchmarks/layer_loop_compile.py --layer-loop scan --methods full kivi:bits=2

For each method: lowering and XLA compile seconds of the jitted prefill (batch 1, a
`--context-len` prompt, room for 64 new tokens), the `while_loop` decode and the
`--continuation-len`-step teacher forcing, then the teacher forcing's run time (after
compilation, so its seconds per step are the decode step's cost through that cache).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.eval.text_corpus import pydoc_topics_text
from kvjax.generate import decode, prefill
from kvjax.method_spec import parse_method_spec
from kvjax.sampling import SamplingConfig
from kvjax.teacher_forcing import teacher_force
from models.loading import load_model


def _lower_and_compile(jitted, *args, **static):
  start = time.perf_counter()
  lowered = jitted.lower(*args, **static)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  return compiled, lowered_at - start, time.perf_counter() - lowered_at


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layer-loop", choices=("unroll", "scan"), default="scan")
  parser.add_argument("--methods", nargs="+", default=["full", "kivi:bits=2", "gear:bits=2"])
  parser.add_argument("--context-len", type=int, default=1024)
  parser.add_argument("--continuation-len", type=int, default=256)
  args = parser.parse_args()
  model = load_model("smollm2-135m", layer_loop=args.layer_loop)
  decoder, params = model.decoder, model.params
  ids = np.asarray(model.tokenizer.encode(pydoc_topics_text()), np.int32)
  context = jnp.asarray(ids[None, : args.context_len])
  forced = jnp.asarray(ids[None, args.context_len : args.context_len + args.continuation_len])
  lengths = jnp.array([args.context_len], jnp.int32)
  print(f"layer loop {args.layer_loop}; {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print(
    "method | prefill lower/compile s | decode lower/compile s | teacher forcing lower/"
    "compile s | teacher forcing run s (per step ms)"
  )
  for spec in args.methods:
    method = parse_method_spec(spec)
    static = dict(cache_method=method, max_new_tokens=64, cache_dtype=jnp.bfloat16)
    _, p_lower, p_compile = _lower_and_compile(prefill, decoder, params, context, lengths, **static)
    logits, caches = jax.eval_shape(
      lambda static=static: prefill(decoder, params, context, lengths, **static)
    )
    _, d_lower, d_compile = _lower_and_compile(
      decode,
      decoder,
      params,
      logits,
      caches,
      lengths,
      jax.random.key(0),
      max_new_tokens=64,
      sampling=SamplingConfig(),
      stop_token_ids=(),
      pad_token_id=0,
    )
    static["max_new_tokens"] = args.continuation_len
    logits, caches = prefill(decoder, params, context, lengths, **static)
    compiled, t_lower, t_compile = _lower_and_compile(
      teacher_force, decoder, params, logits, caches, lengths, forced
    )
    start = time.perf_counter()
    jax.block_until_ready(compiled(params, logits, caches, lengths, forced))
    run = time.perf_counter() - start
    print(
      f"{spec} | {p_lower:.1f}/{p_compile:.1f} | {d_lower:.1f}/{d_compile:.1f} | "
      f"{t_lower:.1f}/{t_compile:.1f} | {run:.1f} ({1e3 * run / forced.shape[1]:.0f})",
      flush=True,
    )


if __name__ == "__main__":
  main()
