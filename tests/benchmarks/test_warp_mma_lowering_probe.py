"""benchmarks/warp_mma_lowering_probe.py's kernel lowered for sm_90 (no GPU, no CUDA plugin)."""

import jax
import pytest

from tests.benchmarks.benchmark_modules import load_benchmark

probe = load_benchmark("warp_mma_lowering_probe")


def _lower(kernel, arguments) -> str:
  return jax.jit(kernel).trace(*arguments).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("rows", [8, 16])
@pytest.mark.parametrize("a_operand", ["registers", "shared_memory"])
def test_the_warp_level_key_product_lowers_for_sm90(rows, a_operand):
  """v44: the word-order key codes built in the MMA_LHS layout (`stage_words_in_word_order`
  with operand_layout="mma_lhs"), or loaded in it, are the A operand `plgpu.mma` (mma.sync per
  warp) takes: the product lowers, layout inference assigning them no relayout."""
  assert "mosaic_gpu" in _lower(*probe.probe_kernel(rows, a_operand))


def test_key_codes_in_the_wgmma_layout_are_refused_by_the_warp_level_product():
  """Mosaic GPU has no relayout between the wgmma layout and MMA_LHS: the reason for the
  "mma_lhs" option."""
  with pytest.raises(ValueError, match="Failed to infer a possible set of layouts"):
    _lower(*probe.probe_kernel(8, "registers", operand_layout="wgmma"))
