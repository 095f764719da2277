"""The runs of `benchmarks/generate_kernels_check.py` (which needs a GPU to run): a candidate
setting reaches the KIVI runs that use the default, and only those."""

import jax.numpy as jnp

from benchmarks.generate_kernels_check import runs_to_check
from kvjax.kernel_settings import KernelSettings


def test_kivi_settings_replace_the_default_of_the_kivi_runs_only():
  candidate = {"lowering": "mosaic_gpu", "variant": "folded", "value_operand": "registers"}
  default_runs, candidate_runs = runs_to_check(), runs_to_check(candidate)
  assert len(default_runs) == len(candidate_runs)
  replaced = 0
  for (spec, before, *dtype), (spec_after, after, *dtype_after) in zip(
    default_runs, candidate_runs
  ):
    assert (spec, dtype) == (spec_after, dtype_after)
    if spec.startswith("kivi") and before == KernelSettings():
      assert after == KernelSettings(quantized=candidate)
      replaced += 1
    else:
      assert after == before
  assert replaced == 3  # the bf16 default run first, then KIVI-4 and KIVI-2 on f32 caches
  assert candidate_runs[0][2] == jnp.bfloat16
