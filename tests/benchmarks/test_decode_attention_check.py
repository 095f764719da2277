"""benchmarks/decode_attention.py --check: the kernel-vs-reference grid a GPU or TPU session
runs first, run here in its CPU smoke form (--small: the kernels interpreted), for either
kernel family (`--check-family`)."""

import argparse

import pytest

from tests.benchmarks.benchmark_modules import load_benchmark


# Both families' grids under -m slow (GPU 24 s, TPU 22-28 s): the script a device session runs,
# its kernels tested on their own in the default run.
@pytest.mark.slow
@pytest.mark.parametrize("family, rows", [("tpu", 10), ("gpu", 14)])
def test_the_check_poisons_the_planned_outputs_and_adds_gears_xla_terms(family, rows):
  """Before: 3 poisoned splits where the TPU planner makes 1 or 2 (every TPU case an error),
  no poisoned scores buffer, no value terms for GEAR's terms by XLA (the folded GPU kernel's
  default; the TPU kernel's outliers before v56), which the GPU check never ran. Since v56 the
  TPU kernel computes all of GEAR's terms: it writes no scores."""
  benchmark = load_benchmark("decode_attention")
  found = benchmark.check_grid(
    argparse.Namespace(small=True, check_family=family, check_variant="folded")
  )
  quantized = [row for row in found if row["name"].startswith("quantized")]
  assert len(quantized) == 4 and len(found) == rows
  for row in found:
    assert "error" not in row, row
    assert row["relative_error"] < (2e-5 if "float32" in row["name"] else 1e-2), row
  for row in quantized:
    assert row["unwritten"] == 0 and row["empty_row_ok"], row
  gear = [row for row in quantized if "gear=True" in row["name"]]
  assert len(gear) == 2
  if family == "tpu":
    assert all("unwritten_scores" not in row for row in gear)
  else:
    assert all(row["unwritten_scores"] == 0 for row in gear)
