"""Runs one quantized decode-attention kernel a few times at the benchmark's shapes, for a
profiler (Nsight Compute) to attach to. Prints nothing but the time of the last call.

  XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --target-processes all \
      --kernel-name regex:quantized_decode_attention --launch-skip 1 --launch-count 1 \
      --set full --import-source no -o rep \
      python benchmarks/profile_quantized_kernel.py --bits 2 --kernel-config '{"prefetch": false}'

For a GEAR segment (`--group-size 64 --rank 4 --outliers 163`, the benchmark's GEAR-2) the
time splits between the kernel and XLA's work around it; `ncu --metrics gpu__time_duration.sum`
without a kernel filter lists every kernel the call launches with its duration.

The Pallas kernel is named after its `pallas_call` (`quantized_decode_attention_<bits>bit_triton`);
with jax's default preallocation of GPU memory the profiled process ran out of memory and crashed
under ncu. `benchmarks/ncu_sass_summary.py` reads the report's SASS page.

Shapes are those of `decode_attention.py`: batch 8, 8 KV heads, 4 query heads per KV head,
head_dim 128, bf16, every row full.
"""

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp

from kvjax import attention_dispatch
from pallas_kernels.random_inputs import random_quantized_segment


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=32768)
  parser.add_argument("--bits", type=int, default=2, choices=(2, 4, 8))
  parser.add_argument("--group-size", type=int, default=32)
  parser.add_argument("--calls", type=int, default=3)
  parser.add_argument("--rank", type=int, default=0, help="GEAR's low rank (0: none)")
  parser.add_argument(
    "--outliers", type=int, default=0, help="GEAR's outliers per 64-token block (0: none)"
  )
  parser.add_argument(
    "--kernel-config",
    default="{}",
    help="JSON dict, as decode_attention.py ({} is the measured default: folded Mosaic GPU on "
    'Hopper at the benchmark\'s shapes; {"variant": "folded"} names folded Triton)',
  )
  parser.add_argument("--implementation", default="pallas", choices=("pallas", "interpret"))
  args = parser.parse_args()
  batch, kv_heads, group, head_dim = 8, 8, 4, 128
  keys = jax.random.split(jax.random.key(0), 2)
  queries = jax.random.normal(keys[0], (batch, kv_heads, group, head_dim)).astype(jnp.bfloat16)
  segment = random_quantized_segment(
    keys[1],
    batch,
    kv_heads,
    args.tokens,
    head_dim,
    bits=args.bits,
    group_size=args.group_size,
    dtype=jnp.bfloat16,
    rank=args.rank,
    outliers_per_block=args.outliers,
  )
  lengths = jnp.full((batch,), args.tokens, jnp.int32)
  kernel_config = json.loads(args.kernel_config)

  @jax.jit
  def attend(queries, segment, lengths):
    return attention_dispatch.quantized_decode_attention(
      queries,
      *segment[:6],
      lengths,
      bits=args.bits,
      group_size=args.group_size,
      sm_scale=1.0 / math.sqrt(head_dim),
      implementation=args.implementation,
      lowrank=segment.lowrank,
      outliers=segment.outliers,
      kernel_config=kernel_config,
    )

  for _ in range(args.calls):
    start = time.perf_counter()
    jax.block_until_ready(attend(queries, segment, lengths))
  print(f"last call {1e6 * (time.perf_counter() - start):.1f} us (host-timed)")


if __name__ == "__main__":
  main()
