"""Where the folded Mosaic GPU kernel's transpose of the value statistics runs, and its cost.

The folded Mosaic GPU kernel reads the value statistics group-major (since v19 as uint32
(scale, minimum) pairs, [B, H, D / group, T]; before, [B, H, 2 D / group, T] bf16); the caches
keep them token-major ([B, H, T, D / group]), so its wrapper transposes them at every call
(KERNEL_NOTES v12, v18, v19). Two parts, GPU only:

  timing  time per call at decode_attention.py's 32k shapes (KIVI-2, group 32), folded Triton
          (the default) and folded Mosaic GPU: from a host loop of jitted calls (each call takes
          the cache in its default layout, so it pays the transpose) and in
          decode_attention.time_op's jitted loop (where XLA may carry the cache in the layout the
          kernel reads and transpose it once, before the loop);
  layout  kvjax's decode loop (`generate`, a tiny random Llama, KIVI-4, bf16 cache, folded
          Mosaic GPU kernel) compiled with an HLO dump: every transpose of a value-statistics
          array is reported as inside the decode `while` (paid at every step) or outside it
          (paid once per `generate` call), with the decode speed beside folded Triton's.

    PYTHONPATH=. python benchmarks/value_stats_layout.py [--part timing|layout|both]
"""

import argparse
import math
import os
import re
import sys
import tempfile

FOLDED_MOSAIC = {"lowering": "mosaic_gpu", "variant": "folded"}
KIVI_GROUP = 32  # kivi's default group size (both parts): channels per value-statistics group

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"\b(?:calls|body|condition|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
WHILE_BODY = re.compile(r"\swhile\(.*\bbody=%?([\w.\-]+)")  # a while loop's body name
_TRANSPOSE = re.compile(r"=\s*\w+\[([\d,]*)\]\{[\d,]*\}\s+transpose\(.*dimensions=\{([\d,]*)\}")


def split_computations(hlo_text: str) -> dict[str, list[str]]:
  """Optimised HLO text -> {computation name: its instruction lines}; ENTRY is named "ENTRY"."""
  computations: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line) if line and not line[0].isspace() else None
    if header:
      current = "ENTRY" if line.startswith("ENTRY") else header.group(1)
      computations[current] = []
    elif current is not None and line.strip() and line.strip() != "}":
      computations[current].append(line)
  return computations


def _called(line: str) -> list[str]:
  names = _CALLED.findall(line)
  for group in _BRANCHES.findall(line):
    names += [name.strip().lstrip("%") for name in group.split(",") if name.strip()]
  return names


def computations_inside_loops(computations: dict[str, list[str]]) -> set[str]:
  """Names of the computations a `while` body runs, directly or through calls and fusions."""
  inside, pending = set(), []
  for lines in computations.values():
    for line in lines:
      match = WHILE_BODY.search(line)
      if match:
        pending.append(match.group(1))
  while pending:
    name = pending.pop()
    if name in inside or name not in computations:
      continue
    inside.add(name)
    for line in computations[name]:
      pending += _called(line)
  return inside


def value_stats_transposes(hlo_text: str, token_major_shape: tuple) -> dict[str, int]:
  """Transposes between `token_major_shape` [..., T, G] and [..., G, T] (the last two axes
  swapped; a None dimension matches any size), counted by where they run:
  {"inside_loop": n, "outside_loop": m}."""
  rank = len(token_major_shape)
  group_major = (*token_major_shape[:-2], token_major_shape[-1], token_major_shape[-2])
  swap = ",".join(str(i) for i in (*range(rank - 2), rank - 1, rank - 2))

  def matches(shape, pattern):
    return len(shape) == rank and all(p is None or p == d for d, p in zip(shape, pattern))

  computations = split_computations(hlo_text)
  inside = computations_inside_loops(computations)
  counts = {"inside_loop": 0, "outside_loop": 0}
  for name, lines in computations.items():
    for line in lines:
      match = _TRANSPOSE.search(line)
      if not match or match.group(2) != swap:
        continue
      shape = tuple(int(d) for d in match.group(1).split(",") if d)
      if matches(shape, token_major_shape) or matches(shape, group_major):
        counts["inside_loop" if name in inside else "outside_loop"] += 1
  return counts


