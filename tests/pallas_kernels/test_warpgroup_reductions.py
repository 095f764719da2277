"""`warpgroup_reductions`: the emulated reduction is jnp's (NaN propagating), a bad op is named,
and in a program of two warpgroups the warpgroup's own scratch lowers for sm_90 where Pallas's
program-wide scratch, set to 0 bytes as the folded kernel sets it, refuses a cross-warp
reduction (the guard the folded kernel relies on)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _compat
from pallas_kernels.warpgroup_reductions import SCRATCH_WORDS, reduce_rows, shared_reduce_rows


@pytest.mark.parametrize("op", ["add", "max"])
def test_emulated_reduction_is_jnps(op):
  x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
  x[5, 3] = np.nan
  expected = x.sum(axis=0) if op == "add" else x.max(axis=0)
  for reduce in (
    functools.partial(reduce_rows, scratch_ref=None, emulate=True),
    shared_reduce_rows,
  ):
    got = np.asarray(reduce(jnp.asarray(x), op))
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert np.isnan(got[3]) and np.isfinite(np.delete(got, 3)).all()


@pytest.mark.parametrize(
  "reduce", [functools.partial(reduce_rows, scratch_ref=None, emulate=True), shared_reduce_rows]
)
def test_bad_op_is_named(reduce):
  with pytest.raises(ValueError, match=r"op='min' is not supported; allowed: \('add', 'max'\)"):
    reduce(jnp.zeros((64, 8), jnp.float32), "min")


def _two_warpgroup_sums(x, own_scratch: bool):
  """x f32 [2, 64, 8] -> [2, 8]: warpgroup w sums x[w] over its rows."""

  def body(x_gmem, out_gmem, x_smem, out_smem, scratch_smem, barrier):
    w = lax.axis_index("warpgroup")
    plgpu.copy_gmem_to_smem(x_gmem.at[w], x_smem.at[w], barrier.at[w])
    plgpu.barrier_wait(barrier.at[w])
    rows = plgpu.layout_cast(x_smem[w], plgpu.Layout.WGMMA)
    if own_scratch:
      total = reduce_rows(rows, "add", scratch_smem.at[w], emulate=False)
    else:
      total = rows.sum(axis=0)
    out_smem[w] = total
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[w], out_gmem.at[w])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
    body,
    out_type=jax.ShapeDtypeStruct((2, 8), jnp.float32),
    num_threads=2,
    thread_name="warpgroup",
    scratch_types=(
      plgpu.SMEM((2, 64, 8), jnp.float32),
      plgpu.SMEM((2, 8), jnp.float32),
      plgpu.SMEM((2, SCRATCH_WORDS), jnp.float32),
      plgpu.Barrier(num_barriers=2),
    ),
    compiler_params=_compat.mosaic_gpu_compiler_params(reduction_scratch_bytes=0),
  )(x)


def _lower(own_scratch: bool) -> str:
  x = jax.ShapeDtypeStruct((2, 64, 8), jnp.float32)
  function = functools.partial(_two_warpgroup_sums, own_scratch=own_scratch)
  return jax.jit(function).trace(x).lower(lowering_platforms=("cuda",)).as_text()


def test_own_scratch_lowers_where_the_programs_scratch_is_refused():
  assert "mosaic_gpu" in _lower(own_scratch=True)
  with pytest.raises(ValueError, match="Required reduction scratch size"):
    _lower(own_scratch=False)
