"""Does Pallas Mosaic GPU lower a per-warp key product (KERNEL_NOTES v44), and to what? No GPU.

The per-warp products design (`warp_products_experiment.cu`) takes the key product as
`mma.sync.m16n8k16` per warp. Pallas Mosaic GPU has that as `plgpu.mma` (jax 0.11.2 and 0.12),
with operand layouts `plgpu.Layout.MMA_LHS / MMA_RHS / MMA_ACC(dtype)`: with four warps along M,
each warp holds 16 rows of A and of the accumulator, and B whole (replicated). This probe builds
the smallest kernel of that shape: one warpgroup, a 64-token block's 2-bit key words copied to
shared memory, the key codes masked in place straight into the MMA_LHS layout by inline code
(`word_operand_order.stage_words_in_word_order` with operand_layout="mma_lhs": the registers it
builds for wgmma, indexed for the MMA layout, as Mosaic GPU has no relayout from WGMMA to
MMA_LHS), Q'^T [128, N] loaded from
shared memory in MMA_RHS, `plgpu.mma` into a [64, N] f32 accumulator (MMA_ACC with four warps
along M is the WGMMA layout itself), the scores stored back. It compiles the kernel for a
compile-only H100 (as `mosaic_static_cost.py` does) and prints the SASS opcode counts.

  MOSAIC_GPU_CUDA_ROOT=/usr/local/cuda-13.0 PYTHONPATH=. \\
    .venv-mosaic-analysis/bin/python benchmarks/warp_mma_lowering_probe.py --rows 8 16

`--a-operand shared_memory` loads A from a staged bf16 tile instead (`plgpu.load` with MMA_LHS).
"""

import argparse
import collections
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TOKENS, HEAD_DIM, BITS = 64, 128, 2


def probe_kernel(rows: int, a_operand: str = "registers", operand_layout: str = "mma_lhs"):
  """(kernel, abstract arguments): scores [64, rows] = key codes [64, 128] . Q'^T [128, rows],
  the key codes built in registers in `operand_layout` or loaded from a staged tile."""
  import jax
  import jax.numpy as jnp
  from jax.experimental.pallas import mosaic_gpu as plgpu

  from pallas_kernels.word_operand_order import stage_words_in_word_order

  width = HEAD_DIM * BITS // 32

  def body(
    words_gmem, queries_gmem, a_gmem, out_gmem, words_smem, queries_smem, a_smem, out_smem, barrier
  ):
    for source, destination in (
      (words_gmem, words_smem),
      (queries_gmem, queries_smem),
      (a_gmem, a_smem),
    ):
      plgpu.copy_gmem_to_smem(source, destination, barrier)
    plgpu.barrier_wait(barrier)
    if a_operand == "registers":
      words = plgpu.layout_cast(words_smem[...], plgpu.Layout.WGMMA)
      a = stage_words_in_word_order(words, BITS, operand_layout=operand_layout)
    else:
      a = plgpu.load(a_smem.at[...], layout=plgpu.Layout.MMA_LHS(jnp.bfloat16))
    b = plgpu.load(queries_smem.at[...], layout=plgpu.Layout.MMA_RHS(jnp.bfloat16))
    acc = plgpu.layout_cast(
      jnp.zeros((TOKENS, rows), jnp.float32), plgpu.Layout.MMA_ACC(jnp.bfloat16)
    )
    out_smem[...] = plgpu.mma(acc, a, b)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem)
    plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((TOKENS, rows), jnp.float32),
    scratch_types=[
      plgpu.SMEM((TOKENS, width), jnp.uint32),
      plgpu.SMEM((HEAD_DIM, rows), jnp.bfloat16),
      plgpu.SMEM((TOKENS, HEAD_DIM), jnp.bfloat16),
      plgpu.SMEM((TOKENS, rows), jnp.float32),
      plgpu.Barrier(num_arrivals=3),
    ],
  )
  arguments = (
    jax.ShapeDtypeStruct((TOKENS, width), jnp.uint32),
    jax.ShapeDtypeStruct((HEAD_DIM, rows), jnp.bfloat16),
    jax.ShapeDtypeStruct((TOKENS, HEAD_DIM), jnp.bfloat16),
  )
  return kernel, arguments


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rows", nargs="+", type=int, default=[8, 16], choices=[8, 16])
  parser.add_argument("--a-operand", default="registers", choices=["registers", "shared_memory"])
  args = parser.parse_args()
  # Imported here, before jax: it sets Mosaic GPU's dump environment (and tests import this
  # module for `probe_kernel` without it).
  import mosaic_static_cost
  import triton_static_cost

  device = mosaic_static_cost.compile_only_device()
  for rows in args.rows:
    ptx, _ = mosaic_static_cost.ptx_of(*probe_kernel(rows, args.a_operand), device)
    with tempfile.TemporaryDirectory() as workdir:
      sass, usage, (live, _) = mosaic_static_cost.sass_of(ptx, workdir, "probe")
    opcodes = collections.Counter(
      opcode.split(".")[0] for _, opcode, _ in triton_static_cost.parse_sass(sass)
    )
    registers = usage.strip().splitlines()[-1].split()[0]
    print(
      f"N={rows}, A from {args.a_operand}: {registers}, {live} live, "
      f"{sum(opcodes.values())} instructions: {dict(opcodes.most_common(12))}"
    )


if __name__ == "__main__":
  main()