def timing(args) -> None:
  import jax
  import jax.numpy as jnp

  from benchmarks.decode_attention import time_op
  from benchmarks.gear_terms_parts import time_call
  from kvjax import attention_dispatch
  from pallas_kernels.random_inputs import random_quantized_segment

  batch, kv_heads, group, head_dim, tokens = 8, 8, 4, 128, args.tokens
  keys = jax.random.split(jax.random.key(11), 2)
  queries = jax.random.normal(keys[0], (batch, kv_heads, group, head_dim)).astype(jnp.bfloat16)
  segment = random_quantized_segment(
    keys[1], batch, kv_heads, tokens, head_dim, bits=2, group_size=KIVI_GROUP, dtype=jnp.bfloat16
  )
  lengths = jnp.full((batch,), tokens, jnp.int32)
  for name, config in (
    ("folded Triton", {"variant": "folded"}),
    ("folded Mosaic GPU", FOLDED_MOSAIC),
  ):

    def op(q, segment, lengths, config=config):
      return attention_dispatch.quantized_decode_attention(
        q,
        *segment[:6],
        lengths,
        bits=2,
        group_size=KIVI_GROUP,
        sm_scale=1 / math.sqrt(head_dim),
        implementation="pallas",
        kernel_config=config,
      )

    host = time_call(op, (queries, segment, lengths), iters=args.iters, repeats=args.repeats)
    looped = time_op(op, (queries, segment, lengths), iters=args.iters, repeats=args.repeats)
    print(
      f"{tokens} tokens, {name:18s} host loop of jitted calls {host * 1e6:7.1f} us/call, "
      f"jitted loop {looped * 1e6:7.1f} us/call",
      flush=True,
    )


def layout(args) -> None:
  # The dump flag must be in XLA_FLAGS before jax starts its backend.
  dump = tempfile.mkdtemp(prefix="value_stats_layout_")
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_in_jit.*"
  )
  import jax.numpy as jnp
  import numpy as np

  from benchmarks.generate_kernels_check import CONFIG
  from kvjax.generate import generate
  from kvjax.kernel_settings import KernelSettings
  from kvjax.method_spec import parse_method_spec
  from models.nnx_decoder import split_decoder
  from models.weights import random_decoder

  decoder, params = split_decoder(random_decoder(CONFIG, seed=0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, CONFIG.vocab_size, n).tolist() for n in args.prompt_tokens]
  for name, settings in (
    ("folded Triton", KernelSettings()),
    ("folded Mosaic GPU", KernelSettings(quantized=FOLDED_MOSAIC)),
  ):
    before = set(os.listdir(dump))
    for _ in range(2):  # the second run's decode speed, after compiling
      run = generate(
        decoder,
        params,
        prompts,
        max_new_tokens=args.new_tokens,
        cache_dtype=jnp.bfloat16,
        cache_method=parse_method_spec(
          f"kivi:bits=4,residual=32,group_size={KIVI_GROUP}",
          implementation="pallas",
          kernel_settings=settings,
        ),
      )
    optimised = [f for f in set(os.listdir(dump)) - before if f.endswith("after_optimizations.txt")]
    # [rows, KV heads, cache tokens (any), value groups]
    stats_shape = (len(prompts), CONFIG.num_kv_heads, None, CONFIG.head_dim // KIVI_GROUP)
    for file in optimised:
      with open(os.path.join(dump, file)) as f:
        counts = value_stats_transposes(f.read(), stats_shape)
      print(
        f"{name:18s} decode {run.decode_tokens_per_s:7.0f} tok/s; value statistics "
        f"{[d or 'T' for d in stats_shape]}: transposes inside the decode loop "
        f"{counts['inside_loop']}, outside it {counts['outside_loop']} ({file})",
        flush=True,
      )


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", default="both", choices=("timing", "layout", "both"))
  parser.add_argument("--tokens", type=int, default=32768, help="timing: context length")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[3000, 2900])
  parser.add_argument("--new-tokens", type=int, default=64)
  args = parser.parse_args()
  if args.part in ("layout", "both"):
    layout(args)  # first: it sets XLA_FLAGS before jax is imported
  if args.part in ("timing", "both"):
    timing(args)


if __name__ == "__main__":
  sys.exit(main())
