"""`benchmarks/tpu_static_cost.py`: the bundles of libtpu's dumps read right, and a TPU kernel's
counts bounded by what its block must do."""

import json
import os
import subprocess
import sys

import pytest

from tests.benchmarks.benchmark_modules import BENCHMARKS, load_benchmark

tpu_static_cost = load_benchmark("tpu_static_cost")
tpu_compile_check = load_benchmark("tpu_compile_check")

# As libtpu writes them: a prologue bundle, a loop of three (its header marked LB, its back
# edge the last branch), an exit bundle; one utilization row per bundle.
FINAL_BUNDLES = """= control target key start
LB: loop body
= control target key end

     0   :  { %s1 = smov 0 }
   0x1 LB: > { %v2 = vadd.f32 %v0, %v1  ;;  %v3 = vmul.f32 %v0, %v1 }
   0x2   : > { %v4 = vand.u32 %v2, %v3  ;;  %5 = sbr.rel (%p1) target = $region9 }
   0x3   : > { %6 = sbr.rel (!%p2) target = $region2 }
   0x4   :  { %7 = vsyncpa [#allocation8], 1 }
"""
UTILIZATION = """== CAPACTIY:
MXU, XLU, VALU, VPOP, EUP, VLOAD, VLOAD:FILL, VSTORE, VSTORE:SPILL, SALU
    4     3     4     2     1     3     3     1     1     2
== UTILIZATION:
0 0 0 0 0 0 0 0 0 1
0 0 2 0 0 1 0 0 0 0
0 0 1 0 0 0 0 1 0 1
0 0 0 0 0 0 0 0 0 1
0 0 0 0 0 0 0 0 0 0
"""


def test_the_loop_body_runs_from_its_header_to_its_back_edge():
  counts = tpu_static_cost.read_bundles(FINAL_BUNDLES, UTILIZATION)
  assert counts.total_bundles == 5
  assert counts.loop_bundles == 3
  assert counts.loop_unit_ops["VALU"] == 3
  assert counts.loop_unit_ops["SALU"] == 2
  assert counts.loop_unit_ops["VSTORE"] == 1
  assert counts.unit_capacity["VALU"] == 4


def test_a_utilization_table_of_other_bundles_is_refused():
  with pytest.raises(ValueError, match="4 utilization rows for 5 bundles"):
    tpu_static_cost.read_bundles(FINAL_BUNDLES, UTILIZATION.rstrip().rsplit("\n", 1)[0])


def _static_cost_rows(tmp_path, *kernels: str) -> list[dict]:
  """`tpu_static_cost.py` at head_dim 128, 512-token blocks, compiled for a v5e in a process
  of its own (the dump flags are read when libtpu loads)."""
  out = tmp_path / "rows.json"
  environment = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent))
  command = [sys.executable, str(BENCHMARKS / "tpu_static_cost.py"), "--kernels", *kernels]
  command += ["--block-tokens", "512", "--head-dim", "128", "--out", str(out)]
  subprocess.run(command, check=True, env=environment, capture_output=True, timeout=600)
  return json.loads(out.read_text())


needs_libtpu = pytest.mark.skipif(
  not tpu_compile_check.libtpu_available(), reason="libtpu is not installed"
)


@needs_libtpu
def test_the_quantized_kernel_issues_at_least_its_unpacking(tmp_path):
  """KIVI-2 (bfloat16 statistics: the codes as bfloat16 pairs, v57): each block makes 2 x [8
  words, 512] codes, 4 vregs each, into 8 pair chains: an AND and an OR per chain and vreg and
  two shifts, 144 VALU ops at the least; the loop body holds at least its VALU ops over the 4
  VALU slots of a bundle."""
  (row,) = _static_cost_rows(tmp_path, "kivi2")
  assert row["grid_steps"] == 8 * 8 * 32768 // 512
  assert row["loop_unit_ops"]["VALU"] >= 2 * 4 * (8 * 2 + 2)
  assert row["loop_bundles"] >= row["loop_unit_ops"]["VALU"] / row["unit_capacity"]["VALU"]
  assert row["static_cycles"] == row["grid_steps"] * row["loop_bundles"]
  assert row["loop_bundles"] < row["total_bundles"]


@needs_libtpu
@pytest.mark.slow  # about 40 s: GEAR's call compiled in a fresh process
def test_gears_row_counts_its_whole_cache_and_its_outliers_in_the_kernel(tmp_path):
  """GEAR-2 (rank 2, 164 outliers a 64-token block and side, uint16 indices): the whole cache's
  bytes, codes 2 x 64 MiB, key and value statistics 2 x 8 MiB each, A factors 2 x 8 MiB, B
  factors 2 x 16 MiB, outlier indices and values 4 x 16 MiB (256 slots a block, as a TPU cache
  stores them since v65: `stored_outlier_slots`; 10.25 MiB for 164 before). Its outliers are
  the kernel's (v56; it reads the 164, `outlier_slots_read`): per 128-token span it compares
  [128, 2 x 164] token and [128, 2 x 164] channel
  one-hots, 48 vregs each, so a 1024-token block issues at least 768 VALU ops; what XLA does
  around the kernel (by XLA's estimate) is a small part of it (with the outliers by XLA, v55:
  30.6 M estimated cycles a call against the kernel's 3.5 M)."""
  (gear,) = _static_cost_rows(tmp_path, "gear2")
  mib = 2**20
  assert gear["cache_bytes"] == 2 * 64 * mib + 6 * 8 * mib + 2 * 16 * mib + 4 * 16 * mib
  assert gear["block_tokens"] == 1024  # 512 rounded up to 16 GEAR blocks (uint16 rows)
  assert gear["loop_unit_ops"]["VALU"] >= 768
  assert gear["xla_estimated_cycles"] < gear["static_cycles"] / 10
