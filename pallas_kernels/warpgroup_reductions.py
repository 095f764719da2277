"""Reductions over axis 0 of a wgmma-layout array through the warpgroup's own shared-memory
scratch: what the folded Mosaic GPU kernel uses when a program runs several warpgroups
(`warpgroups_per_program`, KERNEL_NOTES v42).

Axis 0 of a wgmma-layout array spreads over the four warps of a warpgroup (row 16 warp + lane / 4
of each 64-row tile), so reducing it needs shared memory: each warp stores its partial results,
the warpgroup synchronises (its own named barrier), and each warp reads the others'
(`FragmentedArray.reduce`). Pallas lowers `x.sum(axis=0)` with one scratch buffer at one offset
for the whole program (`CompilerParams.reduction_scratch_bytes`): warpgroups of one program
reducing at the same time would overwrite each other's partials. Here each warpgroup hands the
same reduction a buffer of its own. A kernel that uses this sets Pallas's scratch to 0 bytes, so
that a reduction left on the shared buffer fails to lower instead of racing.

Native only (`plgpu.inline_mgpu`). In interpret mode (`emulate=True`) each warpgroup holds whole
arrays and jnp reduces them.
"""

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

# Per warpgroup: one round of 4 warps x 32 lanes x 2 f32 registers (the wgmma row layout's
# vector of 2 columns), as Pallas's own reduction scratch holds for the folded kernel.
SCRATCH_WORDS = 256
REDUCTIONS = ("add", "max")


def reduce_rows(x: jax.Array, op: str, scratch_ref, *, emulate: bool) -> jax.Array:
  """f32 [n, m] in the wgmma layout -> [m] (`plgpu.Layout.WGMMA.reduce(0)`): the sum ("add") or
  the max ("max": NaN propagates, as jnp.max) over axis 0, through `scratch_ref` (f32
  [SCRATCH_WORDS] in shared memory, this warpgroup's alone)."""
  _check_op(op)
  if emulate:
    return shared_reduce_rows(x, op)

  @plgpu.inline_mgpu(
    arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
    return_type=plgpu.ShapeDtypeStruct((x.shape[1],), x.dtype, layout=plgpu.Layout.WGMMA.reduce(0)),
  )
  def reduce(_, array, scratch):
    return array.reduce(op, 0, scratch=scratch)

  return reduce(x, scratch_ref)


def shared_reduce_rows(x: jax.Array, op: str) -> jax.Array:
  """The same reduction through Pallas's program-wide scratch (one warpgroup per program), or
  as jnp computes it in interpret mode."""
  _check_op(op)
  return x.sum(axis=0) if op == "add" else x.max(axis=0)


def _check_op(op) -> None:
  """ValueError naming `op` and REDUCTIONS."""
  if op not in REDUCTIONS:
    raise ValueError(f"op={op!r} is not supported; allowed: {REDUCTIONS}")
