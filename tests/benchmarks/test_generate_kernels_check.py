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
  # the bf16 default runs first (KIVI-4, then KIVI-2), then KIVI-4 and KIVI-2 on f32 caches
  assert replaced == 4
  assert candidate_runs[0][2] == candidate_runs[1][2] == jnp.bfloat16
  assert [spec for spec, *_ in candidate_runs[:2]] == [
    "kivi:bits=4,residual=32",
    "kivi:bits=2,residual=32",
  ]


def test_the_warp_variant_runs_kivi_2_and_4_on_a_bf16_cache():
  """The warp variant's runs (2-bit codes at head_dim 64 included, which only it takes among the
  Mosaic GPU kernels), on bf16 caches: its statistics must be bf16."""
  warp_runs = [
    (spec, dtype)
    for spec, settings, *dtype in runs_to_check()
    if dict(settings.quantized or ()).get("variant") == "warp"
  ]
  assert warp_runs == [
    ("kivi:bits=2,residual=32", [jnp.bfloat16]),
    ("kivi:bits=4,residual=32", [jnp.bfloat16]),
  ]
