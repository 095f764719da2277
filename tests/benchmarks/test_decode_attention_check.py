"""benchmarks/decode_attention.py --check: the kernel-vs-reference grid a GPU or TPU session
runs first. Its TPU branch runs here with the TPU kernels interpreted (`--check-family tpu`)."""

import argparse

from tests.benchmarks.benchmark_modules import load_benchmark


def test_the_tpu_check_poisons_the_planned_outputs_and_adds_the_outlier_terms():
  """Before: 3 poisoned splits where the TPU planner makes 1 or 2 (every case an error), no
  poisoned scores buffer, no outlier value terms."""
  benchmark = load_benchmark("decode_attention")
  rows = benchmark.check_grid(
    argparse.Namespace(small=True, check_family="tpu", check_variant="folded")
  )
  quantized = [row for row in rows if row["name"].startswith("quantized")]
  assert len(quantized) == 4 and len(rows) == 10
  for row in rows:
    assert "error" not in row, row
    assert row["relative_error"] < (2e-5 if "float32" in row["name"] else 1e-2), row
  for row in quantized:
    assert row["unwritten"] == 0 and row["empty_row_ok"], row
  gear = [row for row in quantized if "gear=True" in row["name"]]
  assert len(gear) == 2 and all(row["unwritten_scores"] == 0 for row in gear)
