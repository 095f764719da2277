"""benchmarks/ncu_sass_summary.py on a small page shaped like ncu's SASS CSV (no GPU)."""

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "ncu_sass_summary.py"
_SPEC = importlib.util.spec_from_file_location("ncu_sass_summary", _PATH)
ncu_sass_summary = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ncu_sass_summary)

HEADER = (
  '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
  '"stall_long_sb","stall_wait","stall_long_sb (Not Issued)"'
)
# A prologue instruction run once per warp, a three-instruction loop run 40 times, an epilogue.
PAGE = "\n".join(
  [
    '"Kernel Name","quantized_decode_attention_2bit_triton",',
    HEADER,
    '"0x00","      LDC R1, c[0x0][0x28]","2","4","0","2","0"',
    '"0x10","      LOP3.LUT R3, R2, 0x30003, RZ, 0xc0, !PT","10","40","4","6","3"',
    '"0x20","      PRMT R4, R3, 0x5410, R5","30","40","30","0","29"',
    '"0x30","  @!P0 LOP3.LUT R6, R4, 0x43004300, RZ, 0xfc, !PT","8","40","0","8","0"',
    '"0x40","      STG.E [R6.64], R4","0","4","0","0","0"',
  ]
)


def test_stalls_are_shares_of_all_samples_by_reason_and_opcode():
  summary = ncu_sass_summary.summarise(PAGE)
  # 34 long-scoreboard and 16 wait samples; "Not Issued" columns are not counted again.
  assert summary.stall_fractions == pytest.approx({"long_sb": 34 / 50, "wait": 16 / 50})
  assert summary.stall_opcodes["long_sb"] == [
    ("PRMT", pytest.approx(30 / 50)),
    ("LOP3", pytest.approx(4 / 50)),
  ]
  assert summary.stall_opcodes["wait"][0] == ("LOP3", pytest.approx(14 / 50))


def test_the_hottest_loop_is_the_most_executed_instructions_predicates_stripped():
  summary = ncu_sass_summary.summarise(PAGE)
  assert summary.loop_executions == 40
  assert summary.loop_length == 3
  assert summary.loop_opcodes == {"LOP3": 2, "PRMT": 1}


def test_a_page_without_the_sass_columns_is_refused():
  with pytest.raises(ValueError, match="--page source --csv --print-source sass"):
    ncu_sass_summary.summarise('"Kernel Name","k",\n"Address","Source"\n"0x0","EXIT"')
